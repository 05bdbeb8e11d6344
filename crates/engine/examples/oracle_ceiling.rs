//! The speed-up ceiling of tree speculative decoding on this machine: a perfect draft head — the dense greedy
//! continuation replayed as a chain of `depth` tokens by [`decode::speculative::OracleProposer`], drafting at no
//! cost, every draft accepted (τ = depth + 1) — against dense decoding of the same tokens, over a prompt file in
//! `specee bench --prompts` format (`{"prompt": …}` raw, `{"messages": […]}` rendered with the chat template).
//! It bounds what any draft head can reach: a real head accepts fewer tokens and pays for drafting.
//!
//! ```text
//! cargo run --release -p engine --example oracle_ceiling -- MODEL.gguf PROMPTS.jsonl [N=128] [THREADS=2] [DEPTHS=1,2,3,4,6,8]
//! ```
//! Prints, per depth, the rows each verification forward runs, τ, decode tok/s and the ratio to dense (all
//! prompts' tokens over all prompts' decode seconds; dense and the depths alternate prompt by prompt).

use decode::speculative::{OracleProposer, SpeculativeDecoder};
use decode::SamplingParams;
use engine::{Engine, GenerateParams};
use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: oracle_ceiling MODEL.gguf PROMPTS.jsonl [N=128] [THREADS=2] [DEPTHS=1,2,3,4,6,8]");
        std::process::exit(2);
    }
    let n: usize = args.get(3).map_or(128, |s| s.parse().expect("N"));
    let threads: usize = args.get(4).map_or(2, |s| s.parse().expect("THREADS"));
    let depths: Vec<usize> = args
        .get(5)
        .map_or_else(|| vec![1, 2, 3, 4, 6, 8], |s| s.split(',').map(|x| x.parse().expect("DEPTHS")).collect());
    let eng = Engine::load(Path::new(&args[1])).expect("loading the model");
    eng.model.warm_head_screen(threads);
    let prompts = engine::bench::read_prompts(&eng, Path::new(&args[2])).expect("reading the prompts");
    let params =
        GenerateParams { max_tokens: n, sampling: SamplingParams::greedy(), stop_at_eog: false, ..Default::default() };
    let vocab = eng.model.config.vocab_size;
    let (mut dense_s, mut tokens) = (0.0, 0usize);
    let mut oracle_s = vec![0.0; depths.len()];
    let mut forwards = vec![0usize; depths.len()];
    for ids in &prompts {
        let ctx = ids.len() + n + 64;
        let g = eng.generate(ids, &params, ctx, threads, |_| true).expect("dense generation");
        dense_s += g.timings.decode_seconds;
        tokens += g.generated_ids.len();
        let reference: Vec<u32> = ids.iter().chain(&g.generated_ids).copied().collect();
        for (k, &depth) in depths.iter().enumerate() {
            let oracle = OracleProposer::new(reference.clone(), depth, 0, vocab);
            let mut dec = SpeculativeDecoder::new(&eng.model, ctx, threads, oracle, SamplingParams::greedy());
            dec.feed(ids).expect("prefill");
            let t = Instant::now();
            let mut out = Vec::with_capacity(n);
            while out.len() < g.generated_ids.len() {
                out.extend_from_slice(dec.step_at_most(g.generated_ids.len() - out.len()).expect("step"));
            }
            oracle_s[k] += t.elapsed().as_secs_f64();
            forwards[k] += dec.stats().target_forwards;
            assert_eq!(out, g.generated_ids, "depth {depth}: the oracle's output differs from dense");
        }
    }
    let dense_rate = tokens as f64 / dense_s;
    println!("{} prompts × {n} tokens, {threads} threads: dense {dense_rate:.1} tok/s", prompts.len());
    println!("| perfect chain depth | rows per forward | τ | tok/s | vs dense |");
    println!("| --- | --- | --- | --- | --- |");
    for (k, &depth) in depths.iter().enumerate() {
        let rate = tokens as f64 / oracle_s[k];
        let tau = tokens as f64 / forwards[k] as f64;
        println!("| {depth} | {} | {tau:.2} | {rate:.1} | {:.2}× |", depth + 1, rate / dense_rate);
    }
}
