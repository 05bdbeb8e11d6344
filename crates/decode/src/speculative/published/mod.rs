//! Published EAGLE draft heads for Llama-family targets: loading EAGLE-1/2 and EAGLE-3 checkpoints as their
//! authors ship them, and drafting trees with them ([`PublishedProposer`], in [`proposer`]).
//!
//! # What is read
//! A checkpoint is a folder with `config.json` (a Llama config: `num_attention_heads`, `num_key_value_heads`,
//! `rms_norm_eps`, `rope_theta`, optional `rope_scaling` of type `llama3`, `head_dim`; EAGLE-3 adds
//! `draft_vocab_size` and optionally `eagle_config.eagle_aux_hidden_state_layer_ids`) and its weights in
//! `model.safetensors` or `pytorch_model.bin` (a PyTorch zip archive, read with candle's pickle reader). Passing
//! the weights file itself works too; `config.json` must sit beside it. Tensor names are normalized before use:
//! a leading `model.` is dropped and `midlayer.` reads as `layers.0.`, so both EAGLE-3 layouts (`midlayer.*` from
//! the authors' trainer, `model.layers.0.*` from others) and EAGLE-1's `layers.0.*` land on one set of names.
//! Keys nobody reads (`embed_tokens.weight` — the target's own embedding is used — `t2d`, the unused input norm
//! of EAGLE-1's layer) are ignored.
//!
//! # The two designs (../shared/DESIGN.md §5)
//! ```text
//! EAGLE-1/2:  g = fc · [embed(token) ; feature] (+ fc.bias)           feature = target's final-normed state
//!             h = g + o_proj(attn(g)),  h += mlp(post_attention_layernorm(h))
//!             logits = target lm_head · h  (full vocabulary, no norm)
//! EAGLE-3:    g = fc · [low ; mid ; high]                                 inputs of target layers 2, L/2, L−3
//!             a = [input_layernorm(embed(token)) ; hidden_norm(g)]      (2d wide: q/k/v are d_out × 2d)
//!             h = g + o_proj(attn(a)),  h += mlp(post_attention_layernorm(h))
//!             logits = lm_head · norm(h)  over the draft vocabulary; draft id j is target token j + d2t[j]
//! ```
//! Tree nodes below the root feed their parent's `h` in place of the target's feature (EAGLE-3: in place of `g`,
//! skipping `fc`). Attention is the usual GQA with RoPE in the Hugging Face (NeoX, rotate-half) layout, over the
//! head's own KV cache of the committed tokens plus the node's ancestors in the tree.

mod proposer;
#[cfg(test)]
mod tests;

pub use proposer::PublishedProposer;

use super::eagle::{float_values, OwnedMatrix};
use super::proposer::FeatureSource;
use model::Model;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What can go wrong loading a published head.
#[derive(Debug, thiserror::Error)]
pub enum PublishedHeadError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Weights { path: PathBuf, message: String },
    #[error("no model.safetensors or pytorch_model.bin in {0}")]
    NoWeights(PathBuf),
    #[error("the head has no tensor `{0}` (after name normalization; see the module docs)")]
    Missing(String),
    #[error("head tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape { name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("head tensor `{name}` has type {dtype}, expected {want}")]
    DType { name: String, dtype: String, want: &'static str },
    #[error("the head is for hidden size {head}, this model has {model}")]
    Width { head: usize, model: usize },
    #[error("the EAGLE-1/2 head drafts through the target's head, but its config says vocabulary {head} and the model has {model}")]
    Vocab { head: usize, model: usize },
    #[error("draft vocabulary entry {index} maps to token {token}, outside the model's vocabulary ({vocab})")]
    BadMapping { index: usize, token: i64, vocab: usize },
    #[error("{0}")]
    Unsupported(String),
}

/// Which published design a checkpoint follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EagleVersion {
    /// EAGLE-1 and EAGLE-2 (same head; EAGLE-2 only changed the tree).
    Eagle1,
    /// EAGLE-3: three fused target layers, reduced draft vocabulary.
    Eagle3,
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug)]
pub(crate) enum TensorData {
    Float(Vec<f32>),
    Int(Vec<i64>),
    /// A type nobody reads here (`t2d` is bool).
    Other(String),
}

