//! Tree speculative decoding on the real default models: greedy output equals dense greedy exactly for 64 tokens,
//! with the n-gram proposer and the oracle, on the reference prompts of `../shared/reference`; prints τ and
//! timings. By default SmolLM2-135M-Instruct on 3 raw + 1 chat prompts and Gemma-3-270m on 2 raw prompts (the
//! machine is shared and slow); `SPECEE_SPEC_PROMPTS=all` runs all of them (SmolLM2 8 raw + 4 chat, Gemma 8 raw).
//!
//! The models are fetched by `specee fetch` (CI does this before the tests); a missing model fails.

mod common;

use common::{dense_greedy, models_dir, reference_dir, workspace_root};
use decode::speculative::{Datastore, DraftHead, EagleProposer, LookupChain, NgramProposer, OracleProposer, Proposer};
use decode::{SamplingParams, SpeculativeDecoder};
use model::Model;
use serde_json::Value;
use std::time::Instant;

const N: usize = 64;
const THREADS: usize = 2;

fn load() -> Model {
    load_file("SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn load_file(name: &str) -> Model {
    let path = models_dir().join(name);
    assert!(path.exists(), "{} is missing: run `cargo run --release -- fetch` first", path.display());
    Model::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

fn reference_prompts(file: &str) -> Vec<Vec<u32>> {
    let path = reference_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let rec: Value = serde_json::from_str(line).expect("reference line is JSON");
            rec["prompt_ids"].as_array().expect("prompt_ids").iter().map(|v| v.as_u64().expect("id") as u32).collect()
        })
        .collect()
}

/// Runs `n` tokens speculatively; returns them and the seconds taken.
fn run<P: Proposer>(dec: &mut SpeculativeDecoder<'_, P>, prompt: &[u32], n: usize) -> (Vec<u32>, f64) {
    let t = Instant::now();
    dec.feed(prompt).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        out.extend_from_slice(dec.step_at_most(n - out.len()).unwrap());
    }
    (out, t.elapsed().as_secs_f64())
}

fn check(model: &Model, label: &str, prompt: &[u32]) {
    let t = Instant::now();
    let dense = dense_greedy(model, prompt, N, THREADS);
    let dense_s = t.elapsed().as_secs_f64();
    let ctx = prompt.len() + N + 64;

    let mut ngram = SpeculativeDecoder::new(model, ctx, THREADS, NgramProposer::default(), SamplingParams::greedy());
    let (got, ngram_s) = run(&mut ngram, prompt, N);
    assert_eq!(got, dense, "{label}: n-gram speculative output differs from dense greedy");

    let reference: Vec<u32> = prompt.iter().chain(&dense).copied().collect();
    let oracle = OracleProposer::new(reference, 5, 2, model.config.vocab_size);
    let mut oracle = SpeculativeDecoder::new(model, ctx, THREADS, oracle, SamplingParams::greedy());
    let (got, oracle_s) = run(&mut oracle, prompt, N);
    assert_eq!(got, dense, "{label}: oracle speculative output differs from dense greedy");
    // Every draft accepted: 64 tokens in ⌈64 / 6⌉ = 11 forwards.
    assert_eq!(oracle.stats().target_forwards, N.div_ceil(6), "{label}: {:?}", oracle.stats());

    let (s, o) = (ngram.stats(), oracle.stats());
    println!(
        "{label:10} prompt {:3} tok | dense {:6.1} ms | n-gram {:6.1} ms, τ {:.2} ({} fwd, {} nodes drafted, draft {:.1}%) \
         | oracle {:6.1} ms, τ {:.2} ({} fwd of ≤{} rows)",
        prompt.len(),
        dense_s * 1e3,
        ngram_s * 1e3,
        s.acceptance_length(),
        s.target_forwards,
        s.drafted_nodes,
        100.0 * s.draft_share(),
        oracle_s * 1e3,
        o.acceptance_length(),
        o.target_forwards,
        1 + 5 * 5 - 2,
    );
}

#[test]
fn smollm2_greedy_speculative_equals_dense() {
    let model = load();
    let all = std::env::var("SPECEE_SPEC_PROMPTS").is_ok_and(|v| v == "all");
    let raw = reference_prompts("smollm2.greedy_raw.jsonl");
    let chat = reference_prompts("smollm2.greedy_chat.jsonl");
    let (n_raw, n_chat) = if all { (raw.len(), chat.len()) } else { (3, 1) };
    for (i, p) in raw.iter().take(n_raw).enumerate() {
        check(&model, &format!("raw {i}"), p);
    }
    for (i, p) in chat.iter().take(n_chat).enumerate() {
        check(&model, &format!("chat {i}"), p);
    }
}

