//! Shared helpers of the decode integration tests: tiny random-weight models written with the GGUF writer, dense
//! greedy reference runs, and paths of the real models and the reference outputs.
#![allow(dead_code)]

use decode::sampling::argmax;
use decode::DenseDecoder;
use gguf::{GgmlType, GgufFile, GgufWriter, Value};
use model::Model;
use std::path::PathBuf;

pub const VOCAB: usize = 96;
const D: usize = 32;
const FF: usize = 64;
const LAYERS: usize = 3;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tiny `arch` model (`llama`, `qwen3` or `gemma3`) with random F32 weights: 3 layers, width 32, 4 heads over
/// 2 KV heads, vocabulary 96; `window` sets a sliding window (all three layers slide on gemma3).
pub fn tiny_model(arch: &str, window: Option<usize>, seed: u64) -> Model {
    let mut rng = Lcg(seed.wrapping_mul(7919).wrapping_add(arch.len() as u64));
    let (n_head, n_kv) = (4usize, 2usize);
    let hd = if arch == "llama" { D / n_head } else { 16 };
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String(arch.into()));
    let k = |s: &str| format!("{arch}.{s}");
    w.add(k("block_count"), Value::U32(LAYERS as u32));
    w.add(k("embedding_length"), Value::U32(D as u32));
    w.add(k("feed_forward_length"), Value::U32(FF as u32));
    w.add(k("attention.head_count"), Value::U32(n_head as u32));
    w.add(k("attention.head_count_kv"), Value::U32(n_kv as u32));
    w.add(k("attention.key_length"), Value::U32(hd as u32));
    w.add(k("attention.value_length"), Value::U32(hd as u32));
    w.add(k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    w.add(k("rope.freq_base"), Value::F32(10000.0));
    w.add(k("context_length"), Value::U32(512));
    if let Some(win) = window {
        w.add(k("attention.sliding_window"), Value::U32(win as u32));
    }
    let mut mat = |w: &mut GgufWriter, name: String, cols: usize, rows: usize, scale: f32| {
        let v: Vec<f32> = (0..cols * rows).map(|_| rng.next() * scale).collect();
        w.add_tensor(name, &[cols, rows], GgmlType::F32, f32_bytes(&v));
    };
    mat(&mut w, "token_embd.weight".into(), D, VOCAB, 1.0);
    w.add_tensor("output_norm.weight", &[D], GgmlType::F32, f32_bytes(&[1.0; D]));
    let (qd, kvd) = (n_head * hd, n_kv * hd);
    for i in 0..LAYERS {
        let n = |s: &str| format!("blk.{i}.{s}");
        w.add_tensor(n("attn_norm.weight"), &[D], GgmlType::F32, f32_bytes(&[1.0; D]));
        w.add_tensor(n("ffn_norm.weight"), &[D], GgmlType::F32, f32_bytes(&[1.0; D]));
        mat(&mut w, n("attn_q.weight"), D, qd, 0.5);
        mat(&mut w, n("attn_k.weight"), D, kvd, 0.5);
        mat(&mut w, n("attn_v.weight"), D, kvd, 0.5);
        mat(&mut w, n("attn_output.weight"), qd, D, 0.3);
        mat(&mut w, n("ffn_gate.weight"), D, FF, 0.3);
        mat(&mut w, n("ffn_up.weight"), D, FF, 0.3);
        mat(&mut w, n("ffn_down.weight"), FF, D, 0.3);
        if arch != "llama" {
            w.add_tensor(n("attn_q_norm.weight"), &[hd], GgmlType::F32, f32_bytes(&vec![1.0; hd]));
            w.add_tensor(n("attn_k_norm.weight"), &[hd], GgmlType::F32, f32_bytes(&vec![1.0; hd]));
        }
        if arch == "gemma3" {
            w.add_tensor(n("post_attention_norm.weight"), &[D], GgmlType::F32, f32_bytes(&[1.0; D]));
            w.add_tensor(n("post_ffw_norm.weight"), &[D], GgmlType::F32, f32_bytes(&[1.0; D]));
        }
    }
    let file = GgufFile::from_bytes(w.to_bytes().expect("tiny model serialises")).expect("tiny model parses");
    Model::from_gguf(file).expect("tiny model loads")
}

/// Dense greedy decoding: `n` tokens after `prompt`, as the engine does it (prompt in one batch, then one token
/// per forward, argmax each time).
pub fn dense_greedy(model: &Model, prompt: &[u32], n: usize, threads: usize) -> Vec<u32> {
    let mut dec = DenseDecoder::new(model, prompt.len() + n + 1, threads);
    let mut out = Vec::with_capacity(n);
    let mut next = argmax(dec.feed(prompt).expect("dense prefill"));
    while out.len() < n {
        out.push(next);
        if out.len() < n {
            next = argmax(dec.feed(&[next]).expect("dense step"));
        }
    }
    out
}

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn reference_dir() -> PathBuf {
    std::env::var_os("SPECEE_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/reference"))
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("SPECEE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("models"))
}
