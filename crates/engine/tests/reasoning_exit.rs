//! Reasoning exits on the synthetic Qwen2 model (random weights, SmolLM2's tokenizer: its greedy text repeats
//! words, so a profile whose "paragraph boundary" is one of them has boundaries every few tokens): without an exit,
//! or with one that never fires, generation is plain greedy generation token for token (DEER's trials are rolled
//! back); an exit cuts exactly at the first boundary and emits the exit text; a trial answer is what greedy
//! decoding writes after the exit text.

use engine::reasoning::{AnswerFormat, ReasoningProfile};
use engine::reasoning_exit::{ReasoningExit, TRIAL_TOKENS};
use engine::signals::{ExitPolicy, SignalHead};
use engine::speculative::AnyProposer;
use engine::{Engine, GenerateParams};
use std::path::PathBuf;
use std::sync::Arc;

fn synthetic(name: &str) -> Engine {
    let dir = std::env::var_os("SPECEE_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference"));
    Engine::load(dir.join(format!("synthetic/{name}.gguf"))).expect("a synthetic model")
}

fn engine() -> Engine {
    synthetic("synthetic-qwen2")
}

/// A profile whose boundary is a word the synthetic model repeats.
fn profile(boundary: &str) -> ReasoningProfile {
    ReasoningProfile {
        name: "test".into(),
        about: String::new(),
        system: None,
        user_suffix: String::new(),
        assistant_prefix: String::new(),
        end: None,
        exit_text: " Therefore".into(),
        answer: AnswerFormat::Boxed,
        boundary: boundary.into(),
    }
}

const N: usize = 40;

fn prompt(eng: &Engine) -> Vec<u32> {
    eng.tokenize_prompt("The capital of France is")
}

fn plain(eng: &Engine, ids: &[u32]) -> Vec<u32> {
    let params = GenerateParams { max_tokens: N, ..Default::default() };
    eng.generate(ids, &params, 256, 1, |_| true).unwrap().generated_ids
}

fn with_exit(
    eng: &Engine,
    ids: &[u32],
    p: &ReasoningProfile,
    exit: &ReasoningExit,
) -> (Vec<u32>, Option<usize>, usize) {
    let params = GenerateParams { max_tokens: N, ..Default::default() };
    let (g, s) = eng.generate_reasoning(ids, &params, 256, 1, AnyProposer::Dense, p, exit, |_| true).unwrap();
    (g.generated_ids, s.exited_at, s.trials)
}

/// Generated tokens up to and including each boundary of `ids`' text.
fn boundaries(eng: &Engine, ids: &[u32], boundary: &str) -> Vec<usize> {
    let mut bytes = Vec::new();
    let mut out = Vec::new();
    for (i, &t) in ids.iter().enumerate() {
        bytes.extend_from_slice(eng.tokenizer.token_bytes(t));
        if bytes.ends_with(boundary.as_bytes()) {
            out.push(i + 1);
        }
    }
    out
}

/// A signal head with zero weights whose outputs are its biases.
fn constant_head(eng: &Engine, raw: [f32; 3]) -> Arc<SignalHead> {
    let (d, h) = (eng.model.config.n_embd, 2);
    Arc::new(SignalHead {
        n_embd: d,
        hidden: h,
        w1: vec![0.0; h * (d + 1)],
        b1: vec![0.0; h],
        w2: vec![0.0; 3 * h],
        b2: raw.to_vec(),
        metadata: Default::default(),
    })
}

/// The word the synthetic model repeats most in its greedy answer: the boundary of the tests.
fn repeated_word(eng: &Engine, ids: &[u32]) -> String {
    let mut counts = std::collections::HashMap::new();
    for &t in ids {
        *counts.entry(t).or_insert(0usize) += 1;
    }
    let (&t, _) = counts.iter().max_by_key(|(t, c)| (**c, std::cmp::Reverse(**t))).unwrap();
    String::from_utf8_lossy(eng.tokenizer.token_bytes(t)).into_owned()
}

#[test]
fn without_an_exit_or_with_one_that_never_fires_generation_is_plain_greedy() {
    let eng = engine();
    let ids = prompt(&eng);
    let want = plain(&eng, &ids);
    let p = profile(&repeated_word(&eng, &want));
    assert!(boundaries(&eng, &want, &p.boundary).len() >= 2, "the test needs boundaries");
    assert_eq!(with_exit(&eng, &ids, &p, &ReasoningExit::None), (want.clone(), None, 0));
    // DEER whose threshold no probability passes: a trial at every boundary, each rolled back.
    let (got, exited, trials) = with_exit(&eng, &ids, &p, &ReasoningExit::Deer { threshold: 1.0 });
    assert_eq!((got, exited), (want.clone(), None));
    assert_eq!(trials, boundaries(&eng, &want, &p.boundary).len());
    let never = ReasoningExit::SpecExit(constant_head(&eng, [-30.0, 30.0, 0.0]), ExitPolicy::default());
    assert_eq!(with_exit(&eng, &ids, &p, &never), (want, None, 0));
}

