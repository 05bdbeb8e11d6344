//! SpecEE early exit on the real SmolLM2-135M-Instruct with its shipped draft head and exit predictors
//! (`heads/`): a decoder whose predictors never fire is dense decoding; tracing reproduces dense greedy and the
//! candidates' last-layer logits equal the dense logits of those tokens; the shipped predictors run, exit, and
//! keep the KV cache as their policy says. The same for merged mapping (`specee-eagle`): lossless when the
//! predictors never fire, exits inside the tree with the shipped ones.

mod common;

use common::{dense_greedy, models_dir, reference_dir, workspace_root};
use decode::sampling::argmax;
use decode::specee::{ExitPredictors, KvPolicy, MergedDecoder, SpecEeConfig, SpecEeDecoder, Verify};
use decode::speculative::{DraftHead, TreeConfig};
use decode::DenseDecoder;
use model::Model;
use serde_json::Value;

const THREADS: usize = 2;
const STEM: &str = "SmolLM2-135M-Instruct.Q4_1";

fn setup() -> (Model, DraftHead, ExitPredictors) {
    let path = models_dir().join(format!("{STEM}.gguf"));
    assert!(path.exists(), "{} is missing: run `cargo run --release -- fetch` first", path.display());
    let model = Model::load(&path).unwrap();
    let head = DraftHead::load(workspace_root().join(format!("heads/{STEM}.draft.safetensors"))).unwrap();
    let predictors = ExitPredictors::load(workspace_root().join(format!("heads/{STEM}.exit.safetensors"))).unwrap();
    predictors.check_fits(model.config.n_layers).unwrap();
    (model, head, predictors)
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    let path = reference_dir().join("smollm2.greedy_raw.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .map(|line| {
            let rec: Value = serde_json::from_str(line).unwrap();
            rec["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
        })
        .collect()
}

fn run(dec: &mut SpecEeDecoder<'_>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![dec.feed(prompt).unwrap()];
    while out.len() < n {
        out.push(dec.step(*out.last().unwrap(), false).unwrap().token);
    }
    out
}

#[test]
fn never_exiting_equals_dense_and_traces_match_dense_logits() {
    let (model, head, predictors) = setup();
    let n_layers = model.config.n_layers;
    for prompt in prompts(2) {
        let want = dense_greedy(&model, &prompt, 24, THREADS);
        let config = SpecEeConfig { threshold: Some(2.0), ..Default::default() };
        let mut dec = SpecEeDecoder::new(&model, 256, THREADS, &head, &predictors, config);
        assert_eq!(run(&mut dec, &prompt, 24), want);
        assert_eq!(dec.stats().exits, 0);
        assert!(dec.stats().predictor_calls > 0);

        // Tracing: same tokens; the last layer's candidate logits are the dense logits of those ids.
        let mut dec = SpecEeDecoder::new(&model, 256, THREADS, &head, &predictors, config);
        let mut dense = DenseDecoder::new(&model, 256, THREADS);
        let mut next = dec.feed(&prompt).unwrap();
        assert_eq!(next, argmax(dense.feed(&prompt).unwrap()));
        for _ in 0..8 {
            let (mut trace, mut updates) = (Vec::new(), Vec::new());
            let step = dec.step_trace(next, &mut trace, &mut updates).unwrap();
            assert_eq!(updates.len(), n_layers * 2);
            let logits = dense.feed(&[next]).unwrap();
            assert_eq!(step.token, argmax(logits));
            assert_eq!(trace.len(), n_layers * 4);
            for (j, &c) in step.candidates.iter().enumerate() {
                let (got, want) = (trace[(n_layers - 1) * 4 + j], logits[c as usize]);
                assert!((got - want).abs() < 1e-3 * want.abs().max(1.0), "candidate {c}: {got} vs {want}");
            }
            next = step.token;
        }
    }
}

