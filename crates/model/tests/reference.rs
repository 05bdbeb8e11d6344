//! Golden tests against llama.cpp (`../shared/reference`), teacher-forced along the reference's own greedy path:
//! our top-10 logits stay close to llama.cpp's and our greedy choice equals the reference at every step up to the
//! first near-tie. Covers the two real default models and the three synthetic random-weight models (llama with GQA
//! and untied head, qwen2 with biases, qwen3 with QK-norm).
//!
//! How close is reachable was measured: llama.cpp quantizes every activation to 8 bits before each product, so a
//! one-ulp difference anywhere (summation order, `exp`, f16 rounding) flips some roundings and spreads. The same
//! llama.cpp build (0c1e570, flash attention, 2 threads) run on another x86 machine differs from these references by
//! mean |Δlogit| 0.15 (SmolLM2) / 0.23 (Gemma), max 0.9–1.4, and flips greedy steps whose reference top-2 margin is
//! up to 0.2; an exact f64 forward differs by as much. On the 3-layer synthetic models it reproduces most steps
//! bit for bit (mean 0.01–0.02). Our attention accumulates in f32 where llama.cpp's one-row path rounds its
//! accumulator to f16 at every position (ours did too until session 15: mean 0.02–0.036, max 0.19); measured since:
//! mean 0.027–0.047, max 0.21, and one synthetic greedy step flipped at a reference margin of 0.093 (the real
//! models: mean 0.17–0.24, as before). Hence two tolerance sets: tight for the synthetic models, and for the 30/18-layer
//! real ones a bound on the mean error, a per-logit bound after removing the step's common shift (a uniform shift of
//! all logits changes no probability), and a wider near-tie margin.
//!
//! The real models are fetched by `specee fetch` (CI does this before the tests); a missing model fails.

use model::{Logits, Model, Workspace};
use serde_json::Value;
use std::path::PathBuf;

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn reference_dir() -> PathBuf {
    std::env::var_os("SPECEE_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/reference"))
}