#[test]
fn an_exit_cuts_at_the_first_boundary_and_emits_the_exit_text() {
    let eng = engine();
    let ids = prompt(&eng);
    let want = plain(&eng, &ids);
    let p = profile(&repeated_word(&eng, &want));
    let first = boundaries(&eng, &want, &p.boundary)[0];
    let exit_ids = eng.exit_ids(&p);
    let always = ReasoningExit::SpecExit(constant_head(&eng, [30.0, 30.0, 0.0]), ExitPolicy::default());
    for exit in [ReasoningExit::Deer { threshold: 0.0 }, always] {
        let (got, exited, _) = with_exit(&eng, &ids, &p, &exit);
        assert_eq!(exited, Some(first), "{}", exit.name());
        assert_eq!(&got[..first], &want[..first], "{}: lossless up to the cut", exit.name());
        assert_eq!(&got[first..first + exit_ids.len()], &exit_ids[..], "{}", exit.name());
        // After the exit text, greedy decoding goes on from the cut context.
        let mut context = ids.clone();
        context.extend_from_slice(&got[..first + exit_ids.len()]);
        let rest = plain(&eng, &context);
        assert_eq!(&got[first + exit_ids.len()..], &rest[..got.len() - first - exit_ids.len()], "{}", exit.name());
    }
}

#[test]
fn a_trace_holds_a_trial_at_every_boundary_and_each_is_greedy_after_the_exit_text() {
    let eng = engine();
    let ids = prompt(&eng);
    let want = plain(&eng, &ids);
    let p = profile(&repeated_word(&eng, &want));
    let params = GenerateParams { max_tokens: N, ..Default::default() };
    let trace = eng.reasoning_trace(&ids, &params, 256, 1, AnyProposer::Dense, &p).unwrap();
    assert_eq!(trace.generation.generated_ids, want);
    let at: Vec<usize> = trace.trials.iter().map(|(a, _)| *a).collect();
    assert_eq!(at, boundaries(&eng, &want, &p.boundary));
    assert_eq!(trace.features.len(), (want.len() - 1) * eng.model.config.n_embd);
    let exit_ids = eng.exit_ids(&p);
    for (a, trial) in trace.trials.iter().take(3) {
        let mut context = ids.clone();
        context.extend_from_slice(&want[..*a]);
        context.extend_from_slice(&exit_ids);
        let params = GenerateParams { max_tokens: TRIAL_TOKENS, ..Default::default() };
        let greedy = eng.generate(&context, &params, 256, 1, |_| true).unwrap().generated_ids;
        assert_eq!(trial.tokens, greedy, "trial at {a}");
        assert!(trial.mean_max_prob > 0.0 && trial.mean_max_prob <= 1.0);
        assert_eq!(trial.answer, None);
    }
}

/// The think profile's path on the synthetic Qwen3 model: the reasoning is open until `</think>`, an exit emits
/// `\n</think>\n\n` and the split then counts the reasoning up to the marker (exit text included) and the
/// answer after it. (A real Qwen3 or R1-Distill GGUF has `</think>` as one token, and the profile is its default.)
#[test]
fn the_think_profile_ends_the_reasoning_at_its_marker_after_an_exit() {
    let eng = synthetic("synthetic-qwen3");
    let ids = prompt(&eng);
    let want = plain(&eng, &ids);
    let think = ReasoningProfile::resolve(Some("think"), &eng).unwrap();
    assert_eq!(think.end.as_deref(), Some("</think>"));
    let p = ReasoningProfile { boundary: repeated_word(&eng, &want), ..think };
    let first = boundaries(&eng, &want, &p.boundary)[0];
    let (got, exited, _) = with_exit(&eng, &ids, &p, &ReasoningExit::Deer { threshold: 0.0 });
    assert_eq!(exited, Some(first));
    let split = p.split(&eng, &got);
    let exit_len = eng.exit_ids(&p).len();
    assert!(split.ended, "{:?}", eng.tokenizer.decode(&got));
    assert!(split.reasoning_tokens > first && split.reasoning_tokens <= first + exit_len, "{split:?}, cut at {first}");
    assert_eq!(split.reasoning_tokens + split.answer_tokens, got.len());
    // Without an exit the synthetic model never writes the marker: the reasoning never ends.
    assert!(!p.split(&eng, &want).ended);
}