/// A checkpoint's tensors by normalized name, with shapes.
pub(crate) type Tensors = HashMap<String, (TensorData, Vec<usize>)>;

/// `model.layers.0.x` → `layers.0.x`, `midlayer.x` → `layers.0.x`, `model.fc.weight` → `fc.weight`.
pub(crate) fn normalize_name(name: &str) -> String {
    let mut n = name;
    while let Some(rest) = n.strip_prefix("model.") {
        n = rest;
    }
    match n.strip_prefix("midlayer.") {
        Some(rest) => format!("layers.0.{rest}"),
        None => n.to_string(),
    }
}

/// RoPE frequency scaling of Llama 3 checkpoints (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Llama3Scaling {
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    original_max_position_embeddings: f32,
}

impl Llama3Scaling {
    fn apply(&self, inv_freq: &mut [f32]) {
        let low_wavelen = self.original_max_position_embeddings / self.low_freq_factor;
        let high_wavelen = self.original_max_position_embeddings / self.high_freq_factor;
        for f in inv_freq.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            if wavelen > low_wavelen {
                *f /= self.factor;
            } else if wavelen >= high_wavelen {
                let smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                    / (self.high_freq_factor - self.low_freq_factor);
                *f = (1.0 - smooth) * *f / self.factor + smooth * *f;
            }
        }
    }
}

/// The parts of `config.json` the head needs.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HeadConfig {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: Option<usize>,
    pub rms_eps: f32,
    pub rope_theta: f32,
    rope_scaling: Option<Llama3Scaling>,
    pub vocab_size: Option<usize>,
    /// EAGLE-3: outputs of these target layers are fused (so the inputs of the next ones).
    pub aux_layer_outputs: Option<Vec<usize>>,
}

impl HeadConfig {
    pub(crate) fn parse(text: &str) -> Result<HeadConfig, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let int = |key: &str| v.get(key).and_then(|x| x.as_u64()).map(|x| x as usize);
        let float = |key: &str| v.get(key).and_then(|x| x.as_f64()).map(|x| x as f32);
        let n_head = int("num_attention_heads").ok_or("config.json has no num_attention_heads")?;
        if n_head == 0 {
            return Err("num_attention_heads is 0".into());
        }
        let n_head_kv = int("num_key_value_heads").unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(format!("num_key_value_heads {n_head_kv} does not divide num_attention_heads {n_head}"));
        }
        let rope_scaling = match v.get("rope_scaling").filter(|s| !s.is_null()) {
            None => None,
            Some(s) => {
                let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                if kind != "llama3" {
                    return Err(format!("rope_scaling type `{kind}` is not supported (only `llama3`)"));
                }
                let f = |key: &str, default: f64| s.get(key).and_then(|x| x.as_f64()).unwrap_or(default) as f32;
                Some(Llama3Scaling {
                    factor: f("factor", 8.0),
                    low_freq_factor: f("low_freq_factor", 1.0),
                    high_freq_factor: f("high_freq_factor", 4.0),
                    original_max_position_embeddings: f("original_max_position_embeddings", 8192.0),
                })
            }
        };
        let aux_layer_outputs = v
            .get("eagle_config")
            .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids"))
            .and_then(|ids| ids.as_array())
            .map(|ids| ids.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect::<Vec<_>>());
        Ok(HeadConfig {
            n_head,
            n_head_kv,
            head_dim: int("head_dim"),
            rms_eps: float("rms_norm_eps").unwrap_or(1e-6),
            rope_theta: float("rope_theta").unwrap_or(10_000.0),
            rope_scaling,
            vocab_size: int("vocab_size"),
            aux_layer_outputs,
        })
    }
}

/// Reads every tensor of a safetensors file.
fn read_safetensors(bytes: &[u8]) -> Result<Tensors, String> {
    use safetensors::Dtype;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut out = Tensors::new();
    for (name, t) in st.tensors() {
        let d = t.data();
        let data = match (float_values(t.dtype(), d), t.dtype()) {
            (Some(v), _) => TensorData::Float(v),
            (None, Dtype::I64) => {
                TensorData::Int(d.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect())
            }
            (None, Dtype::I32) => {
                TensorData::Int(d.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect())
            }
            (None, other) => TensorData::Other(format!("{other:?}")),
        };
        out.insert(normalize_name(&name), (data, t.shape().to_vec()));
    }
    Ok(out)
}