/// Gemma 3 (sliding-window layers, 262k vocabulary): 2 raw prompts by default, all 8 with
/// `SPECEE_SPEC_PROMPTS=all`.
#[test]
fn gemma3_greedy_speculative_equals_dense() {
    let model = load_file("gemma-3-270m-q4_k_m.gguf");
    let all = std::env::var("SPECEE_SPEC_PROMPTS").is_ok_and(|v| v == "all");
    let raw = reference_prompts("gemma3.greedy_raw.jsonl");
    for (i, p) in raw.iter().take(if all { raw.len() } else { 2 }).enumerate() {
        check(&model, &format!("gemma {i}"), p);
    }
}

/// The shipped SmolLM2 draft head (`heads/`), alone, with its default prompt-lookup chain, and with the chain
/// falling back on a datastore (built from the model's greedy continuations of the *other* prompts): greedy EAGLE
/// output equals dense greedy on the 8 raw and 4 chat reference prompts × 64 tokens; prints τ per prompt.
#[test]
fn smollm2_eagle_head_greedy_equals_dense() {
    let model = load();
    let path = workspace_root().join("heads/SmolLM2-135M-Instruct.Q4_1.draft.safetensors");
    let head = DraftHead::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    head.check_fits(&model).unwrap();
    let raw = reference_prompts("smollm2.greedy_raw.jsonl");
    let chat = reference_prompts("smollm2.greedy_chat.jsonl");
    let prompts: Vec<&Vec<u32>> = raw.iter().chain(&chat).collect();
    let runs: Vec<Vec<u32>> =
        prompts.iter().map(|p| p.iter().copied().chain(dense_greedy(&model, p, N, THREADS)).collect()).collect();
    let mut drafted = [0; 3];
    for (i, prompt) in prompts.iter().enumerate() {
        let dense = runs[i][prompt.len()..].to_vec();
        let others = (0..runs.len()).filter(|&j| j != i).map(|j| (&runs[j][..], prompts[j].len()));
        let store = Some(std::sync::Arc::new(Datastore::build(others, Default::default(), model.config.vocab_size)));
        let lookups = [(0, None), (EagleProposer::DEFAULT_LOOKUP, None), (EagleProposer::DEFAULT_LOOKUP, store)];
        for (j, (lookup, store)) in lookups.into_iter().enumerate() {
            let mut proposer = EagleProposer::new(head.clone(), EagleProposer::default_tree());
            proposer.lookup = LookupChain::new(lookup).with_datastore(store);
            let mut dec =
                SpeculativeDecoder::new(&model, prompt.len() + N + 64, THREADS, proposer, SamplingParams::greedy());
            let (got, secs) = run(&mut dec, prompt, N);
            assert_eq!(got, dense, "prompt {i}, variant {j}: EAGLE output differs from dense greedy");
            let s = dec.stats();
            drafted[j] += s.drafted_nodes;
            println!(
                "eagle prompt {i:2} lookup {lookup} datastore {}: τ {:.2} ({} forwards), {:.1} ms",
                j == 2,
                s.acceptance_length(),
                s.target_forwards,
                secs * 1e3
            );
        }
    }
    assert!(drafted[0] > 0, "the head drafted nothing");
    assert!(drafted[1] > drafted[0], "the lookup chain added no node: {drafted:?}");
    assert!(drafted[2] > drafted[1], "the datastore added no node: {drafted:?}");
}

/// A chat prompt whose answer mostly repeats the prompt (a code fix), where prompt lookup shines.
const REPETITIVE: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
    <|im_start|>user\nFix the typo in this code and print the whole corrected code:\n\
    def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    retrun total / len(values)\n\n\
    def variance(values):\n    m = mean(values)\n    total = 0\n    for v in values:\n        total += (v - m) ** 2\n    \
    return total / len(values)\n<|im_end|>\n<|im_start|>assistant\n";

#[test]
fn smollm2_ngram_on_a_repetitive_prompt() {
    let model = load();
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let prompt = tok.encode(REPETITIVE, true, true);
    check(&model, "repetitive", &prompt);
}