#[test]
fn shipped_predictors_exit_and_keep_the_kv_policy() {
    let (model, head, predictors) = setup();
    let n_layers = model.config.n_layers;
    let prompt = &prompts(3)[2];
    let want = dense_greedy(&model, prompt, 48, THREADS);
    for (policy, verify) in [(KvPolicy::Missing, Verify::Candidates), (KvPolicy::Propagate, Verify::Full)] {
        let config = SpecEeConfig { policy, verify, ..Default::default() };
        let mut dec = SpecEeDecoder::new(&model, 256, THREADS, &head, &predictors, config);
        let got = run(&mut dec, prompt, 48);
        let st = *dec.stats();
        let prefix = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{policy:?}/{verify:?}: matching prefix {prefix}/48, {:.2} layers, {:.0}% exits, {:.2} calls/token",
            st.avg_layers(),
            100.0 * st.exit_rate(),
            st.predictor_calls_per_token()
        );
        assert_eq!(got[0], want[0], "the first token comes from the dense prompt pass");
        assert!(st.predictor_calls > 0 && st.avg_layers() <= n_layers as f64);
        let (first, last) = (dec.kv().len(0), dec.kv().len(n_layers - 1));
        assert_eq!(first, prompt.len() + 47);
        if policy == KvPolicy::Propagate {
            assert_eq!(last, first);
        } else {
            // Only tokens that exited before the last layer are missing from it.
            assert!(last <= first && first - last <= st.exits, "{last} {first} {st:?}");
        }
    }
}

fn run_merged(dec: &mut MergedDecoder<'_>, prompt: &[u32], n: usize) -> Vec<u32> {
    dec.feed(prompt).unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        out.extend_from_slice(dec.step_at_most(n - out.len()).unwrap());
    }
    out
}

#[test]
fn merged_mapping_is_lossless_without_exits_and_exits_inside_trees() {
    let (model, head, predictors) = setup();
    let n_layers = model.config.n_layers;
    let head = std::sync::Arc::new(head);
    let tree = TreeConfig { depth: 3, top_k: 2, budget: 5, min_prob: 0.0 };
    let all = prompts(3);
    for prompt in &all[..2] {
        let want = dense_greedy(&model, prompt, 32, THREADS);
        let config = SpecEeConfig { threshold: Some(2.0), ..Default::default() };
        let mut dec = MergedDecoder::new(&model, 256, THREADS, head.clone(), tree, &predictors, config);
        assert_eq!(run_merged(&mut dec, prompt, 32), want, "never exiting is tree speculative decoding");
        assert_eq!(dec.stats().early_stops, 0);
        assert!(dec.stats().speculative.accepted_drafts > 0, "the shipped head drafts acceptable tokens");
    }
    let prompt = &all[2];
    let want = dense_greedy(&model, prompt, 48, THREADS);
    for policy in [KvPolicy::Deferred, KvPolicy::Missing] {
        // A threshold low enough that forwards stop before the last layer (this checks the cache around exits
        // inside trees, not quality): with the session-6 predictors 0.8 only skipped the last layer's head here, and
        // since the f32 attention (session 15) 0.6 exited only at the last layer.
        let config = SpecEeConfig { policy, threshold: Some(0.4), ..Default::default() };
        let mut dec = MergedDecoder::new(&model, 256, THREADS, head.clone(), tree, &predictors, config);
        let got = run_merged(&mut dec, prompt, 48);
        let st = *dec.stats();
        let prefix = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "merged {policy:?}: matching prefix {prefix}/48, τ {:.2}, {:.2} layers per forward, {:.0}% early stops",
            st.speculative.acceptance_length(),
            st.avg_layers(),
            100.0 * st.early_stop_rate()
        );
        assert!(st.early_stops > 0 && st.avg_layers() < n_layers as f64, "{st:?}");
        assert_eq!(dec.kv().len(0), dec.tokens().len() - 1);
        let last = dec.kv().len(n_layers - 1);
        match policy {
            KvPolicy::Missing => assert!(last < dec.kv().len(0), "rows that stopped early never reach the last layer"),
            _ => assert!(last <= dec.kv().len(0)),
        }
        for il in 0..n_layers {
            let pos = dec.kv().positions(il);
            assert!(pos.windows(2).all(|w| w[0] < w[1]), "{policy:?} layer {il}: positions out of order");
        }
    }
}