/// Reads every tensor of a PyTorch `torch.save` zip archive.
fn read_pytorch(path: &Path) -> Result<Tensors, String> {
    use candle_core::DType;
    let all = candle_core::pickle::read_all(path).map_err(|e| e.to_string())?;
    let mut out = Tensors::new();
    for (name, t) in all {
        let shape = t.dims().to_vec();
        let flat = t.flatten_all().map_err(|e| e.to_string())?;
        let data = match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 => TensorData::Float(
                flat.to_dtype(DType::F32).and_then(|x| x.to_vec1::<f32>()).map_err(|e| format!("{name}: {e}"))?,
            ),
            DType::I64 => TensorData::Int(flat.to_vec1::<i64>().map_err(|e| format!("{name}: {e}"))?),
            other => TensorData::Other(format!("{other:?}")),
        };
        out.insert(normalize_name(&name), (data, shape));
    }
    Ok(out)
}

/// The checkpoint's folder, its weights file and its `config.json` for `path` (a folder or a weights file).
fn locate(path: &Path) -> Result<(PathBuf, PathBuf), PublishedHeadError> {
    let (dir, weights) = if path.is_dir() {
        let weights = ["model.safetensors", "pytorch_model.bin"]
            .iter()
            .map(|f| path.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| PublishedHeadError::NoWeights(path.to_path_buf()))?;
        (path.to_path_buf(), weights)
    } else {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        (dir, path.to_path_buf())
    };
    let config = dir.join("config.json");
    if !config.is_file() {
        return Err(PublishedHeadError::Config {
            path: config,
            message: "missing: a published EAGLE head needs its config.json beside the weights".into(),
        });
    }
    Ok((config, weights))
}

/// Whether `path` looks like a published checkpoint rather than specee's own head format: a folder, a `.bin`
/// file, or a safetensors file without specee's `format` metadata.
pub fn is_published(path: &Path) -> bool {
    if path.is_dir() || path.extension().is_some_and(|e| e == "bin") {
        return true;
    }
    // Only the header is read (a safetensors file starts with its length and a JSON header).
    let header = || -> Option<serde_json::Value> {
        use std::io::Read;
        let mut file = std::fs::File::open(path).ok()?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).ok()?;
        let len = usize::try_from(u64::from_le_bytes(len)).ok().filter(|&n| n <= 100 << 20)?;
        let mut json = vec![0u8; len];
        file.read_exact(&mut json).ok()?;
        serde_json::from_slice(&json).ok()
    };
    header().is_some_and(|h| h.get("__metadata__").and_then(|m| m.get("format")).is_none())
}

/// A loaded published head (see the module header).
#[derive(Clone, Debug)]
pub struct PublishedHead {
    pub version: EagleVersion,
    /// Hidden size `d`.
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Feed-forward width.
    pub n_ff: usize,
    /// EAGLE-3: target token of each draft id; EAGLE-1/2: empty (drafts over the full vocabulary).
    pub d2t: Vec<u32>,
    /// EAGLE-1/2: the vocabulary size the config declares (checked against the target's).
    pub vocab_size: Option<usize>,
    pub(crate) rms_eps: f32,
    pub(crate) inv_freq: Vec<f32>,
    aux_layer_outputs: Option<Vec<usize>>,
    pub(crate) fc: OwnedMatrix,
    pub(crate) fc_bias: Option<Vec<f32>>,
    pub(crate) q: OwnedMatrix,
    pub(crate) k: OwnedMatrix,
    pub(crate) v: OwnedMatrix,
    pub(crate) o: OwnedMatrix,
    /// Q, K, V biases (Qwen-style heads); absent on Llama heads.
    pub(crate) qkv_bias: Option<[Vec<f32>; 3]>,
    /// EAGLE-3 only: norms of the embedding and of the fused feature.
    pub(crate) input_norm: Vec<f32>,
    pub(crate) hidden_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) gate: OwnedMatrix,
    pub(crate) up: OwnedMatrix,
    pub(crate) down: OwnedMatrix,
    /// EAGLE-3 only: final norm and draft-vocabulary head.
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Option<OwnedMatrix>,
}

