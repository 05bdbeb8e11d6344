//! Gemma 3 (`gemma3`): sliding-window attention (window from `gemma3.attention.sliding_window`) on five of
//! every six layers with a global layer every sixth, per-head RMS norm of queries and keys, extra RMS norms
//! after attention and feed-forward, GeGLU with tanh-GELU, embeddings scaled by sqrt(n_embd), NEOX RoPE with
//! base 10 000 on local layers and `rope.freq_base` (1e6) on global ones, tied output head.
//! Follows llama.cpp's `gemma3` graph; the norm weights in GGUF already include Gemma's `1 +` offset.

use super::{vocab_size, Meta};
use crate::config::{Activation, Arch, Config, RopeStyle};
use crate::error::ModelError;
use gguf::GgufFile;

/// Every `SWA_PATTERN`-th layer (1-based) uses global attention.
const SWA_PATTERN: usize = 6;
/// RoPE base of the sliding-window layers (fixed by the architecture).
const ROPE_BASE_LOCAL: f32 = 10_000.0;

/// Reads a Gemma 3 config.
pub fn config(file: &GgufFile) -> Result<Config, ModelError> {
    let m = Meta { file, prefix: "gemma3" };
    let n_embd = m.usize("embedding_length")?;
    let n_head = m.usize("attention.head_count")?;
    if n_head == 0 {
        return Err(super::bad(&m.key("attention.head_count"), 0, "must be positive"));
    }
    let head_dim = m.opt_usize("attention.key_length")?.unwrap_or(n_embd / n_head);
    let n_layers = m.n_layers()?;
    let window = m.opt_usize("attention.sliding_window")?;
    let layer_is_swa = (0..n_layers).map(|i| window.is_some() && (i + 1) % SWA_PATTERN != 0).collect();
    Ok(Config {
        arch: Arch::Gemma3,
        n_layers,
        n_embd,
        n_ff: m.usize("feed_forward_length")?,
        n_head,
        n_head_kv: m.opt_usize("attention.head_count_kv")?.unwrap_or(n_head),
        head_dim,
        head_dim_v: m.opt_usize("attention.value_length")?.unwrap_or(head_dim),
        vocab_size: vocab_size(file)?,
        rms_eps: m.opt_f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6),
        rope_dims: m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
        rope_style: RopeStyle::Neox,
        rope_base: m.opt_f32("rope.freq_base")?.unwrap_or(1_000_000.0),
        rope_base_swa: ROPE_BASE_LOCAL,
        sliding_window: window,
        layer_is_swa,
        qk_norm: true,
        post_norms: true,
        embed_scale: (n_embd as f32).sqrt(),
        activation: Activation::GeluTanh,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        train_context: m.opt_usize("context_length")?.unwrap_or(32768),
    })
}
