//! Tree speculative decoding on tiny random-weight models (llama; gemma3 with a sliding window shorter than the
//! draft depth; qwen3 with QK-norm):
//! - greedy output equals dense greedy exactly, with the n-gram proposer, the oracle (full-depth acceptance with
//!   wrong siblings, so the cache is compacted from scattered slots) and a top-k self-draft tree;
//! - rolling back and continuing equals a fresh run;
//! - sampling preserves the target distribution: the first two committed tokens over many seeded draws, against
//!   the exact distribution computed from dense logits (chi-square test), for three proposers, one of which samples
//!   its children without replacement from its own distribution.

mod common;

use common::{dense_greedy, tiny_model, VOCAB};
use decode::sampling::Rng;
use decode::speculative::distribution::{target_distribution, DistributionScratch};
use decode::speculative::tree::ROOT;
use decode::speculative::{
    DraftContext, DraftTree, FeatureSource, NgramProposer, OracleProposer, Proposer, SpeculativeError,
};
use decode::{DenseDecoder, SamplingParams, SpeculativeDecoder};
use model::{KvCache, Logits, Model, Workspace};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

const PROMPTS: [&[u32]; 3] = [&[1, 5, 9, 33, 2, 17, 63, 40], &[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4], &[88]];

fn models() -> Vec<(&'static str, Model)> {
    vec![
        ("llama", tiny_model("llama", None, 1)),
        ("gemma3/window 3", tiny_model("gemma3", Some(3), 2)),
        ("qwen3", tiny_model("qwen3", None, 3)),
    ]
}

/// Runs a speculative decoder for exactly `n` tokens after `prompt`.
fn speculative<P: Proposer>(dec: &mut SpeculativeDecoder<'_, P>, prompt: &[u32], n: usize) -> Vec<u32> {
    dec.feed(prompt).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let got = dec.step_at_most(n - out.len()).unwrap();
        assert!(!got.is_empty());
        out.extend_from_slice(got);
    }
    assert_eq!(out.len(), n);
    out
}

#[test]
fn greedy_equals_dense_with_ngram_and_oracle() {
    const N: usize = 48;
    const DEPTH: usize = 5;
    for (name, model) in models() {
        for prompt in PROMPTS {
            let dense = dense_greedy(&model, prompt, N, 2);

            let mut ngram = SpeculativeDecoder::new(&model, 128, 2, NgramProposer::default(), SamplingParams::greedy());
            assert_eq!(speculative(&mut ngram, prompt, N), dense, "{name}, n-gram, prompt {prompt:?}");

            let reference: Vec<u32> = prompt.iter().chain(&dense).copied().collect();
            let oracle = OracleProposer::new(reference, DEPTH, 2, VOCAB);
            let mut dec = SpeculativeDecoder::new(&model, 128, 2, oracle, SamplingParams::greedy());
            assert_eq!(speculative(&mut dec, prompt, N), dense, "{name}, oracle, prompt {prompt:?}");
            let stats = dec.stats();
            // 48 = 8 steps × (5 drafts + 1 bonus): every draft accepted, the 18 wrong nodes of each tree rejected.
            assert_eq!(stats.target_forwards, N / (DEPTH + 1), "{name}: {stats:?}");
            assert_eq!(stats.acceptance_length(), (DEPTH + 1) as f64);
            assert_eq!(stats.drafted_nodes, stats.target_forwards * (DEPTH * 5 - 2));
            println!(
                "{name:16} prompt len {:2}: n-gram τ = {:.2} ({} forwards for {N} tokens), oracle τ = {:.2}",
                prompt.len(),
                ngram.stats().acceptance_length(),
                ngram.stats().target_forwards,
                stats.acceptance_length()
            );
        }
    }
}

/// Drafts from the target itself, flattened by a temperature (so the draft disagrees with the target now and
/// then): `top_k` children per node for `depth` levels — chosen as the top-k (deterministic) or sampled without
/// replacement from the draft distribution (with that distribution attached to the tree).
struct SelfDraft<'m> {
    model: &'m Model,
    temperature: f32,
    top_k: usize,
    depth: usize,
    sample_children: bool,
    rng: Rng,
    kv: KvCache,
    ws: Workspace,
    hidden: Vec<f32>,
}