/// Takes a float tensor.
fn float(t: &mut Tensors, name: &str) -> Result<(Vec<f32>, Vec<usize>), PublishedHeadError> {
    match t.remove(name) {
        None => Err(PublishedHeadError::Missing(name.to_string())),
        Some((TensorData::Float(v), shape)) => Ok((v, shape)),
        Some((TensorData::Int(_), _)) => {
            Err(PublishedHeadError::DType { name: name.into(), dtype: "integer".into(), want: "floating point" })
        }
        Some((TensorData::Other(d), _)) => {
            Err(PublishedHeadError::DType { name: name.into(), dtype: d, want: "floating point" })
        }
    }
}

/// Takes a float tensor of shape `want`.
fn shaped(t: &mut Tensors, name: &str, want: &[usize]) -> Result<Vec<f32>, PublishedHeadError> {
    let (v, shape) = float(t, name)?;
    if shape != want {
        return Err(PublishedHeadError::Shape { name: name.into(), got: shape, want: want.to_vec() });
    }
    Ok(v)
}

/// Takes an optional float tensor of shape `want`.
fn optional(t: &mut Tensors, name: &str, want: &[usize]) -> Result<Option<Vec<f32>>, PublishedHeadError> {
    if t.contains_key(name) {
        shaped(t, name, want).map(Some)
    } else {
        Ok(None)
    }
}

impl PublishedHead {
    /// Loads a checkpoint folder (or its weights file; see the module header).
    pub fn load(path: impl AsRef<Path>) -> Result<PublishedHead, PublishedHeadError> {
        let (config_path, weights) = locate(path.as_ref())?;
        let text = std::fs::read_to_string(&config_path)
            .map_err(|source| PublishedHeadError::Io { path: config_path.clone(), source })?;
        let config =
            HeadConfig::parse(&text).map_err(|message| PublishedHeadError::Config { path: config_path, message })?;
        let werr = |message: String| PublishedHeadError::Weights { path: weights.clone(), message };
        let tensors = if weights.extension().is_some_and(|e| e == "bin") {
            read_pytorch(&weights).map_err(werr)?
        } else {
            let bytes =
                std::fs::read(&weights).map_err(|source| PublishedHeadError::Io { path: weights.clone(), source })?;
            read_safetensors(&bytes).map_err(werr)?
        };
        PublishedHead::from_tensors(tensors, &config, true)
    }

    /// A head from the text of its `config.json` and the bytes of its safetensors weights, as [`Self::load`]
    /// reads them (the names in errors are the usual file names).
    pub fn from_parts(config: &str, weights: &[u8]) -> Result<PublishedHead, PublishedHeadError> {
        let config = HeadConfig::parse(config)
            .map_err(|message| PublishedHeadError::Config { path: "config.json".into(), message })?;
        let tensors = read_safetensors(weights)
            .map_err(|message| PublishedHeadError::Weights { path: "model.safetensors".into(), message })?;
        PublishedHead::from_tensors(tensors, &config, false)
    }

