//! Hyperparameters of a decoder-only transformer, read from GGUF metadata by the architecture files in
//! [`crate::arch`]. The flags here are the only places where architectures differ inside the shared layer
//! ([`crate::layer`]): everything that is not a flag is the same computation for every model.

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` — llama.cpp's `LLAMA_ROPE_TYPE_NORM` (Llama, Mistral).
    Normal,
    /// Halves `(i, i + d/2)` — llama.cpp's `LLAMA_ROPE_TYPE_NEOX` (Qwen, Gemma).
    Neox,
}

/// The gate activation of the gated feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU: `gelu_tanh(gate) * up`.
    GeluTanh,
}

/// The architecture family named by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Arch {
    /// The GGUF name of the architecture (also the metadata key prefix).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// Everything the forward pass needs to know about a model's shape and variant.
#[derive(Clone, Debug)]
pub struct Config {
    pub arch: Arch,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per-head width of queries and keys.
    pub head_dim: usize,
    /// Per-head width of values.
    pub head_dim_v: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    /// Number of leading dimensions of each head that are rotated.
    pub rope_dims: usize,
    pub rope_style: RopeStyle,
    /// RoPE base of global-attention layers.
    pub rope_base: f32,
    /// RoPE base of sliding-window layers.
    pub rope_base_swa: f32,
    /// Sliding window width; a query at position p sees keys at positions q with `p - q < window`.
    pub sliding_window: Option<usize>,
    /// `true` for layers that use the sliding window.
    pub layer_is_swa: Vec<bool>,
    /// Per-head RMS norm of queries and keys before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Extra RMS norms after the attention and feed-forward blocks (Gemma 2/3).
    pub post_norms: bool,
    /// Multiplier applied to the token embeddings (Gemma: sqrt(n_embd)).
    pub embed_scale: f32,
    pub activation: Activation,
    /// Scale of the attention scores (usually 1/sqrt(head_dim)).
    pub attn_scale: f32,
    /// Context length the model was trained with (`<arch>.context_length`).
    pub train_context: usize,
}

impl Config {
    /// Width of the key (or value) projection output: all KV heads side by side.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Width of the query projection output.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
}