impl<'m> SelfDraft<'m> {
    fn new(model: &'m Model, temperature: f32, top_k: usize, depth: usize, sample_children: bool, seed: u64) -> Self {
        let (kv, ws) = (model.new_cache(128), Workspace::new(1));
        SelfDraft { model, temperature, top_k, depth, sample_children, rng: Rng::new(seed), kv, ws, hidden: Vec::new() }
    }

    fn distribution(&mut self, tokens: &[u32]) -> Vec<(u32, f32)> {
        self.kv.clear();
        let logits = self.model.forward(tokens, &mut self.kv, &mut self.ws, &mut self.hidden, Logits::Last).unwrap();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f32> = logits.iter().map(|l| ((l - max) / self.temperature).exp()).collect();
        let total: f32 = w.iter().sum();
        w.iter().enumerate().map(|(t, &x)| (t as u32, x / total)).collect()
    }

    fn grow(&mut self, tree: &mut DraftTree, node: usize, tokens: &mut Vec<u32>, depth: usize) {
        if depth == self.depth {
            return;
        }
        let q = self.distribution(tokens);
        let mut picks = Vec::new();
        if self.sample_children {
            let mut left = q.clone();
            for _ in 0..self.top_k {
                let total: f32 = left.iter().map(|x| x.1).sum();
                let mut r = self.rng.next_f32() * total;
                let mut pick = left.len() - 1;
                for (i, x) in left.iter().enumerate() {
                    if r < x.1 {
                        pick = i;
                        break;
                    }
                    r -= x.1;
                }
                picks.push(left.remove(pick));
            }
            tree.set_child_distribution(node, q);
        } else {
            let mut sorted = q;
            sorted.sort_by(|a, b| b.1.total_cmp(&a.1));
            picks.extend_from_slice(&sorted[..self.top_k]);
        }
        for (token, prob) in picks {
            let child = tree.push(node, token, prob.ln());
            tokens.push(token);
            self.grow(tree, child, tokens, depth + 1);
            tokens.pop();
        }
    }
}

impl Proposer for SelfDraft<'_> {
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        let mut tokens = context.tokens.to_vec();
        self.grow(tree, ROOT, &mut tokens, 0);
        Ok(())
    }
}

#[test]
fn greedy_equals_dense_with_a_top_k_self_draft_and_after_rollback() {
    const N: usize = 30;
    for (name, model) in models() {
        let prompt = PROMPTS[0];
        let dense = dense_greedy(&model, prompt, N, 1);
        let draft = SelfDraft::new(&model, 1.5, 2, 3, false, 1);
        let mut dec = SpeculativeDecoder::new(&model, 64, 1, draft, SamplingParams::greedy());
        assert_eq!(speculative(&mut dec, prompt, N), dense, "{name}");
        assert!(dec.stats().acceptance_length() > 1.5, "{name}: a self-draft is mostly right: {:?}", dec.stats());
        // Roll back into the middle of the generated text and continue: same tokens again.
        let keep = prompt.len() + 11;
        dec.truncate(keep);
        let mut out = dec.tokens()[prompt.len()..].to_vec();
        while out.len() < N {
            out.extend_from_slice(dec.step_at_most(N - out.len()).unwrap());
        }
        assert_eq!(out, dense, "{name}: after rollback");
        // A boxed proposer works the same, and a full context is an error, not a panic.
        let boxed: Box<dyn Proposer> = Box::new(NgramProposer::default());
        let mut dec = SpeculativeDecoder::new(&model, prompt.len() + 4, 1, boxed, SamplingParams::greedy());
        dec.feed(prompt).unwrap();
        let mut got = Vec::new();
        let err = loop {
            match dec.step() {
                Ok(t) => got.extend_from_slice(t),
                Err(e) => break e,
            }
        };
        assert!(err.to_string().contains("context"), "{err}");
        assert_eq!(got, dense[..got.len()], "{name}: up to the context limit");
        assert_eq!(got.len(), 5, "{name}: 4 free slots give 5 tokens, as dense decoding would");
    }
}