    /// Builds a head from normalized tensors; `quantize` stores wide matrices as Q8_0 (as our own heads are),
    /// otherwise everything stays F32.
    pub(crate) fn from_tensors(
        mut t: Tensors,
        config: &HeadConfig,
        quantize: bool,
    ) -> Result<PublishedHead, PublishedHeadError> {
        let matrix = |v: &[f32], rows: usize, cols: usize| {
            if quantize {
                OwnedMatrix::from_f32(v, rows, cols)
            } else {
                OwnedMatrix::exact(v, rows, cols)
            }
        };
        let (fc, fc_shape) = float(&mut t, "fc.weight")?;
        let [d, fc_in] = fc_shape[..] else {
            return Err(PublishedHeadError::Shape { name: "fc.weight".into(), got: fc_shape, want: vec![0, 0] });
        };
        let version = if t.contains_key("layers.0.hidden_norm.weight") || fc_in == 3 * d {
            EagleVersion::Eagle3
        } else {
            EagleVersion::Eagle1
        };
        let want_in = if version == EagleVersion::Eagle3 { 3 * d } else { 2 * d };
        if fc_in != want_in {
            return Err(PublishedHeadError::Shape {
                name: "fc.weight".into(),
                got: vec![d, fc_in],
                want: vec![d, want_in],
            });
        }
        let head_dim = config.head_dim.unwrap_or(d / config.n_head);
        let (q_out, kv_out) = (config.n_head * head_dim, config.n_head_kv * head_dim);
        let att_in = if version == EagleVersion::Eagle3 { 2 * d } else { d };
        let p = "layers.0.";
        let q = shaped(&mut t, &format!("{p}self_attn.q_proj.weight"), &[q_out, att_in])?;
        let k = shaped(&mut t, &format!("{p}self_attn.k_proj.weight"), &[kv_out, att_in])?;
        let v = shaped(&mut t, &format!("{p}self_attn.v_proj.weight"), &[kv_out, att_in])?;
        let o = shaped(&mut t, &format!("{p}self_attn.o_proj.weight"), &[d, q_out])?;
        let qkv_bias = match optional(&mut t, &format!("{p}self_attn.q_proj.bias"), &[q_out])? {
            None => None,
            Some(qb) => Some([
                qb,
                shaped(&mut t, &format!("{p}self_attn.k_proj.bias"), &[kv_out])?,
                shaped(&mut t, &format!("{p}self_attn.v_proj.bias"), &[kv_out])?,
            ]),
        };
        let (gate, gate_shape) = float(&mut t, &format!("{p}mlp.gate_proj.weight"))?;
        let f = gate_shape.first().copied().unwrap_or(0);
        if gate_shape != [f, d] {
            return Err(PublishedHeadError::Shape {
                name: format!("{p}mlp.gate_proj.weight"),
                got: gate_shape,
                want: vec![f, d],
            });
        }
        let up = shaped(&mut t, &format!("{p}mlp.up_proj.weight"), &[f, d])?;
        let down = shaped(&mut t, &format!("{p}mlp.down_proj.weight"), &[d, f])?;
        let post_norm = shaped(&mut t, &format!("{p}post_attention_layernorm.weight"), &[d])?;
        let fc_bias = optional(&mut t, "fc.bias", &[d])?;
        let (input_norm, hidden_norm, norm, lm_head, d2t) = match version {
            EagleVersion::Eagle1 => (Vec::new(), Vec::new(), Vec::new(), None, Vec::new()),
            EagleVersion::Eagle3 => {
                let input_norm = shaped(&mut t, &format!("{p}input_layernorm.weight"), &[d])?;
                let hidden_norm = shaped(&mut t, &format!("{p}hidden_norm.weight"), &[d])?;
                let norm = shaped(&mut t, "norm.weight", &[d])?;
                let (head, head_shape) = float(&mut t, "lm_head.weight")?;
                let n = head_shape.first().copied().unwrap_or(0);
                if head_shape != [n, d] {
                    return Err(PublishedHeadError::Shape {
                        name: "lm_head.weight".into(),
                        got: head_shape,
                        want: vec![n, d],
                    });
                }
                let d2t = match t.remove("d2t") {
                    // No mapping: the draft vocabulary is the target's, in order.
                    None => vec![0; n],
                    Some((TensorData::Int(v), shape)) if shape == [n] => v,
                    Some((TensorData::Int(_), shape)) => {
                        return Err(PublishedHeadError::Shape { name: "d2t".into(), got: shape, want: vec![n] })
                    }
                    Some(_) => {
                        return Err(PublishedHeadError::DType {
                            name: "d2t".into(),
                            dtype: "non-integer".into(),
                            want: "integer",
                        })
                    }
                };
                let d2t = d2t
                    .iter()
                    .enumerate()
                    .map(|(j, &off)| {
                        let token = j as i64 + off;
                        u32::try_from(token).map_err(|_| PublishedHeadError::BadMapping { index: j, token, vocab: 0 })
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                (input_norm, hidden_norm, norm, Some(matrix(&head, n, d)), d2t)
            }
        };
        if head_dim % 2 != 0 {
            return Err(PublishedHeadError::Unsupported(format!("odd head dimension {head_dim}")));
        }
        let mut inv_freq = model::blocks::rope_inv_freq(config.rope_theta, head_dim);
        if let Some(s) = config.rope_scaling {
            s.apply(&mut inv_freq);
        }
        Ok(PublishedHead {
            version,
            n_embd: d,
            n_head: config.n_head,
            n_head_kv: config.n_head_kv,
            head_dim,
            n_ff: f,
            d2t,
            vocab_size: config.vocab_size,
            rms_eps: config.rms_eps,
            inv_freq,
            aux_layer_outputs: config.aux_layer_outputs.clone(),
            fc: matrix(&fc, d, fc_in),
            fc_bias,
            q: matrix(&q, q_out, att_in),
            k: matrix(&k, kv_out, att_in),
            v: matrix(&v, kv_out, att_in),
            o: matrix(&o, d, q_out),
            qkv_bias,
            input_norm,
            hidden_norm,
            post_norm,
            gate: matrix(&gate, f, d),
            up: matrix(&up, f, d),
            down: matrix(&down, d, f),
            norm,
            lm_head,
        })
    }

    /// Draft vocabulary size (EAGLE-1/2: the target's).
    pub fn draft_vocab(&self, model: &Model) -> usize {
        match self.version {
            EagleVersion::Eagle1 => model.config.vocab_size,
            EagleVersion::Eagle3 => self.d2t.len(),
        }
    }

    /// The target features the head drafts from, for `model`: EAGLE-1/2 the final-normed state; EAGLE-3 the
    /// inputs of layers 2, L/2 and L−3 (ascending, as the authors collect them) or of the layers after those the
    /// config lists.
    pub fn feature_source(&self, model: &Model) -> FeatureSource {
        let l = model.config.n_layers;
        match self.version {
            EagleVersion::Eagle1 => FeatureSource::FinalNorm,
            EagleVersion::Eagle3 => {
                let mut layers: Vec<usize> = match &self.aux_layer_outputs {
                    Some(ids) => ids.iter().map(|&i| (i + 1).min(l)).collect(),
                    None => vec![2.min(l), l / 2, l.saturating_sub(3)],
                };
                if self.aux_layer_outputs.is_none() {
                    layers.sort_unstable();
                }
                FeatureSource::LayerInputs(layers)
            }
        }
    }

    /// Checks that the head fits `model`: width, the fused feature width, the vocabulary.
    pub fn check_fits(&self, model: &Model) -> Result<(), PublishedHeadError> {
        let c = &model.config;
        if self.n_embd != c.n_embd {
            return Err(PublishedHeadError::Width { head: self.n_embd, model: c.n_embd });
        }
        match self.version {
            EagleVersion::Eagle1 => {
                if let Some(v) = self.vocab_size.filter(|&v| v != c.vocab_size) {
                    return Err(PublishedHeadError::Vocab { head: v, model: c.vocab_size });
                }
            }
            EagleVersion::Eagle3 => {
                let width = self.feature_source(model).width(c.n_embd);
                if width != self.fc.cols {
                    return Err(PublishedHeadError::Unsupported(format!(
                        "the head fuses {} target features but lists {} layers",
                        self.fc.cols / c.n_embd,
                        width / c.n_embd
                    )));
                }
                if let Some((index, &t)) = self.d2t.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab_size) {
                    return Err(PublishedHeadError::BadMapping { index, token: t as i64, vocab: c.vocab_size });
                }
            }
        }
        Ok(())
    }
}

/// Where a loaded head came from (for messages).
pub fn describe(head: &PublishedHead) -> String {
    let v = match head.version {
        EagleVersion::Eagle1 => "EAGLE-1/2",
        EagleVersion::Eagle3 => "EAGLE-3",
    };
    format!("{v} head (hidden {}, {} heads / {} KV heads, FFN {})", head.n_embd, head.n_head, head.n_head_kv, head.n_ff)
}
