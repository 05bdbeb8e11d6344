//! Writes the seed corpora of the fuzz targets (`fuzz/seeds/<target>/`, see fuzz/README.md) from the project's
//! own fixtures and the real default models, small enough to commit:
//!
//! - `gguf_file`: the tiny random-weight model of every architecture, and each real model's metadata with its
//!   vocabulary arrays cut to 300 entries and no tensors;
//! - `chat_template`: each real model's chat template followed by a NUL and a short conversation;
//! - `head_files`: each shipped head, predictor and signal file with every dimension ≥ 64 divided by the
//!   greatest common divisor of those dimensions (shapes stay consistent, 16 MB becomes a few KB; files still
//!   over 64 KB are left out);
//! - `tokenizer_text`, `server_request`, `jsonl_files`: hand-written inputs and the first lines of the held-out
//!   prompt sets and the reasoning profiles.
//!
//! `cargo run --release -p engine --example fuzz_seeds -- fuzz/seeds` (models from `specee fetch all`).

use gguf::{GgufFile, GgufWriter, Value};
use std::collections::HashMap;
use std::path::Path;

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The file's metadata with every array cut to `keep` entries (the tokenizer stays loadable) and no tensors.
fn metadata_only(file: &GgufFile, keep: usize) -> Vec<u8> {
    let mut w = GgufWriter::new();
    for (k, v) in &file.metadata {
        let v = match v {
            Value::Array(items) => Value::Array(items.iter().take(keep).cloned().collect()),
            Value::String(s) if s.len() > 4096 => Value::String(s.chars().take(4096).collect()),
            other => other.clone(),
        };
        w.add(k.clone(), v);
    }
    w.to_bytes().unwrap()
}

/// A safetensors file with each dimension ≥ 64 divided by their greatest common divisor, data cut to fit.
fn shrunk_safetensors(bytes: &[u8]) -> Vec<u8> {
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let metadata: Option<HashMap<String, String>> = meta.metadata().clone();
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let big: Vec<usize> = st.tensors().iter().flat_map(|(_, t)| t.shape().to_vec()).filter(|&d| d >= 64).collect();
    let g = big.iter().fold(0, |a, &b| gcd(a, b)).max(1);
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let shape: Vec<usize> = t.shape().iter().map(|&d| if d >= 64 { d / g } else { d }).collect();
            (name, t, shape)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, t, shape)| {
            let n: usize = shape.iter().product::<usize>() * t.dtype().bitsize() / 8;
            let view = safetensors::tensor::TensorView::new(t.dtype(), shape.clone(), &t.data()[..n]).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, metadata).unwrap()
}

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "fuzz/seeds".into());
    let out = Path::new(&out);
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let m = model::testing::tiny_model(arch, None, 1, 64);
        write(out, "gguf_file", &format!("tiny-{arch}.gguf"), m.gguf().file_bytes());
    }
    for m in engine::fetch::DefaultModel::ALL {
        let path = engine::fetch::model_path(m);
        let Ok(file) = GgufFile::open(&path) else {
            eprintln!("{}: missing, skipped (run `specee fetch all`)", path.display());
            continue;
        };
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        write(out, "gguf_file", &format!("{stem}.meta.gguf"), &metadata_only(&file, 300));
        if let Ok(template) = file.get_str("tokenizer.chat_template") {
            let seed = format!("{template}\0system:You are helpful.\nuser:hi\nassistant:hello\nuser:bye");
            write(out, "chat_template", &format!("{stem}.jinja"), seed.as_bytes());
        }
    }
    for entry in std::fs::read_dir("heads").unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            let small = shrunk_safetensors(&bytes);
            // a file whose large dimensions share no divisor (the signal head's n_embd + 1) stays too big
            if small.len() <= 64 << 10 {
                write(out, "head_files", &name, &small);
            }
        }
    }
    let published = r#"{"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "vocab_size": 64}"#;
    write(out, "head_files", "published-config", format!("{published}\0").as_bytes());
    for (i, text) in [
        "The capital of France is",
        "<|im_start|>user\nWrite a function.<|im_end|>\n<|im_start|>assistant\n",
        "<start_of_turn>user\nhi<end_of_turn>\n",
        "def f(x):\n    return x * 2  # éàü 日本語 🙂\n\t\r\n",
        "  leading and   many    spaces\n\n\n12345 3.14 x=1;y=2",
    ]
    .iter()
    .enumerate()
    {
        for (j, flags) in [0u8, 0xC1, 0x42].iter().enumerate() {
            let mut seed = vec![*flags];
            seed.extend_from_slice(text.as_bytes());
            write(out, "tokenizer_text", &format!("text-{i}-{j}"), &seed);
        }
    }
    for (i, body) in [
        r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}"#,
        r#"{"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n", "x"], "stream": true, "stream_options": {"include_usage": true}, "n": 1, "specee": {"mode": "eagle"}}"#,
        r#"{"messages": [{"role": "user", "content": "hi", "name": "a"}], "max_completion_tokens": 4, "stop": "s"}"#,
        r#"{"prompt": "Once upon", "max_tokens": 16, "temperature": 0}"#,
        r#"{"prompt": [1, 2, 3], "stream": true, "stop": null, "specee": {"mode": "specee"}}"#,
        r#"{"prompt": ["a", "b"], "logprobs": 2}"#,
    ]
    .iter()
    .enumerate()
    {
        let endpoint = if body.contains("\"prompt\"") { 1u8 } else { 0 };
        let mut seed = vec![endpoint];
        seed.extend_from_slice(body.as_bytes());
        write(out, "server_request", &format!("body-{i}"), &seed);
    }
    for name in ["chat-heldout", "code-heldout", "plain-heldout", "reasoning-heldout"] {
        let text = std::fs::read_to_string(format!("bench/{name}.jsonl")).unwrap();
        let head: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
        write(out, "jsonl_files", name, head.as_bytes());
    }
    write(
        out,
        "jsonl_files",
        "records",
        b"{\"text\": \"hi\"}\n\n{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}\n",
    );
    for entry in std::fs::read_dir("profiles").unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        write(out, "jsonl_files", &name, &std::fs::read(&path).unwrap());
    }
}