/// Wilson–Hilferty approximation of the chi-square quantile for `df` degrees of freedom at normal quantile `z`.
fn chi_square_quantile(df: f64, z: f64) -> f64 {
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Chi-square statistic and degrees of freedom of `counts` against `expected` probabilities (outcomes expected
/// fewer than 5 times are pooled into one bin). Fails if an outcome with probability 0 was drawn.
fn chi_square(counts: &HashMap<(u32, u32), usize>, expected: &HashMap<(u32, u32), f64>, n: usize) -> (f64, f64) {
    for (k, &c) in counts {
        assert!(expected.get(k).copied().unwrap_or(0.0) > 0.0 || c == 0, "drew {k:?}, which has probability 0");
    }
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_e, mut pooled_c) = (0.0, 0.0);
    for (k, &p) in expected {
        let e = p * n as f64;
        let c = counts.get(k).copied().unwrap_or(0) as f64;
        if e >= 5.0 {
            stat += (c - e).powi(2) / e;
            bins += 1;
        } else {
            pooled_e += e;
            pooled_c += c;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_c - pooled_e).powi(2) / pooled_e;
        bins += 1;
    }
    (stat, (bins - 1) as f64)
}

#[test]
fn rejection_sampling_preserves_the_target_distribution() {
    let model = tiny_model("llama", None, 1);
    // A prompt ending in the model's own greedy text, so that the n-gram proposer's drafts are plausible.
    let mut prompt = PROMPTS[1].to_vec();
    prompt.extend(dense_greedy(&model, PROMPTS[1], 8, 1));
    let prompt = &prompt[..];
    let params = SamplingParams { temperature: 0.9, top_k: 8, top_p: 1.0, min_p: 0.0, seed: 11, ..Default::default() };

    // Exact distribution of the first two tokens, from dense logits.
    let mut scratch = DistributionScratch::default();
    let mut expected: HashMap<(u32, u32), f64> = HashMap::new();
    let mut dense = DenseDecoder::new(&model, 64, 1);
    let mut p1 = Vec::new();
    target_distribution(&params, dense.feed(prompt).unwrap(), prompt, &mut scratch, &mut p1);
    for (t1, &q1) in p1.iter().enumerate().filter(|(_, &q)| q > 0.0) {
        dense.truncate(prompt.len());
        let history: Vec<u32> = prompt.iter().copied().chain([t1 as u32]).collect();
        let mut p2 = Vec::new();
        target_distribution(&params, dense.feed(&[t1 as u32]).unwrap(), &history, &mut scratch, &mut p2);
        for (t2, &q2) in p2.iter().enumerate().filter(|(_, &q)| q > 0.0) {
            expected.insert((t1 as u32, t2 as u32), q1 as f64 * q2 as f64);
        }
    }
    let critical = |df: f64| chi_square_quantile(df, 3.719); // p = 1e-4

    const N: usize = 12_000;
    // Control: the dense sampler itself.
    let mut sampler = decode::Sampler::new(params.clone());
    let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
    for _ in 0..N {
        dense.truncate(prompt.len() - 1);
        let t1 = sampler.sample(dense.feed(&prompt[prompt.len() - 1..]).unwrap(), prompt);
        let history: Vec<u32> = prompt.iter().copied().chain([t1]).collect();
        let t2 = sampler.sample(dense.feed(&[t1]).unwrap(), &history);
        *counts.entry((t1, t2)).or_default() += 1;
    }
    let (stat, df) = chi_square(&counts, &expected, N);
    println!("dense sampler: chi² = {stat:.1}, df = {df}, critical {:.1}", critical(df));
    assert!(stat < critical(df), "the dense sampler disagrees with the computed distribution: {stat} (df {df})");

    let draft = |sample_children, seed| SelfDraft::new(&model, 2.0, 3, 1, sample_children, seed);
    let proposers: Vec<(&str, Box<dyn Proposer + '_>)> = vec![
        ("n-gram", Box::new(NgramProposer::default())),
        ("top-k self-draft", Box::new(draft(false, 5))),
        ("sampled self-draft", Box::new(draft(true, 6))),
    ];
    for (name, proposer) in proposers {
        let mut dec = SpeculativeDecoder::new(&model, 64, 1, proposer, params.clone());
        let mut counts: HashMap<(u32, u32), usize> = HashMap::new();
        for _ in 0..N {
            dec.reset();
            dec.feed(prompt).unwrap();
            // Trees are cut to depth 1, so a step commits a child and the bonus token below it, or one token.
            while dec.tokens().len() < prompt.len() + 2 {
                dec.step_at_most(prompt.len() + 2 - dec.tokens().len()).unwrap();
            }
            let t = &dec.tokens()[prompt.len()..];
            *counts.entry((t[0], t[1])).or_default() += 1;
        }
        let stats = dec.stats();
        let (stat, df) = chi_square(&counts, &expected, N);
        println!(
            "{name:18}: chi² = {stat:.1}, df = {df}, critical {:.1}; τ = {:.2}, {} of {} drafts accepted",
            critical(df),
            stats.acceptance_length(),
            stats.accepted_drafts,
            stats.drafted_nodes
        );
        // For the test to mean something, drafts must be accepted and rejected; the self-drafts are mostly right.
        assert!(stats.accepted_drafts > 0 && stats.accepted_drafts < stats.drafted_nodes, "{name}: {stats:?}");
        assert!(name == "n-gram" || stats.accepted_drafts > N / 2, "{name}: {stats:?}");
        assert!(
            stat < critical(df),
            "{name}: committed tokens are not distributed as the target's: chi² {stat} (df {df})"
        );
    }
}

/// What a proposer was last given: tokens, feature rows, stable prefix.
type Seen = Rc<RefCell<(Vec<u32>, Vec<f32>, usize)>>;

/// Records the feature rows it is given, and drafts like the oracle.
struct FeatureRecorder {
    source: FeatureSource,
    inner: OracleProposer,
    seen: Seen,
}

impl Proposer for FeatureRecorder {
    fn feature_source(&self) -> FeatureSource {
        self.source.clone()
    }
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        assert_eq!(context.features.len(), (context.tokens.len() - 1) * context.feature_width);
        *self.seen.borrow_mut() = (context.tokens.to_vec(), context.features.to_vec(), context.stable_prefix);
        self.inner.propose(context, tree)
    }
}

