//! The ceiling of continuous batching, without a server:
//! `cargo run --release -p model --example batchbench -- MODEL [threads] [steps] [sizes]`.
//! For each batch size B (default 1,2,4,8,16,32): B sequences, each prefilled with its own 96-token prompt, then
//! `steps` (default 32) batched decode steps, each one forward of B rows ([`Model::forward_batch`]) plus the
//! greedy head of the B rows (as the server's batching scheduler runs them); prints ms per step, aggregate
//! tokens/s and that over B = 1. Best of 3 repetitions per size.
use model::{KvCache, Model, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let threads: usize = args.get(2).map_or(2, |s| s.parse().unwrap());
    let steps: usize = args.get(3).map_or(32, |s| s.parse().unwrap());
    let sizes: Vec<usize> =
        args.get(4).map_or("1,2,4,8,16,32", |s| s.as_str()).split(',').map(|s| s.parse().unwrap()).collect();
    m.warm_head_screen(threads);
    let mut ws = Workspace::new(threads);
    let d = m.config.n_embd;
    let (mut hidden, mut normed) = (Vec::new(), Vec::new());
    let mut base = 0.0;
    println!("| B | ms / step | tok/s | × B=1 |");
    println!("| ---: | ---: | ---: | ---: |");
    for &b in &sizes {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let mut kvs: Vec<KvCache> = (0..b).map(|_| m.new_cache(96 + steps + 1)).collect();
            for (i, kv) in kvs.iter_mut().enumerate() {
                let prompt: Vec<u32> = (0..96u32).map(|t| 100 + (t * 7 + i as u32 * 13) % 5000).collect();
                m.forward(&prompt, kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
            }
            let mut next: Vec<u32> = (0..b as u32).map(|i| 200 + i).collect();
            let t0 = Instant::now();
            for _ in 0..steps {
                let tokens: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
                let mut refs: Vec<&mut KvCache> = kvs.iter_mut().collect();
                m.forward_batch(&tokens, &mut refs, &mut ws, &mut hidden).unwrap();
                normed.resize(b * d, 0.0);
                m.final_norm(&hidden[..b * d], &mut normed[..b * d]);
                let mut out = vec![0u32; b];
                m.head_argmax(&normed, b, &mut out, &mut ws);
                next = out;
            }
            best = best.min(t0.elapsed().as_secs_f64() / steps as f64);
        }
        let tps = b as f64 / best;
        if b == sizes[0] {
            base = tps / b as f64;
        }
        println!("| {b} | {:.2} | {:.0} | {:.2}× |", best * 1e3, tps, tps / base);
    }
}
