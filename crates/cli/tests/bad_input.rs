//! Bad input never panics or hangs: each case exits non-zero with one `error: …` line naming the problem.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specee-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A minimal GGUF (version 3, no alignment padding needed without tensors) with the given string metadata.
fn gguf_with(meta: &[(&str, &str)], u32s: &[(&str, u32)], tensor: Option<(&str, &[u64], u32, usize)>) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensor.is_some() as u64).to_le_bytes());
    b.extend_from_slice(&((meta.len() + u32s.len()) as u64).to_le_bytes());
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend_from_slice(&(t.len() as u64).to_le_bytes());
        b.extend_from_slice(t.as_bytes());
    };
    for (k, v) in meta {
        s(&mut b, k);
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, v);
    }
    for (k, v) in u32s {
        s(&mut b, k);
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
    }
    if let Some((name, dims, ty, n_bytes)) = tensor {
        s(&mut b, name);
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, n_bytes));
    }
    b
}

fn assert_clean_error(args: &[&str], expect: &str) {
    let o = specee(args, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(!o.status.success(), "{args:?} succeeded; stderr: {err}");
    assert_eq!(o.status.code(), Some(1), "{args:?}: exit status {:?}; stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one error line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{args:?}: {err}");
    assert!(lines[0].to_lowercase().contains(&expect.to_lowercase()), "{args:?}: expected '{expect}' in: {err}");
    // No cause said twice in a row (`draft head X: bad: bad`).
    let parts: Vec<&str> = lines[0].split(": ").collect();
    for i in 0..parts.len() {
        for len in 1..=(parts.len() - i) / 2 {
            assert_ne!(parts[i..i + len], parts[i + len..i + 2 * len], "{args:?}: a repeated cause in: {err}");
        }
    }
}

fn generate(path: &Path) -> Vec<String> {
    vec![
        "generate".into(),
        "-m".into(),
        path.display().to_string(),
        "-p".into(),
        "hello".into(),
        "-n".into(),
        "4".into(),
    ]
}

fn run_generate(path: &Path, expect: &str) {
    let args = generate(path);
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    assert_clean_error(&args, expect);
}

#[test]
fn missing_file() {
    run_generate(Path::new("/nonexistent/model.gguf"), "not found");
}

#[test]
fn empty_file() {
    let p = tmp("empty.gguf");
    std::fs::write(&p, b"").unwrap();
    run_generate(&p, "empty");
}

#[test]
fn random_bytes() {
    let p = tmp("random.gguf");
    let mut x = 0x1234_5678u32;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    std::fs::write(&p, bytes).unwrap();
    run_generate(&p, "not a GGUF");
}

#[test]
fn truncated_gguf() {
    let full = std::fs::read(reference_dir().join("synthetic/synthetic-qwen2.gguf")).unwrap();
    // Cut inside the header, inside the metadata, and inside the tensor data.
    for (cut, expect) in [(10, "truncat"), (2000, "truncat"), (full.len() / 2, "outside the file")] {
        let p = tmp(&format!("truncated-{cut}.gguf"));
        std::fs::write(&p, &full[..cut]).unwrap();
        run_generate(&p, expect);
    }
}

#[test]
fn header_only_gguf() {
    let p = tmp("header-only.gguf");
    std::fs::write(&p, gguf_with(&[], &[], None)).unwrap();
    run_generate(&p, "general.architecture");
}

#[test]
fn unsupported_architecture() {
    let p = tmp("mamba.gguf");
    std::fs::write(&p, gguf_with(&[("general.architecture", "mamba")], &[], None)).unwrap();
    run_generate(&p, "unsupported architecture 'mamba'");
}

#[test]
fn unsupported_tensor_type() {
    // A llama header whose embedding is IQ2_XXS (type 16: 66 bytes per 256 values), which we cannot compute with.
    let u32s = [
        ("llama.block_count", 1),
        ("llama.embedding_length", 256),
        ("llama.feed_forward_length", 512),
        ("llama.attention.head_count", 4),
    ];
    let p = tmp("iq2.gguf");
    std::fs::write(
        &p,
        gguf_with(&[("general.architecture", "llama")], &u32s, Some(("token_embd.weight", &[256, 8], 16, 66 * 8))),
    )
    .unwrap();
    run_generate(&p, "IQ2_XXS");
}

#[test]
fn prompt_longer_than_context() {
    let m = smollm2();
    let long = "word ".repeat(100);
    assert_clean_error(&["generate", "-m", m.to_str().unwrap(), "-p", &long, "-n", "4", "-c", "32"], "context");
}

#[test]
fn missing_text_file_for_perplexity() {
    let m = smollm2();
    assert_clean_error(&["perplexity", "-m", m.to_str().unwrap(), "-f", "/nonexistent.txt"], "cannot read");
}

#[test]
fn specee_mode_refuses_sampling_missing_predictors_and_lossless_eval() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    assert_clean_error(&["generate", "-m", m, "-p", "Hi", "-n", "4", "--mode", "specee", "--temp", "0.8"], "greedily");
    assert_clean_error(
        &["generate", "-m", m, "-p", "Hi", "-n", "4", "--mode", "specee", "--exit", "/nonexistent.safetensors"],
        "no exit predictors",
    );
    let junk = tmp("junk.exit.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    assert_clean_error(
        &["generate", "-m", m, "-p", "Hi", "-n", "4", "--mode", "specee", "--exit", junk.to_str().unwrap()],
        "not a safetensors file",
    );
    let text = common::reference_dir().join("perplexity-text.txt");
    assert_clean_error(&["eval", "-m", m, "--mode", "eagle", "--text", text.to_str().unwrap()], "lossless");
    // A bad flag value is a usage error (clap: exit status 2) naming the choices.
    let o = common::specee(
        &["generate", "-m", m, "-p", "Hi", "--mode", "specee", "--kv-policy", "lost"],
        Duration::from_secs(60),
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(common::stderr(&o).contains("missing, propagate or deferred"), "{}", common::stderr(&o));
    // Sampling settings that would make every probability NaN are usage errors too.
    for (flag, value, expect) in [
        ("--temp", "nan", "finite"),
        ("--temp", "inf", "finite"),
        ("--top-p", "1.5", "probability"),
        ("--min-p", "nan", "probability"),
        ("--repeat-penalty", "0", "above 0"),
    ] {
        let o = common::specee(&["generate", "-m", m, "-p", "Hi", flag, value], Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(2), "{flag} {value}");
        assert!(common::stderr(&o).contains(expect), "{flag} {value}: {}", common::stderr(&o));
    }
}

#[test]
fn eagle_mode_names_a_bad_draft_head() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let eagle = |draft: &str, expect: &str| {
        assert_clean_error(&["generate", "-m", m, "-p", "Hi", "-n", "4", "--mode", "eagle", "--draft", draft], expect)
    };
    let junk = tmp("junk.draft.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    eagle(junk.to_str().unwrap(), "not a safetensors file");
    // A bad datastore, and a missing one named explicitly.
    let store = |path: &str, expect: &str| {
        let args = ["generate", "-m", m, "-p", "Hi", "-n", "4", "--mode", "eagle", "--datastore", path];
        assert_clean_error(&args, expect)
    };
    store(junk.to_str().unwrap(), "not a datastore");
    store("/nonexistent.datastore.safetensors", "cannot read");
    // Gemma's head on SmolLM2: the manifest names both models; without it (a head from before manifests), the
    // wrong hidden size, said once.
    let gemma_head = common::workspace_root().join("heads/gemma-3-270m-q4_k_m.draft.safetensors");
    eagle(gemma_head.to_str().unwrap(), "it was made for gemma-3-270m-q4_k_m.gguf (gemma3, 18 layers, d 640");
    let old = tmp("old-gemma.draft.safetensors");
    std::fs::copy(&gemma_head, &old).unwrap();
    let strip =
        common::specee(&["inspect", old.to_str().unwrap(), "--set", "base_model.arch="], Duration::from_secs(30));
    assert!(strip.status.success(), "{}", common::stderr(&strip));
    eagle(old.to_str().unwrap(), "hidden size 640");
}

/// SmolLM2's shipped head and predictors on Qwen2.5-Coder (called by name): one line naming the model each was
/// made for.
#[test]
fn smollm2_heads_on_qwen_coder_are_one_line_errors() {
    common::qwen_coder();
    let heads = common::workspace_root().join("heads");
    let draft = heads.join("SmolLM2-135M-Instruct.Q4_1.draft.safetensors");
    let exit = heads.join("SmolLM2-135M-Instruct.Q4_1.exit.safetensors");
    let base = ["generate", "-m", "qwen-coder", "-p", "Hi", "-n", "4", "--mode"];
    let made_for = "it was made for SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers, d 576";
    assert_clean_error(&[&base[..], &["eagle", "--draft", draft.to_str().unwrap()]].concat(), made_for);
    let specee = ["specee", "--draft", draft.to_str().unwrap(), "--exit", exit.to_str().unwrap()];
    assert_clean_error(&[&base[..], &specee].concat(), made_for);
}

#[test]
fn train_draft_refuses_bad_learning_rates_and_a_missing_record_file() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let out = tmp("bad.draft.safetensors");
    let out = out.to_str().unwrap();
    let base =
        ["train-draft", "-m", m, "--data", "/nonexistent.jsonl", "--heldout", "/nonexistent.jsonl", "--out", out];
    let with = |extra: &[&'static str]| base.iter().chain(extra).copied().collect::<Vec<&str>>();
    assert_clean_error(&with(&["--lr-end", "2"]), "--lr-end between 0 and 1");
    assert_clean_error(&with(&["--lr", "0"]), "--lr must be positive");
    assert_clean_error(&with(&["--epochs", "0"]), "/nonexistent.jsonl");
    assert_clean_error(&with(&["--data", "/elsewhere/nonexistent.jsonl"]), "two --data files are named");
}

#[test]
fn reasoning_profiles_and_problem_files_that_cannot_be_used_are_one_line_errors() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let bad = tmp("bad-profile.json");
    std::fs::write(&bad, r#"{"name": "x", "answer": "words"}"#).unwrap();
    let bad = bad.to_str().unwrap();
    assert_clean_error(&["generate", "-m", m, "--reasoning", bad, "-p", "hi", "-n", "1"], "unknown variant `words`");
    assert_clean_error(&["generate", "-m", m, "--reasoning", "nonesuch", "-p", "hi"], "no reasoning profile named");
    let problems = tmp("problems.jsonl");
    std::fs::write(&problems, "{\"question\": \"q\", \"answer\": \"seven\"}\n").unwrap();
    let p = problems.to_str().unwrap();
    assert_clean_error(&["eval-reasoning", "-m", m, "--problems", p], "problems.jsonl:1: expected");
    assert_clean_error(&["eval-reasoning", "-m", m, "--problems", p, "--profile", bad], "reasoning profile");
}

/// A signal-head file (`w1 [hidden, d + 1]`, …, zeros) with `metadata`, written by hand as safetensors.
fn signal_file(name: &str, d: usize, metadata: &[(&str, &str)]) -> PathBuf {
    let hidden = 2;
    let shapes = [("w1", vec![hidden, d + 1]), ("b1", vec![hidden]), ("w2", vec![3, hidden]), ("b2", vec![3])];
    let mut header = serde_json::Map::new();
    let meta: serde_json::Map<String, serde_json::Value> =
        metadata.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect();
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0;
    for (n, shape) in &shapes {
        let bytes = shape.iter().product::<usize>() * 4;
        header.insert(
            n.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let header = serde_json::Value::Object(header).to_string().into_bytes();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(vec![0u8; offset]);
    let path = tmp(name);
    std::fs::write(&path, file).unwrap();
    path
}

#[test]
fn signal_head_files_that_cannot_be_used_are_one_line_errors() {
    let m = smollm2();
    let m = m.to_str().unwrap();
    let problems = tmp("signal-problems.jsonl");
    std::fs::write(&problems, "{\"question\": \"What is 2 + 3?\", \"answer\": 5}\n").unwrap();
    let p = problems.to_str().unwrap();
    let run = |signals: &str, expect: &str| {
        let args = ["eval-reasoning", "-m", m, "--problems", p, "--reasoning-exit", "specexit", "--signals", signals];
        assert_clean_error(&args, expect);
    };
    let garbage = tmp("garbage.safetensors");
    std::fs::write(&garbage, b"not safetensors at all").unwrap();
    run(garbage.to_str().unwrap(), "signal heads");
    run(tmp("missing.safetensors").to_str().unwrap(), "no signal heads at");
    let format = [("format", "specee-reasoning-signals-1")];
    let no_format = signal_file("no-format.safetensors", 576, &[]);
    run(no_format.to_str().unwrap(), "not a signal-head file");
    let wide = signal_file("wide.safetensors", 896, &format);
    run(wide.to_str().unwrap(), "made for feature rows of 896 values, the model has 576");
    let qwen = [
        ("format", "specee-reasoning-signals-1"),
        ("base_model", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"),
        ("base_model.arch", "qwen2"),
        ("base_model.n_layers", "24"),
        ("base_model.n_embd", "896"),
        ("base_model.vocab", "151936"),
    ];
    let other = signal_file("other.safetensors", 576, &qwen);
    run(other.to_str().unwrap(), "made for Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf");
    // Reasoning exits read feature rows that only dense and eagle decoding keep.
    let args = ["eval-reasoning", "-m", m, "--problems", p, "--reasoning-exit", "deer", "--mode", "specee"];
    assert_clean_error(&args, "reasoning exits run with --mode dense or eagle");
}