#[test]
fn proposers_get_the_targets_feature_rows_of_every_cached_token() {
    let model = tiny_model("llama", None, 1);
    let (d, layers) = (model.config.n_embd, model.config.n_layers);
    let prompt = PROMPTS[0];
    let dense = dense_greedy(&model, prompt, 20, 1);
    let reference: Vec<u32> = prompt.iter().chain(&dense).copied().collect();
    let sources = [
        FeatureSource::FinalNorm,
        FeatureSource::LayerInputs(vec![layers, 0]),
        FeatureSource::FinalNormAnd(vec![0, layers]),
    ];
    for source in sources {
        let seen = Rc::new(RefCell::new((Vec::new(), Vec::new(), 0)));
        let recorder = FeatureRecorder {
            source: source.clone(),
            inner: OracleProposer::new(reference.clone(), 3, 1, VOCAB),
            seen: seen.clone(),
        };
        let mut dec = SpeculativeDecoder::new(&model, 64, 1, recorder, SamplingParams::greedy());
        assert_eq!(speculative(&mut dec, prompt, 16), dense[..16]);
        let (tokens, features, stable) = seen.borrow().clone();
        assert_eq!(stable, tokens.len() - 4, "the previous step committed 4 tokens");
        // Dense forward over the same cached tokens: final hidden rows, and embeddings for layer 0's input.
        let cached = &tokens[..tokens.len() - 1];
        let (mut kv, mut ws, mut hidden) = (model.new_cache(64), Workspace::new(1), Vec::new());
        model.forward(cached, &mut kv, &mut ws, &mut hidden, Logits::None).unwrap();
        let mut normed = vec![0.0; hidden.len()];
        model.final_norm(&hidden, &mut normed);
        let mut embedded = vec![0.0; hidden.len()];
        model.embed(cached, &mut embedded).unwrap();
        for i in 0..cached.len() {
            let row = |v: &[f32]| v[i * d..(i + 1) * d].to_vec();
            let want = match &source {
                FeatureSource::FinalNorm => row(&normed),
                FeatureSource::FinalNormAnd(_) => [row(&normed), row(&embedded), row(&hidden)].concat(),
                _ => [row(&hidden), row(&embedded)].concat(),
            };
            let w = want.len();
            assert_eq!(features[i * w..(i + 1) * w], want[..], "{source:?}: token {i}");
        }
    }
}
