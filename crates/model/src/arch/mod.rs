//! The architecture registry: reads `general.architecture` and hands the file to the matching architecture
//! file, which turns metadata into a [`Config`]. Tensor loading is shared — every supported architecture uses
//! llama.cpp's tensor names (`blk.N.attn_q.weight` …) — and driven by the config's flags.
//!
//! Adding an architecture: a new file here with `fn config(&GgufFile) -> Result<Config, ModelError>` and one
//! line in [`config_from_gguf`].

mod gemma3;
mod llama;

use crate::config::Config;
use crate::error::ModelError;
use crate::weights::{LayerWeights, TensorLoader, Weights};
use gguf::GgufFile;

/// Reads the hyperparameters of whatever architecture the file holds.
pub fn config_from_gguf(file: &GgufFile) -> Result<Config, ModelError> {
    let arch = file.architecture()?;
    let config = match arch {
        "llama" | "mistral" => llama::config(file, crate::config::Arch::Llama)?,
        "qwen2" => llama::config(file, crate::config::Arch::Qwen2)?,
        "qwen3" => llama::config(file, crate::config::Arch::Qwen3)?,
        "gemma3" => gemma3::config(file)?,
        other => return Err(ModelError::UnsupportedArchitecture(other.to_string())),
    };
    validate(&config)?;
    Ok(config)
}

fn bad(key: &str, value: impl ToString, reason: &str) -> ModelError {
    ModelError::BadHyperparameter { key: key.into(), value: value.to_string(), reason: reason.into() }
}

/// Most layers a model may declare (the largest open models have under 200).
const MAX_LAYERS: usize = 1024;

/// Sanity limits so that a crafted file cannot make us allocate absurd buffers or divide by zero.
fn validate(c: &Config) -> Result<(), ModelError> {
    let p = c.arch.name();
    let checks: [(&str, usize, usize); 6] = [
        ("block_count", c.n_layers, MAX_LAYERS),
        ("embedding_length", c.n_embd, 65536),
        ("feed_forward_length", c.n_ff, 1 << 20),
        ("attention.head_count", c.n_head, 1024),
        ("attention.head_count_kv", c.n_head_kv, 1024),
        ("attention.key_length", c.head_dim, 4096),
    ];
    for (key, v, max) in checks {
        if v == 0 || v > max {
            return Err(bad(&format!("{p}.{key}"), v, &format!("must be in 1..={max}")));
        }
    }
    if c.n_head % c.n_head_kv != 0 {
        return Err(bad(&format!("{p}.attention.head_count_kv"), c.n_head_kv, "must divide head_count"));
    }
    if c.rope_dims > c.head_dim || c.rope_dims % 2 != 0 {
        return Err(bad(&format!("{p}.rope.dimension_count"), c.rope_dims, "must be even and <= the head width"));
    }
    if c.head_dim_v == 0 || c.head_dim_v > 4096 {
        return Err(bad(&format!("{p}.attention.value_length"), c.head_dim_v, "must be in 1..=4096"));
    }
    Ok(())
}

/// Hyperparameter readers shared by the architecture files: `<arch>.<key>`.
pub(crate) struct Meta<'a> {
    pub file: &'a GgufFile,
    pub prefix: &'static str,
}

impl Meta<'_> {
    pub fn key(&self, k: &str) -> String {
        format!("{}.{}", self.prefix, k)
    }
    pub fn usize(&self, k: &str) -> Result<usize, ModelError> {
        Ok(self.file.get_u32(&self.key(k))? as usize)
    }
    /// `block_count`, checked against [`MAX_LAYERS`] before anything is sized by it.
    pub fn n_layers(&self) -> Result<usize, ModelError> {
        let n = self.usize("block_count")?;
        if n == 0 || n > MAX_LAYERS {
            return Err(bad(&self.key("block_count"), n, &format!("must be in 1..={MAX_LAYERS}")));
        }
        Ok(n)
    }
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>, ModelError> {
        Ok(self.file.opt_u32(&self.key(k))?.map(|v| v as usize))
    }
    pub fn opt_f32(&self, k: &str) -> Result<Option<f32>, ModelError> {
        Ok(self.file.opt_f32(&self.key(k))?)
    }
}

/// Loads all tensors named by llama.cpp's conventions; optional ones according to the config's flags.
pub fn load_weights(file: &GgufFile, c: &Config) -> Result<Weights, ModelError> {
    let t = TensorLoader { file };
    let d = c.n_embd;
    let token_embd = t.matrix("token_embd.weight", d, token_rows(file)?)?;
    let vocab = token_embd.rows;
    let output = if t.has("output.weight") { t.matrix("output.weight", d, vocab)? } else { token_embd.clone() };
    let output_norm = t.vector("output_norm.weight", d)?;
    let (qd, kvd, vd) = (c.q_dim(), c.kv_dim(), c.n_head_kv * c.head_dim_v);
    let att_d = c.n_head * c.head_dim_v;
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let bias = |s: &str, w: usize| t.opt_vector(&n(s), w);
        let qk_norm = |s: &str| if c.qk_norm { t.vector(&n(s), c.head_dim).map(Some) } else { Ok(None) };
        let post = |s: &str| if c.post_norms { t.vector(&n(s), d).map(Some) } else { Ok(None) };
        layers.push(LayerWeights {
            attn_norm: t.vector(&n("attn_norm.weight"), d)?,
            wq: t.matrix(&n("attn_q.weight"), d, qd)?,
            wk: t.matrix(&n("attn_k.weight"), d, kvd)?,
            wv: t.matrix(&n("attn_v.weight"), d, vd)?,
            wo: t.matrix(&n("attn_output.weight"), att_d, d)?,
            bq: bias("attn_q.bias", qd)?,
            bk: bias("attn_k.bias", kvd)?,
            bv: bias("attn_v.bias", vd)?,
            q_norm: qk_norm("attn_q_norm.weight")?,
            k_norm: qk_norm("attn_k_norm.weight")?,
            post_attn_norm: post("post_attention_norm.weight")?,
            ffn_norm: t.vector(&n("ffn_norm.weight"), d)?,
            w_gate: t.matrix(&n("ffn_gate.weight"), d, c.n_ff)?,
            w_up: t.matrix(&n("ffn_up.weight"), d, c.n_ff)?,
            w_down: t.matrix(&n("ffn_down.weight"), c.n_ff, d)?,
            post_ffn_norm: post("post_ffw_norm.weight")?,
        });
    }
    Ok(Weights { token_embd, layers, output_norm, output })
}

/// The vocabulary size as given by the embedding matrix.
pub(crate) fn token_rows(file: &GgufFile) -> Result<usize, ModelError> {
    let info = file
        .tensor("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor { name: "token_embd.weight".into() })?;
    match info.dims.as_slice() {
        [_, rows] => Ok(*rows),
        _ => Err(ModelError::BadShape {
            name: "token_embd.weight".into(),
            expected: vec![0, 0],
            found: info.dims.clone(),
        }),
    }
}

pub(crate) use token_rows as vocab_size;
