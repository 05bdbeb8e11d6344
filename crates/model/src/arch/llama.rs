//! Llama-family architectures: Llama 2/3, Mistral (`llama`), Qwen2/2.5 (`qwen2`: biases on Q/K/V, NEOX RoPE)
//! and Qwen3 (`qwen3`: per-head RMS norm of queries and keys, NEOX RoPE, head width set by `key_length`).
//! They share one layer (pre-norm attention with GQA + SwiGLU feed-forward); this file is the variant table.

use super::{vocab_size, Meta};
use crate::config::{Activation, Arch, Config, RopeStyle};
use crate::error::ModelError;
use gguf::GgufFile;

/// Reads a llama-family config; `arch` picks the variant flags.
pub fn config(file: &GgufFile, arch: Arch) -> Result<Config, ModelError> {
    let prefix = match arch {
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        _ => {
            if file.architecture()? == "mistral" {
                "mistral"
            } else {
                "llama"
            }
        }
    };
    let m = Meta { file, prefix };
    let n_embd = m.usize("embedding_length")?;
    let n_head = m.usize("attention.head_count")?;
    if n_head == 0 {
        return Err(super::bad(&m.key("attention.head_count"), 0, "must be positive"));
    }
    let head_dim = m.opt_usize("attention.key_length")?.unwrap_or(n_embd / n_head);
    let n_layers = m.n_layers()?;
    let rope_base = m.opt_f32("rope.freq_base")?.unwrap_or(10000.0);
    Ok(Config {
        arch,
        n_layers,
        n_embd,
        n_ff: m.usize("feed_forward_length")?,
        n_head,
        n_head_kv: m.opt_usize("attention.head_count_kv")?.unwrap_or(n_head),
        head_dim,
        head_dim_v: m.opt_usize("attention.value_length")?.unwrap_or(head_dim),
        vocab_size: vocab_size(file)?,
        rms_eps: m.opt_f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope_dims: m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
        rope_style: if arch == Arch::Llama { RopeStyle::Normal } else { RopeStyle::Neox },
        rope_base,
        rope_base_swa: rope_base,
        sliding_window: None,
        layer_is_swa: vec![false; n_layers],
        qk_norm: arch == Arch::Qwen3,
        post_norms: false,
        embed_scale: 1.0,
        activation: Activation::Silu,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        train_context: m.opt_usize("context_length")?.unwrap_or(4096),
    })
}
