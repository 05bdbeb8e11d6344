//! Random-weight fixtures for tests (this crate's and the decoding strategies'): tiny models of every
//! architecture written with the GGUF writer and loaded through the normal path, so that consistency properties
//! (prefill vs token-by-token, rollback, tree masks, speculative == dense) can be checked in milliseconds.

use crate::Model;
use gguf::{GgmlType, GgufFile, GgufWriter, Value};

/// Width of every tiny model.
pub const D: usize = 32;
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

/// A tiny `arch` model (`llama`, `qwen2`, `qwen3` or `gemma3`) with random F32 weights drawn from `seed`: 3 layers,
/// width 32, 4 heads over 2 KV heads (head width 8, or 16 where QK-norm makes it independent of the width),
/// `vocab` tokens; Q/K/V biases on qwen2, QK-norm on qwen3 and gemma3, post-norms on gemma3; `window` sets a
/// sliding window (all three layers slide on gemma3).
pub fn tiny_model(arch: &str, window: Option<usize>, seed: u64, vocab: usize) -> Model {
    let mut rng = Lcg(seed.wrapping_mul(7919).wrapping_add(arch.len() as u64));
    let (n_head, n_kv) = (4usize, 2usize);
    let qk_norm = arch == "qwen3" || arch == "gemma3";
    let hd = if qk_norm { 16 } else { D / n_head };
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
    mat(&mut w, "token_embd.weight".into(), D, vocab, 1.0);
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
        if arch == "qwen2" {
            for (s, width) in [("attn_q.bias", qd), ("attn_k.bias", kvd), ("attn_v.bias", kvd)] {
                w.add_tensor(n(s), &[width], GgmlType::F32, f32_bytes(&vec![0.1; width]));
            }
        }
        if qk_norm {
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