/// Cost of one verification forward by tree size (layers vs. full-vocabulary head), to size trees for this
/// machine: `cargo test --release -p decode --test speculative_real -- --ignored --nocapture verify_cost`.
#[test]
#[ignore]
fn verify_cost_by_tree_size() {
    use model::{Mask, Workspace};
    let model = load();
    let d = model.config.n_embd;
    let mut ws = Workspace::new(THREADS);
    let prompt: Vec<u32> = (0..200).map(|i| 100 + i * 7).collect();
    let mut kv = model.new_cache(512);
    let mut hidden = Vec::new();
    model.forward(&prompt, &mut kv, &mut ws, &mut hidden, model::Logits::None).unwrap();
    for n in [1usize, 2, 4, 8, 12, 16, 24, 32] {
        let reps = 5;
        let (mut layers_s, mut head_s) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..reps {
            let tokens: Vec<u32> = (0..n as u32).map(|i| 300 + i).collect();
            let positions: Vec<u32> = (0..n as u32).map(|i| 200 + i).collect();
            let mut x = vec![0.0; n * d];
            let t = Instant::now();
            model.embed(&tokens, &mut x).unwrap();
            for il in 0..model.config.n_layers {
                model.layer(il, &mut x, &positions, Mask::Causal, &mut kv, &mut ws).unwrap();
            }
            layers_s = layers_s.min(t.elapsed().as_secs_f64());
            let t = Instant::now();
            let mut normed = vec![0.0; n * d];
            model.final_norm(&x, &mut normed);
            let mut logits = vec![0.0; n * model.config.vocab_size];
            model.head_full(&normed, n, &mut logits, &mut ws);
            head_s = head_s.min(t.elapsed().as_secs_f64());
            kv.truncate(200);
        }
        println!(
            "rows {n:2}: layers {:6.1} ms, head {:6.1} ms, total {:6.1} ms (best of {reps})",
            layers_s * 1e3,
            head_s * 1e3,
            (layers_s + head_s) * 1e3
        );
    }
}

/// τ and verified rows of the n-gram proposer under several settings, on every reference prompt plus the
/// repetitive one (deterministic counts, no timing): `… -- --ignored --nocapture ngram_settings`.
#[test]
#[ignore]
fn ngram_settings_sweep() {
    use decode::speculative::{NgramConfig, TreeConfig};
    let model = load();
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let mut prompts = reference_prompts("smollm2.greedy_raw.jsonl");
    prompts.extend(reference_prompts("smollm2.greedy_chat.jsonl"));
    prompts.push(tok.encode(REPETITIVE, true, true));
    let configs = [
        ("default", NgramConfig::default()),
        (
            "chain d5",
            NgramConfig { tree: TreeConfig { depth: 5, top_k: 1, budget: 5, min_prob: 0.0 }, ..Default::default() },
        ),
        (
            "d5 k2 b8",
            NgramConfig { tree: TreeConfig { depth: 5, top_k: 2, budget: 8, min_prob: 0.0 }, ..Default::default() },
        ),
        (
            "min_n 3 chain d5",
            NgramConfig {
                min_n: 3,
                tree: TreeConfig { depth: 5, top_k: 1, budget: 5, min_prob: 0.0 },
                ..Default::default()
            },
        ),
        (
            "min_n 3 d6 k2 b10",
            NgramConfig {
                min_n: 3,
                tree: TreeConfig { depth: 6, top_k: 2, budget: 10, min_prob: 0.0 },
                ..Default::default()
            },
        ),
    ];
    for (name, config) in configs {
        let (mut forwards, mut nodes, mut tokens) = (0, 0, 0);
        let mut per_prompt = Vec::new();
        for p in &prompts {
            let mut dec = SpeculativeDecoder::new(
                &model,
                p.len() + N + 64,
                THREADS,
                NgramProposer::new(config),
                SamplingParams::greedy(),
            );
            run(&mut dec, p, N);
            let s = dec.stats();
            forwards += s.target_forwards;
            nodes += s.drafted_nodes;
            tokens += s.committed_tokens;
            per_prompt.push(format!("{:.2}", s.acceptance_length()));
        }
        println!(
            "{name:18}: τ {:.2} overall, {forwards} forwards, {nodes} drafted rows; per prompt τ {}",
            tokens as f64 / forwards as f64,
            per_prompt.join(" ")
        );
    }
}
