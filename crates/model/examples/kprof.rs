//! Multi-row forward timing/profiling without the CLI:
//! `cargo run --release -p model --example kprof -- MODEL K [threads] [iters]`.
//! Prefills 64 tokens (`KPROF_CTX=N`: N), then runs `iters` forwards of `K` rows with logits for all rows
//! (`KPROF_NOHEAD=1`: none; truncating the cache back after each), and prints the median milliseconds. Meant for `valgrind --tool=callgrind` and
//! `perf record` A/B comparisons of the multi-row path.
use model::{KvCache, Logits, Model, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    // What the model builds on first use (the interleaved head, the screen) is built before timing, as `bench` does.
    m.warm_head_screen(args.get(3).map_or(2, |s| s.parse().unwrap()));
    let k: usize = args.get(2).map_or(8, |s| s.parse().unwrap());
    let threads: usize = args.get(3).map_or(2, |s| s.parse().unwrap());
    let iters: usize = args.get(4).map_or(5, |s| s.parse().unwrap());
    let mut ws = Workspace::new(threads);
    let mut h = Vec::new();
    let ctx: u32 = std::env::var("KPROF_CTX").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let prompt: Vec<u32> = (0..ctx).map(|i| 100 + (i * 7) % 20000).collect();
    let mut kv = m.new_cache(prompt.len() + k + 1);
    m.forward(&prompt, &mut kv, &mut ws, &mut h, Logits::None).unwrap();
    let ids: Vec<u32> = (0..k as u32).map(|i| 300 + i * 11).collect();
    let cpu0 = cpu_seconds();
    let mut times = measure(&m, &ids, iters, &mut kv, &mut ws, &mut h);
    let cpu = (cpu_seconds() - cpu0) / iters as f64 * 1e3;
    let first = times[0];
    times.sort_by(f64::total_cmp);
    println!(
        "k {k} threads {threads}: median {:.3} ms (min {:.3}, first {first:.1}), main thread CPU {cpu:.3} ms per forward",
        times[times.len() / 2],
        times[0]
    );
}

/// The measured forwards (a separate function so that callgrind can collect only inside it:
/// `--toggle-collect=*measure*`).
#[inline(never)]
fn measure(m: &Model, ids: &[u32], iters: usize, kv: &mut KvCache, ws: &mut Workspace, h: &mut Vec<f32>) -> Vec<f64> {
    let base = kv.seq_len();
    let mut times = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        m.forward(ids, kv, ws, h, if std::env::var("KPROF_NOHEAD").is_ok() { Logits::None } else { Logits::All })
            .unwrap();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        kv.truncate(base);
    }
    times
}

/// CPU time of the calling thread (user + system, from /proc; 10 ms ticks, so use many iterations). With one
/// thread this is robust to other load on the machine, unlike wall time.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = after.split_whitespace().map(|v| v.parse().unwrap_or(0.0)).collect();
    // Fields 14 and 15 (utime, stime) counting from 1; `after` starts at field 3.
    (f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0)) / 100.0
}