fn models_dir() -> PathBuf {
    std::env::var_os("SPECEE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("models"))
}

fn load(path: PathBuf) -> Model {
    assert!(path.exists(), "{} is missing: run `cargo run --release -- fetch` first", path.display());
    Model::load(&path).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

struct Report {
    max_logit_err: f32,
    max_shifted_err: f32,
    sum_err: f64,
    n_err: usize,
    steps: usize,
    id_checks: usize,
}

/// What "close to llama.cpp" means for one model.
struct Tol {
    /// Greedy ids are compared up to the first step whose reference top-2 margin is below this.
    near_tie: f32,
    /// Bound on each |our logit - llama.cpp's|.
    abs: f32,
    /// Bound on each difference after subtracting the step's mean difference over the top ten.
    shifted: f32,
    /// Bound on the mean |our logit - llama.cpp's| over the whole file.
    mean: f32,
}

/// Tight tolerances for the 3-layer synthetic models (measured: max 0.21, mean ≤ 0.047; greedy flips up to a
/// reference margin of 0.093).
const SYNTHETIC: Tol = Tol { near_tie: 0.12, abs: 0.3, shifted: 0.3, mean: 0.06 };
/// Real models (measured for us: mean 0.15–0.25, shifted max 1.25; for llama.cpp on another machine: mean
/// 0.15–0.23, shifted max 1.0, greedy flips at margins up to 0.2).
const REAL: Tol = Tol { near_tie: 0.25, abs: 4.0, shifted: 1.6, mean: 0.35 };

/// Walks every record of a reference file teacher-forced along the reference path.
fn check(model: &Model, file: &str, tol: &Tol) -> Report {
    let text = std::fs::read_to_string(reference_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let mut ws = Workspace::new(2);
    let mut hidden = Vec::new();
    let mut report =
        Report { max_logit_err: 0.0, max_shifted_err: 0.0, sum_err: 0.0, n_err: 0, steps: 0, id_checks: 0 };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let rec: Value = serde_json::from_str(line).unwrap();
        let ids = |k: &str| rec[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let prompt = ids("prompt_ids");
        let greedy = ids("greedy_ids");
        let top10 = rec["top10_per_step"].as_array().unwrap();
        let mut kv = model.new_cache(prompt.len() + greedy.len() + 1);
        let mut logits = model.forward(&prompt, &mut kv, &mut ws, &mut hidden, Logits::Last).unwrap().to_vec();
        let mut ids_still_checked = true;
        for (step, &want) in greedy.iter().enumerate() {
            let refs: Vec<(u32, f32)> = top10[step]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                .collect();
            let diffs: Vec<f32> = refs.iter().map(|&(id, l)| logits[id as usize] - l).collect();
            let shift = diffs.iter().sum::<f32>() / diffs.len() as f32;
            for (&(id, l), &d) in refs.iter().zip(&diffs) {
                let (err, shifted) = (d.abs(), (d - shift).abs());
                report.max_logit_err = report.max_logit_err.max(err);
                report.max_shifted_err = report.max_shifted_err.max(shifted);
                report.sum_err += err as f64;
                report.n_err += 1;
                assert!(
                    err <= tol.abs && shifted <= tol.shifted,
                    "{file} prompt {:?} step {step}: logit of token {id} is {} vs llama.cpp {l} (difference {d}, {} after \
                     removing the step's common shift {shift}; tolerances {} / {})",
                    rec["prompt"].as_str().unwrap_or(""),
                    logits[id as usize],
                    d - shift,
                    tol.abs,
                    tol.shifted
                );
            }
            if refs.len() > 1 && refs[0].1 - refs[1].1 < tol.near_tie {
                ids_still_checked = false;
            }
            if ids_still_checked {
                let ours = logits
                    .iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                    .0;
                assert_eq!(ours as u32, want, "{file} prompt {:?} step {step}: greedy token differs", rec["prompt"]);
                report.id_checks += 1;
            }
            report.steps += 1;
            if step + 1 < greedy.len() {
                logits = model.forward(&[want], &mut kv, &mut ws, &mut hidden, Logits::Last).unwrap().to_vec();
            }
        }
    }
    let mean = (report.sum_err / report.n_err.max(1) as f64) as f32;
    eprintln!(
        "{file}: {} steps, {} greedy ids checked, |logit - llama.cpp| mean {mean:.4} max {:.4}, shift-free max {:.4}",
        report.steps, report.id_checks, report.max_logit_err, report.max_shifted_err
    );
    assert!(mean <= tol.mean, "{file}: mean |logit - llama.cpp| {mean} exceeds {}", tol.mean);
    report
}

#[test]
fn smollm2_matches_llama_cpp() {
    let m = load(models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"));
    let a = check(&m, "smollm2.greedy_raw.jsonl", &REAL);
    let b = check(&m, "smollm2.greedy_chat.jsonl", &REAL);
    assert!(a.id_checks >= 40 && b.id_checks >= 35, "too few greedy checks: {} raw, {} chat", a.id_checks, b.id_checks);
}

#[test]
fn gemma3_matches_llama_cpp() {
    let m = load(models_dir().join("gemma-3-270m-q4_k_m.gguf"));
    // Its Q5_0 layer matrices run interleaved as they are where the CPU has the AVX-512 VNNI kernel, else converted
    // to Q8_0 (both exact; unless SPECEE_REPACK=0): these checks cover the path this machine takes.
    if std::env::var("SPECEE_REPACK").map_or(true, |v| v != "0") {
        let gate = &m.weights.layers[0].w_gate;
        let ty = if kernels::repack::interleave_pays(gguf::GgmlType::Q5_0) {
            gguf::GgmlType::Q5_0
        } else {
            gguf::GgmlType::Q8_0
        };
        assert_eq!((gate.info.ty, gate.ty, gate.owned.is_some()), (gguf::GgmlType::Q5_0, ty, true));
    }
    let r = check(&m, "gemma3.greedy_raw.jsonl", &REAL);
    assert!(r.id_checks >= 60, "too few greedy checks: {}", r.id_checks);
}

/// Qwen2.5-Coder-0.5B (`qwen2`, 24 layers, untied Q8_0 head) against `reference/qwen-coder/` of this repository
/// (made by `scripts/llama_reference.py` with llama.cpp's Python binding).
#[test]
fn qwen_coder_matches_llama_cpp() {
    let m = load(models_dir().join("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"));
    assert_eq!((m.config.n_layers, m.config.n_embd, m.config.n_head, m.config.n_head_kv), (24, 896, 14, 2));
    let dir = workspace_root().join("reference/qwen-coder");
    let a = check(&m, dir.join("greedy_raw.jsonl").to_str().unwrap(), &REAL);
    let b = check(&m, dir.join("greedy_chat.jsonl").to_str().unwrap(), &REAL);
    assert!(
        a.id_checks >= 100 && b.id_checks >= 30,
        "too few greedy checks: {} raw, {} chat",
        a.id_checks,
        b.id_checks
    );
}

#[test]
fn synthetic_architectures_match_llama_cpp() {
    for name in ["synthetic-llama-gqa", "synthetic-qwen2", "synthetic-qwen3"] {
        let m = load(reference_dir().join(format!("synthetic/{name}.gguf")));
        check(&m, &format!("synthetic/{name}.greedy_raw.jsonl"), &SYNTHETIC);
    }
}
