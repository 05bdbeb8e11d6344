//! Decode-step timing without the CLI:
//! `cargo run --release -p model --example decbench -- MODEL [threads] [steps] [reps]`.
//! Per rep: prefills 64 tokens, decodes `steps` single tokens (fixed ids), then one 8-row step with
//! logits for all rows; prints tok/s per rep and the best decode rate.
use model::{Logits, Model, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let threads: usize = args.get(2).map_or(2, |s| s.parse().unwrap());
    let steps: usize = args.get(3).map_or(64, |s| s.parse().unwrap());
    let reps: usize = args.get(4).map_or(3, |s| s.parse().unwrap());
    let mut ws = Workspace::new(threads);
    let mut h = Vec::new();
    let prompt: Vec<u32> = (0..64u32).map(|i| 100 + i * 7).collect();
    let mut best = 0f64;
    for rep in 0..reps {
        let mut kv = m.new_cache(prompt.len() + steps + 8);
        let t0 = Instant::now();
        m.forward(&prompt, &mut kv, &mut ws, &mut h, Logits::Last).unwrap();
        let pp = prompt.len() as f64 / t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        for s in 0..steps {
            m.forward(&[200 + s as u32], &mut kv, &mut ws, &mut h, Logits::Last).unwrap();
        }
        let tg = steps as f64 / t0.elapsed().as_secs_f64();
        best = best.max(tg);
        let t0 = Instant::now();
        let ids: Vec<u32> = (0..8).map(|i| 300 + i).collect();
        m.forward(&ids, &mut kv, &mut ws, &mut h, Logits::All).unwrap();
        let k8 = t0.elapsed().as_secs_f64() * 1e3;
        println!("rep {rep}: pp {pp:.1} tok/s, tg {tg:.1} tok/s ({:.3} ms/tok), k8 {k8:.3} ms", 1e3 / tg);
    }
    println!("best tg {best:.1} tok/s");
}
