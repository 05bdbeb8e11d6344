//! Times the output head alone: full logits (`head_full`) against the screened greedy argmax (`head_argmax`),
//! for 1, 2 and 4 rows of real hidden states (the screen forced on whatever the head's size). `cargo run --release -p model --example headbench -- MODEL.gguf [threads]`
use model::{Model, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let threads = args.get(2).map_or(2, |s| s.parse().unwrap());
    let (d, v) = (m.config.n_embd, m.config.vocab_size);
    let mut ws = Workspace::new(threads);
    assert!(m.force_head_screen(threads), "no head screen for this head");
    // Real hidden states: the last 8 rows of a forward over fixed token ids.
    let ids: Vec<u32> = (0..40u32).map(|i| 300 + i * 37).collect();
    let (mut kv, mut hidden) = (m.new_cache(64), Vec::new());
    m.forward(&ids, &mut kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
    let mut normed = vec![0.0; 8 * d];
    m.final_norm(&hidden[(ids.len() - 8) * d..], &mut normed);
    let mut logits = vec![0.0; 8 * v];
    let mut out = [0u32; 8];
    for n in [1usize, 2, 4] {
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
}
