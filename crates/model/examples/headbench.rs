//! Prints how long building the head screen took, then times the output head alone: full logits (`head_full`)
//! against the screened greedy argmax (`head_argmax`), for 1, 2, 4, 8 and 16 rows of real hidden states (the screen
//! forced on whatever the head's size). `cargo run --release -p model --example headbench -- MODEL.gguf [threads] [REFERENCE.jsonl]`
//!
//! With a reference file (`../shared/reference/*.greedy_*.jsonl`; its first record's prompt and greedy ids are
//! the tokens), it then times what a tree verification pays instead: a forward of n = 1–16 rows after ~80 tokens of
//! context plus the head's argmax, with the interleaved full product or the screen, alternating 200 times each
//! (the body's weights pass through the caches in between, as in decoding). Medians, ms.
use model::{Model, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let threads = args.get(2).map_or(2, |s| s.parse().unwrap());
    let (d, v) = (m.config.n_embd, m.config.vocab_size);
    let mut ws = Workspace::new(threads);
    let built = Instant::now();
    assert!(m.force_head_screen(threads), "no head screen for this head");
    println!("screen built in {:.1} ms on {threads} threads", built.elapsed().as_secs_f64() * 1e3);
    // Real hidden states: the last 16 rows of a forward over fixed token ids.
    let ids: Vec<u32> = (0..64u32).map(|i| 300 + i * 37).collect();
    let (mut kv, mut hidden) = (m.new_cache(64), Vec::new());
    m.forward(&ids, &mut kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
    let mut normed = vec![0.0; 16 * d];
    m.final_norm(&hidden[(ids.len() - 16) * d..], &mut normed);
    let mut logits = vec![0.0; 16 * v];
    let mut out = [0u32; 16];
    // `HEADBENCH_ROWS=16` times only that many rows (for a profile of one size).
    let only: Option<usize> = std::env::var("HEADBENCH_ROWS").ok().and_then(|v| v.parse().ok());
    for n in [1usize, 2, 4, 8, 16].into_iter().filter(|&n| only.is_none_or(|o| o == n)) {
        for round in 0..3 {
            let t = Instant::now();
            for _ in 0..50 {
                m.head_full(&normed, n, &mut logits, &mut ws);
            }
            let full = t.elapsed().as_secs_f64() / 50.0 * 1e3;
            let t = Instant::now();
            let mut exact = 0;
            for _ in 0..50 {
                exact += m.head_argmax(&normed, n, &mut out, &mut ws);
            }
            let screened = t.elapsed().as_secs_f64() / 50.0 * 1e3;
            println!(
                "rows {n} round {round}: full {full:.3} ms, screened {screened:.3} ms ({:.0} exact rows/call)",
                exact as f64 / 50.0
            );
        }
    }
    if let Some(reference) = args.get(3) {
        forward_then_head(&m, threads, reference);
    }
}

/// The forward-plus-head comparison (see the module header).
fn forward_then_head(m: &Model, threads: usize, reference: &str) {
    let text = std::fs::read_to_string(reference).expect("reference file");
    let rec: serde_json::Value = serde_json::from_str(text.lines().next().expect("a record")).expect("a JSON record");
    let ids_of = |key: &str| -> Vec<u32> {
        rec[key].as_array().expect("a list of ids").iter().map(|v| v.as_u64().expect("an id") as u32).collect()
    };
    let mut ids = ids_of("prompt_ids");
    ids.extend(ids_of("greedy_ids"));
    let (ctx, d, v) = (ids.len().min(100), m.config.n_embd, m.config.vocab_size);
    const MAX: usize = 16;
    assert!(ctx > 2 * MAX, "too few reference tokens");
    let mut ws = Workspace::new(threads);
    let (mut kv, mut hidden) = (m.new_cache(ctx + MAX), Vec::new());
    m.forward(&ids[..ctx - MAX], &mut kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
    let base = kv.seq_len();
    let (mut normed, mut logits, mut out) = (vec![0.0; MAX * d], vec![0.0; MAX * v], [0u32; MAX]);
    for n in [1usize, 2, 3, 4, 6, 8, 12, MAX] {
        let mut times = [Vec::new(), Vec::new()];
        for i in 0..400 {
            let t = Instant::now();
            m.forward(&ids[ctx - MAX..ctx - MAX + n], &mut kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
            m.final_norm(&hidden[..n * d], &mut normed[..n * d]);
            if i % 2 == 0 {
                m.head_full(&normed, n, &mut logits, &mut ws);
                for (o, row) in out.iter_mut().zip(logits.chunks_exact(v)).take(n) {
                    *o = kernels::screen::first_max(row) as u32;
                }
            } else {
                m.head_argmax(&normed, n, &mut out, &mut ws);
            }
            times[i % 2].push(t.elapsed().as_secs_f64() * 1e3);
            kv.truncate(base);
        }
        let median = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let (full, screened) = (median(&mut times[0]), median(&mut times[1]));
        println!("forward + head, rows {n}: interleaved {full:.3} ms, screened {screened:.3} ms");
    }
}
