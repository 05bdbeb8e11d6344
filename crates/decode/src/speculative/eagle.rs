//! EAGLE-style draft heads: the [`DraftHead`] file format, its forward pass on our kernels, and the
//! [`EagleProposer`] that grows EAGLE-2 dynamic trees with it.
//!
//! # The head (specee's own format, `specee-eagle-mlp-1`)
//! EAGLE-1 drafts the token at `i + 2` from the target's feature at `i` and the token at `i + 1`. Our heads keep
//! that interface with a feed-forward block instead of EAGLE's attention layer (no draft KV cache to keep in
//! step with the tree) and a **reduced draft vocabulary** (the N most frequent tokens; EAGLE-3's `d2t`), so
//! drafting never pays a full-vocabulary product:
//!
//! ```text
//! e  = rms_norm(embed(token)) · emb_norm            (the target's own embedding, frozen)
//! x  = fc · [e ; feature] + fc_bias                 (2d → d)
//! h  = x + down(silu(gate(n)) ⊙ up(n)),  n = rms_norm(x) · mlp_norm
//! ĥ  = h          — the predicted feature (target's final-normed hidden state) at the token's position
//! logits = lm_head · ĥ   over the draft vocabulary; draft id j is target token j + d2t[j]
//! ```
//! Deeper tree nodes use the parent's predicted feature `ĥ` in place of the target's.
//!
//! A **fused** head (EAGLE-3's idea on the EAGLE-1 interface) also reads the residual stream entering a few
//! target layers (metadata `fuse_layers`, e.g. `2,15`: low and middle layers carry what the last layer's state,
//! specialised to the next token, has dropped). Its first step's feature is
//! `fuse · [feature ; rms_norm(h_l1) · fuse_norm_1 ; …]` (`(1 + k)d → d`); deeper nodes use `ĥ` as before.
//!
//! Tensors (safetensors; F32, F16 or BF16): `emb_norm.weight [d]`, `fc.weight [d, 2d]`, `fc.bias [d]`,
//! `mlp_norm.weight [d]`, `mlp.gate_proj.weight [f, d]`, `mlp.up_proj.weight [f, d]`, `mlp.down_proj.weight
//! [d, f]`, `lm_head.weight [N, d]`, `d2t [N]` (I64 or I32 offsets); fused heads add `fuse.weight [d, (1+k)d]`
//! and `fuse_norm.weight [k·d]`. Metadata: `format = specee-eagle-mlp-1`,
//! `rms_eps`, and informational keys (`base_model`, how it was trained). Matrices are quantized to Q8_0 at load
//! (where the width allows) and multiplied by the same kernels as the target.

use super::ngram::LookupChain;
use super::proposer::{DraftContext, FeatureSource, Proposer};
use super::tree::{build_dynamic_tree_traced, DraftTree, TreeConfig};
use super::SpeculativeError;
use kernels::{matmul, matmul_many, GgmlType, MatmulScratch, QMatrix, ThreadPool};
use model::blocks::{glu_in_place, rms_norm};
use model::Model;
use std::collections::HashMap;
use std::path::Path;

/// The format tag written into a head's metadata.
pub const FORMAT: &str = "specee-eagle-mlp-1";

/// What can go wrong loading a draft head.
#[derive(Debug, thiserror::Error)]
pub enum DraftHeadError {
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a safetensors file: {0}")]
    Format(String),
    #[error("draft head has no tensor `{0}`")]
    Missing(String),
    #[error("draft head tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape { name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("draft head tensor `{name}` has unsupported type {dtype}")]
    DType { name: String, dtype: String },
    #[error("draft head is for a model with hidden size {head}, this model has {model}")]
    Width { head: usize, model: usize },
    #[error("draft vocabulary entry {index} maps to token {token}, outside the model's vocabulary ({vocab})")]
    BadMapping { index: usize, token: i64, vocab: usize },
    #[error("draft head fuses {tensors} layer inputs but its metadata `fuse_layers` lists {listed:?}")]
    FuseLayers { tensors: usize, listed: String },
    #[error("draft head fuses the input of layer {layer}, past the model's {n_layers} layers")]
    FuseLayerRange { layer: usize, n_layers: usize },
    #[error("draft head format `{0}` is not `{FORMAT}`")]
    UnknownFormat(String),
    #[error("draft head metadata `tree` is `{value}`: {why}")]
    BadTree { value: String, why: String },
}

/// A weight matrix owned by the head, in a kernel type.
#[derive(Clone, Debug)]
pub(crate) struct OwnedMatrix {
    ty: GgmlType,
    data: Vec<u8>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl OwnedMatrix {
    /// Q8_0 when `cols` allows it (the target's own activation path), F32 otherwise.
    pub(crate) fn from_f32(values: &[f32], rows: usize, cols: usize) -> OwnedMatrix {
        if cols % 32 == 0 {
            OwnedMatrix { ty: GgmlType::Q8_0, data: kernels::quantize_q8_0_weights(values), rows, cols }
        } else {
            OwnedMatrix::exact(values, rows, cols)
        }
    }

    /// F32 whatever the width (exact; for tests against a plain reference).
    pub(crate) fn exact(values: &[f32], rows: usize, cols: usize) -> OwnedMatrix {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        OwnedMatrix { ty: GgmlType::F32, data, rows, cols }
    }

    pub(crate) fn view(&self) -> QMatrix<'_> {
        QMatrix { ty: self.ty, data: &self.data, rows: self.rows, cols: self.cols, layout: kernels::Layout::Rows }
    }
}

/// A loaded draft head (see the module header).
#[derive(Clone, Debug)]
pub struct DraftHead {
    /// Hidden size `d` (the target's).
    pub n_embd: usize,
    /// Feed-forward width `f`.
    pub n_ff: usize,
    /// Draft vocabulary size `N`.
    pub vocab: usize,
    /// Target token id of each draft id.
    pub d2t: Vec<u32>,
    /// Metadata of the file.
    pub metadata: HashMap<String, String>,
    /// The draft tree this head drafts best with on its model (metadata `tree`, `DEPTH,TOP_K,BUDGET,MIN_PROB`,
    /// measured when it was shipped): `--mode eagle` uses it unless `--tree` is given; `None`:
    /// [`EagleProposer::default_tree`]. How far a head can draft with profit depends on how often it is right and
    /// on what a verified row costs its model, so the choice travels with the head (`specee inspect --set tree=…`).
    pub tree: Option<TreeConfig>,
    rms_eps: f32,
    emb_norm: Vec<f32>,
    fc: OwnedMatrix,
    fc_bias: Vec<f32>,
    mlp_norm: Vec<f32>,
    gate: OwnedMatrix,
    up: OwnedMatrix,
    down: OwnedMatrix,
    lm_head: OwnedMatrix,
    fuse: Option<Fusion>,
}

/// The fusion of a fused head (see the module header).
#[derive(Clone, Debug)]
struct Fusion {
    layers: Vec<usize>,
    norm: Vec<f32>,
    w: OwnedMatrix,
}

/// Reads one tensor as f32 values with its shape.
fn tensor_f32(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<(Vec<f32>, Vec<usize>), DraftHeadError> {
    let t = st.tensor(name).map_err(|_| DraftHeadError::Missing(name.to_string()))?;
    let values = float_values(t.dtype(), t.data())
        .ok_or_else(|| DraftHeadError::DType { name: name.to_string(), dtype: format!("{:?}", t.dtype()) })?;
    Ok((values, t.shape().to_vec()))
}

/// The values of a floating-point safetensors tensor (F32, F16, BF16) as f32; `None` for other types.
pub(crate) fn float_values(dtype: safetensors::Dtype, data: &[u8]) -> Option<Vec<f32>> {
    use safetensors::Dtype;
    Some(match dtype {
        Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => return None,
    })
}

/// Reads one tensor and checks its shape.
fn tensor_shaped(st: &safetensors::SafeTensors<'_>, name: &str, want: &[usize]) -> Result<Vec<f32>, DraftHeadError> {
    let (values, shape) = tensor_f32(st, name)?;
    if shape != want {
        return Err(DraftHeadError::Shape { name: name.to_string(), got: shape, want: want.to_vec() });
    }
    Ok(values)
}

/// A head file's `tree` metadata, bounded by [`DraftHead::MAX_TREE`]: a file is not to hang the decoder with a
/// tree that would take ages to draft and never pay.
fn head_tree(value: &str) -> Result<TreeConfig, DraftHeadError> {
    let bad = |why: String| DraftHeadError::BadTree { value: value.to_string(), why };
    let tree = value.parse::<TreeConfig>().map_err(bad)?;
    DraftHead::check_tree(&tree).map_err(bad)?;
    Ok(tree)
}

impl DraftHead {
    /// The largest depth, top-k and budget a head file's `tree` may ask for (`--tree` itself is not bounded).
    pub const MAX_TREE: (usize, usize, usize) = (32, 32, 256);

    /// Whether `tree` may be written into a head file ([`DraftHead::MAX_TREE`]); the error says the bound.
    pub fn check_tree(tree: &TreeConfig) -> Result<(), String> {
        let (depth, top_k, budget) = DraftHead::MAX_TREE;
        if tree.depth > depth || tree.top_k > top_k || tree.budget > budget {
            return Err(format!("at most depth {depth}, top-k {top_k} and budget {budget} in a head file"));
        }
        Ok(())
    }

    /// Loads a head file.
    pub fn load(path: impl AsRef<Path>) -> Result<DraftHead, DraftHeadError> {
        let path = path.as_ref();
        let bytes =
            std::fs::read(path).map_err(|source| DraftHeadError::Io { path: path.display().to_string(), source })?;
        DraftHead::from_bytes(&bytes)
    }

    /// Parses a head from the bytes of a safetensors file.
    pub fn from_bytes(bytes: &[u8]) -> Result<DraftHead, DraftHeadError> {
        let (_, meta) =
            safetensors::SafeTensors::read_metadata(bytes).map_err(|e| DraftHeadError::Format(e.to_string()))?;
        let metadata: HashMap<String, String> = meta.metadata().clone().unwrap_or_default();
        if let Some(format) = metadata.get("format") {
            if format != FORMAT {
                return Err(DraftHeadError::UnknownFormat(format.clone()));
            }
        }
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| DraftHeadError::Format(e.to_string()))?;
        let (fc, fc_shape) = tensor_f32(&st, "fc.weight")?;
        let [d, d2] = fc_shape[..] else {
            return Err(DraftHeadError::Shape { name: "fc.weight".into(), got: fc_shape, want: vec![0, 0] });
        };
        if d2 != 2 * d {
            return Err(DraftHeadError::Shape { name: "fc.weight".into(), got: vec![d, d2], want: vec![d, 2 * d] });
        }
        let (gate, gate_shape) = tensor_f32(&st, "mlp.gate_proj.weight")?;
        let f = gate_shape.first().copied().unwrap_or(0);
        if gate_shape != [f, d] {
            return Err(DraftHeadError::Shape {
                name: "mlp.gate_proj.weight".into(),
                got: gate_shape,
                want: vec![f, d],
            });
        }
        let (lm_head, head_shape) = tensor_f32(&st, "lm_head.weight")?;
        let n = head_shape.first().copied().unwrap_or(0);
        if head_shape != [n, d] {
            return Err(DraftHeadError::Shape { name: "lm_head.weight".into(), got: head_shape, want: vec![n, d] });
        }
        let d2t_view = st.tensor("d2t").map_err(|_| DraftHeadError::Missing("d2t".into()))?;
        if d2t_view.shape() != [n] {
            return Err(DraftHeadError::Shape { name: "d2t".into(), got: d2t_view.shape().to_vec(), want: vec![n] });
        }
        let offsets: Vec<i64> = match d2t_view.dtype() {
            safetensors::Dtype::I64 => {
                d2t_view.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
            }
            safetensors::Dtype::I32 => {
                d2t_view.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect()
            }
            other => return Err(DraftHeadError::DType { name: "d2t".into(), dtype: format!("{other:?}") }),
        };
        let d2t = offsets
            .iter()
            .enumerate()
            .map(|(j, &o)| {
                let t = j as i64 + o;
                u32::try_from(t).map_err(|_| DraftHeadError::BadMapping { index: j, token: t, vocab: usize::MAX })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let rms_eps = metadata.get("rms_eps").and_then(|v| v.parse().ok()).unwrap_or(1e-5);
        let tree = metadata.get("tree").map(|value| head_tree(value)).transpose()?;
        let fuse = match st.tensor("fuse.weight") {
            Err(_) => None,
            Ok(view) => {
                let w_in = view.shape().get(1).copied().unwrap_or(0);
                if view.shape().len() != 2 || view.shape()[0] != d || w_in % d != 0 || w_in < 2 * d {
                    let want = vec![d, 2 * d];
                    return Err(DraftHeadError::Shape { name: "fuse.weight".into(), got: view.shape().to_vec(), want });
                }
                let k = w_in / d - 1;
                let listed = metadata.get("fuse_layers").cloned().unwrap_or_default();
                let layers: Vec<usize> = listed.split(',').filter_map(|l| l.trim().parse().ok()).collect();
                if layers.len() != k {
                    return Err(DraftHeadError::FuseLayers { tensors: k, listed });
                }
                let w = tensor_shaped(&st, "fuse.weight", &[d, w_in])?;
                let norm = tensor_shaped(&st, "fuse_norm.weight", &[k * d])?;
                Some(Fusion { layers, norm, w: OwnedMatrix::from_f32(&w, d, w_in) })
            }
        };
        Ok(DraftHead {
            n_embd: d,
            n_ff: f,
            vocab: n,
            d2t,
            rms_eps,
            emb_norm: tensor_shaped(&st, "emb_norm.weight", &[d])?,
            fc: OwnedMatrix::from_f32(&fc, d, 2 * d),
            fc_bias: tensor_shaped(&st, "fc.bias", &[d])?,
            mlp_norm: tensor_shaped(&st, "mlp_norm.weight", &[d])?,
            gate: OwnedMatrix::from_f32(&gate, f, d),
            up: OwnedMatrix::from_f32(&tensor_shaped(&st, "mlp.up_proj.weight", &[f, d])?, f, d),
            down: OwnedMatrix::from_f32(&tensor_shaped(&st, "mlp.down_proj.weight", &[d, f])?, d, f),
            lm_head: OwnedMatrix::from_f32(&lm_head, n, d),
            metadata,
            tree,
            fuse,
        })
    }

    /// The target features the head reads: the final-normed state, and for a fused head the inputs of its
    /// layers after it.
    pub fn feature_source(&self) -> FeatureSource {
        match &self.fuse {
            None => FeatureSource::FinalNorm,
            Some(f) => FeatureSource::FinalNormAnd(f.layers.clone()),
        }
    }

    /// The first step's input features (`m × d`) from `m` target feature rows ([`DraftHead::feature_source`]):
    /// the rows themselves for an unfused head, their fusion for a fused one.
    pub fn first_input(
        &self,
        rows: &[f32],
        m: usize,
        pool: &ThreadPool,
        scratch: &mut DraftScratch,
        out: &mut Vec<f32>,
    ) {
        let d = self.n_embd;
        out.resize(m * d, 0.0);
        let Some(f) = &self.fuse else {
            out.copy_from_slice(&rows[..m * d]);
            return;
        };
        let w = f.w.cols;
        scratch.fuse_in.resize(m * w, 0.0);
        for r in 0..m {
            let (src, dst) = (&rows[r * w..(r + 1) * w], &mut scratch.fuse_in[r * w..(r + 1) * w]);
            dst[..d].copy_from_slice(&src[..d]);
            for (j, norm) in f.norm.chunks_exact(d).enumerate() {
                let at = (1 + j) * d;
                rms_norm(&src[at..at + d], norm, self.rms_eps, &mut dst[at..at + d]);
            }
        }
        matmul(pool, &f.w.view(), &scratch.fuse_in, m, out, &mut scratch.mm);
    }

    /// Checks that the head fits `model` (hidden size, draft vocabulary inside the model's).
    pub fn check_fits(&self, model: &Model) -> Result<(), DraftHeadError> {
        let c = &model.config;
        if self.n_embd != c.n_embd {
            return Err(DraftHeadError::Width { head: self.n_embd, model: c.n_embd });
        }
        if let Some((index, &t)) = self.d2t.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab_size) {
            return Err(DraftHeadError::BadMapping { index, token: t as i64, vocab: c.vocab_size });
        }
        if let Some(&layer) = self.fuse.iter().flat_map(|f| &f.layers).find(|&&l| l > c.n_layers) {
            return Err(DraftHeadError::FuseLayerRange { layer, n_layers: c.n_layers });
        }
        Ok(())
    }

    /// Runs the head on `m` rows: `tokens[r]` with input feature `features[r]` (`m × d`). Writes the predicted
    /// features to `out_features` (`m × d`) and draft-vocabulary logits to `logits` (`m × N`).
    pub fn forward(
        &self,
        model: &Model,
        tokens: &[u32],
        features: &[f32],
        pool: &ThreadPool,
        scratch: &mut DraftScratch,
        out_features: &mut Vec<f32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), SpeculativeError> {
        let (m, d, f) = (tokens.len(), self.n_embd, self.n_ff);
        let s = scratch;
        s.emb.resize(m * d, 0.0);
        model.embed(tokens, &mut s.emb)?;
        s.input.resize(m * 2 * d, 0.0);
        for r in 0..m {
            let row = &mut s.input[r * 2 * d..(r + 1) * 2 * d];
            rms_norm(&s.emb[r * d..(r + 1) * d], &self.emb_norm, self.rms_eps, &mut row[..d]);
            row[d..].copy_from_slice(&features[r * d..(r + 1) * d]);
        }
        out_features.resize(m * d, 0.0);
        matmul(pool, &self.fc.view(), &s.input, m, out_features, &mut s.mm);
        for r in 0..m {
            out_features[r * d..(r + 1) * d].iter_mut().zip(&self.fc_bias).for_each(|(x, b)| *x += b);
        }
        s.normed.resize(m * d, 0.0);
        for r in 0..m {
            rms_norm(
                &out_features[r * d..(r + 1) * d],
                &self.mlp_norm,
                self.rms_eps,
                &mut s.normed[r * d..(r + 1) * d],
            );
        }
        s.gate.resize(m * f, 0.0);
        s.up.resize(m * f, 0.0);
        let (gate, up) = (self.gate.view(), self.up.view());
        matmul_many(pool, &mut [(&gate, &mut s.gate[..]), (&up, &mut s.up[..])], &s.normed, m, &mut s.mm);
        glu_in_place(model::Activation::Silu, &mut s.gate, &s.up);
        s.down.resize(m * d, 0.0);
        matmul(pool, &self.down.view(), &s.gate, m, &mut s.down, &mut s.mm);
        out_features.iter_mut().zip(&s.down).for_each(|(x, o)| *x += o);
        logits.resize(m * self.vocab, 0.0);
        matmul(pool, &self.lm_head.view(), out_features, m, logits, &mut s.mm);
        Ok(())
    }
}

/// Reusable buffers of [`DraftHead::forward`].
#[derive(Default)]
pub struct DraftScratch {
    emb: Vec<f32>,
    fuse_in: Vec<f32>,
    input: Vec<f32>,
    normed: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    mm: MatmulScratch,
}

/// Drafts EAGLE-2 dynamic trees with a [`DraftHead`].
pub struct EagleProposer {
    head: std::sync::Arc<DraftHead>,
    /// Tree sizes.
    pub tree: TreeConfig,
    scratch: DraftScratch,
    /// Predicted feature of each node of the candidate pool, by pool index (`d` floats each).
    node_features: Vec<f32>,
    tokens: Vec<u32>,
    inputs: Vec<f32>,
    out_features: Vec<f32>,
    logits: Vec<f32>,
    order: Vec<u32>,
    /// The root's first-step input (its target feature row, fused for a fused head).
    root_input: Vec<f32>,
    /// Pool index of each node of the last tree.
    origin: Vec<usize>,
    /// Per pool node: whether the search expanded it.
    expanded: Vec<bool>,
    /// Per pool node: its best next tokens (`propose_with_candidates`' `k` per node).
    pool_candidates: Vec<(u32, f32)>,
    /// The prompt-lookup chain added to each tree (base length 0: none); see [`EagleProposer::with_lookup`].
    pub lookup: LookupChain,
    /// Predicted feature of each node of the last tree, in tree order (`propose_with_candidates` with a lookup).
    tree_features: Vec<f32>,
}

impl EagleProposer {
    /// A proposer drafting with `head` (on the decoder's threads). Pass an `Arc` to share one head among
    /// several proposers (a server's requests) without copying its weights.
    pub fn new(head: impl Into<std::sync::Arc<DraftHead>>, tree: TreeConfig) -> EagleProposer {
        EagleProposer {
            head: head.into(),
            tree,
            scratch: DraftScratch::default(),
            node_features: Vec::new(),
            tokens: Vec::new(),
            inputs: Vec::new(),
            out_features: Vec::new(),
            logits: Vec::new(),
            order: Vec::new(),
            root_input: Vec::new(),
            origin: Vec::new(),
            expanded: Vec::new(),
            pool_candidates: Vec::new(),
            lookup: LookupChain::default(),
            tree_features: Vec::new(),
        }
    }

    /// The prompt-lookup chain `--mode eagle` adds by default ([`EagleProposer::with_lookup`]).
    pub const DEFAULT_LOOKUP: usize = 3;

    /// Also drafts, beside the head's tree, the greedy prompt-lookup chain (the n-gram proposer's: what followed
    /// the latest 2–4 tokens earlier in the context) of `depth` tokens, growing while it is accepted whole
    /// ([`LookupChain`]), merged into the tree where it agrees with the head. The head cannot copy what it
    /// cannot see, and a lookup hit often runs several tokens deep; steps without a hit verify no extra rows.
    pub fn with_lookup(mut self, depth: usize) -> EagleProposer {
        self.lookup = LookupChain::new(depth);
        self
    }

    /// The head.
    pub fn head(&self) -> &DraftHead {
        &self.head
    }

    /// Default tree sizes: a chain of at most two draft tokens, each kept only while the path's draft probability
    /// is at least 0.4 (plus the lookup chain, [`EagleProposer::with_lookup`]). With the shipped SmolLM2 head
    /// (first-step top-1 ≈ 0.5 on held-out chat) and the 2-core machines' multi-row cost (2 rows ≈ 1.12× one,
    /// 4 rows ≈ 1.4×), wider trees lose: on `bench/chat-heldout.jsonl`, 64 tokens, 2 threads, lookup 3, this tree
    /// ran 1.31–1.38× dense (τ 1.93–2.02) against 1.26–1.36× for `1,1,1` (τ 1.79–1.87) in four paired runs;
    /// without the floor `2,1,2` lost to `1,1,1`, and `3,2,4` or `5,3,10` ran at 0.35–0.6× dense in session 6.
    /// Retune with `--tree` when heads or the multi-row path improve.
    pub fn default_tree() -> TreeConfig {
        TreeConfig { depth: 2, top_k: 1, budget: 2, min_prob: 0.4 }
    }

    /// The tree `head` drafts with: `asked` (`--tree`) if given, else the head's own ([`DraftHead::tree`]), else
    /// [`EagleProposer::default_tree`].
    pub fn tree_for(head: &DraftHead, asked: Option<TreeConfig>) -> TreeConfig {
        asked.or(head.tree).unwrap_or_else(EagleProposer::default_tree)
    }
}

/// Entry `j` of a best-first candidate list, or its best entry when the list is shorter (a head with fewer draft
/// tokens than candidates asked for repeats its best one).
fn padded(best: &[(u32, f32)], j: usize) -> (u32, f32) {
    best.get(j).or(best.first()).copied().unwrap_or((0, 0.0))
}

/// Log-softmax of `logits` and its `k` best entries as `(index, log_prob)`, best first.
pub(crate) fn top_k_log_probs(logits: &[f32], k: usize, order: &mut Vec<u32>, out: &mut Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let log_sum = max + logits.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
    top_k_indices(logits, k, order);
    out.extend(order.iter().map(|&j| (j, logits[j as usize] - log_sum)));
}

/// Leaves in `order` the indices of the `k` largest `logits`, best first (ties: lower index first).
pub(crate) fn top_k_indices(logits: &[f32], k: usize, order: &mut Vec<u32>) {
    order.clear();
    order.extend(0..logits.len() as u32);
    let k = k.min(order.len());
    if k == 0 {
        return;
    }
    order.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
}

impl EagleProposer {
    /// [`Proposer::propose`], also leaving in `candidates` the head's `k` best next tokens of **every** node of
    /// the final tree (target ids with their draft log-probabilities, best first, `k` pairs per node in node
    /// order) — the candidates whose logits SpecEE's exit predictors read inside the tree (merged mapping).
    /// Expanded nodes reuse what the tree search computed; the rest (the leaves) take one more batched head
    /// call. The lookup chain, if any, takes at most `lookup_cap` nodes. `candidates` is left empty when the
    /// context is too short to draft.
    pub fn propose_with_candidates(
        &mut self,
        context: &DraftContext<'_>,
        tree: &mut DraftTree,
        k: usize,
        lookup_cap: usize,
        candidates: &mut Vec<(u32, f32)>,
    ) -> Result<(), SpeculativeError> {
        candidates.clear();
        self.draft(context, tree, k)?;
        if Self::root_feature(context).is_none() {
            return Ok(());
        }
        if k == 0 {
            return Ok(());
        }
        let d = self.head.n_embd;
        // Nodes the search never expanded: their candidates need one more head call.
        let missing: Vec<usize> = (0..tree.len()).filter(|&i| !self.expanded[self.origin[i]]).collect();
        if !missing.is_empty() {
            self.tokens.clear();
            self.inputs.clear();
            for &i in &missing {
                self.tokens.push(tree.node(i).token);
                if i == 0 {
                    self.inputs.extend_from_slice(&self.root_input);
                } else {
                    let p = self.origin[tree.node(i).parent];
                    self.inputs.extend_from_slice(&self.node_features[p * d..(p + 1) * d]);
                }
            }
            self.forward_inputs(context)?;
        }
        let mut fresh = Vec::with_capacity(k);
        let mut next_missing = 0;
        let n_head = tree.len();
        let lookup = self.lookup.base > 0;
        // With a lookup chain to hang below them, keep every node's predicted feature in tree order.
        self.tree_features.clear();
        for i in 0..n_head {
            let o = self.origin[i];
            let feature = if self.expanded[o] {
                candidates.extend_from_slice(&self.pool_candidates[o * k..(o + 1) * k]);
                &self.node_features[o * d..(o + 1) * d]
            } else {
                let r = next_missing;
                next_missing += 1;
                self.row_candidates(r, k, &mut fresh, candidates);
                &self.out_features[r * d..(r + 1) * d]
            };
            if lookup {
                self.tree_features.extend_from_slice(feature);
            }
        }
        if lookup && self.lookup.extend(context.tokens, tree, lookup_cap) > 0 {
            self.lookup_candidates(context, tree, n_head, k, candidates)?;
        }
        Ok(())
    }

    /// Candidates of the lookup chain's nodes `n_head..` (added after the head's tree): one head call per node,
    /// down the chain, each reading its parent's predicted feature from `tree_features` and leaving its own there.
    fn lookup_candidates(
        &mut self,
        context: &DraftContext<'_>,
        tree: &DraftTree,
        n_head: usize,
        k: usize,
        candidates: &mut Vec<(u32, f32)>,
    ) -> Result<(), SpeculativeError> {
        let d = self.head.n_embd;
        let mut fresh = Vec::with_capacity(k);
        for i in n_head..tree.len() {
            let node = tree.node(i);
            self.tokens.clear();
            self.tokens.push(node.token);
            self.inputs.clear();
            self.inputs.extend_from_slice(&self.tree_features[node.parent * d..(node.parent + 1) * d]);
            self.forward_inputs(context)?;
            self.tree_features.extend_from_slice(&self.out_features[..d]);
            self.row_candidates(0, k, &mut fresh, candidates);
        }
        Ok(())
    }

    /// The head over `tokens` and `inputs`, into `out_features` and `logits`.
    fn forward_inputs(&mut self, context: &DraftContext<'_>) -> Result<(), SpeculativeError> {
        let (model, pool) = (context.model, context.pool);
        let (tokens, inputs) = (&self.tokens, &self.inputs);
        self.head.forward(model, tokens, inputs, pool, &mut self.scratch, &mut self.out_features, &mut self.logits)
    }

    /// Appends the `k` best target tokens of `logits` row `r` to `candidates` (padded; `fresh` is scratch).
    fn row_candidates(&mut self, r: usize, k: usize, fresh: &mut Vec<(u32, f32)>, candidates: &mut Vec<(u32, f32)>) {
        let v = self.head.vocab;
        fresh.clear();
        top_k_log_probs(&self.logits[r * v..(r + 1) * v], k, &mut self.order, fresh);
        fresh.iter_mut().for_each(|c| c.0 = self.head.d2t[c.0 as usize]);
        candidates.extend((0..k).map(|j| padded(fresh, j)));
    }

    /// The target's feature the root's draft reads (of the token before the root), if the context has one.
    fn root_feature<'c>(context: &DraftContext<'c>) -> Option<&'c [f32]> {
        context.tokens.len().checked_sub(2).and_then(|i| context.feature(i))
    }

    /// Builds the tree; remembers, per candidate-pool node, whether it was expanded and (when `k > 0`) its `k`
    /// best next tokens.
    fn draft(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree, k: usize) -> Result<(), SpeculativeError> {
        // The root's draft needs the target's feature of the token before it.
        let Some(root_feature) = Self::root_feature(context) else { return Ok(()) };
        let d = self.head.n_embd;
        let (model, pool) = (context.model, context.pool);
        self.head.first_input(root_feature, 1, pool, &mut self.scratch, &mut self.root_input);
        self.node_features.clear();
        self.expanded.clear();
        self.pool_candidates.clear();
        let EagleProposer {
            head,
            tree: config,
            scratch,
            node_features,
            tokens,
            inputs,
            out_features,
            logits,
            order,
            root_input,
            origin,
            expanded,
            pool_candidates,
            ..
        } = self;
        let keep = config.top_k.max(k);
        let mut best = Vec::with_capacity(keep);
        build_dynamic_tree_traced(config, tree, origin, |pool_tree, frontier, children| {
            tokens.clear();
            inputs.clear();
            for &v in frontier {
                let node = pool_tree.node(v);
                tokens.push(node.token);
                if v == 0 {
                    inputs.extend_from_slice(root_input);
                } else {
                    let p = node.parent;
                    inputs.extend_from_slice(&node_features[p * d..(p + 1) * d]);
                }
            }
            head.forward(model, tokens, inputs, pool, scratch, out_features, logits)?;
            // Remember each expanded node's predicted feature (its children's input), by pool index.
            let needed = pool_tree.len();
            if node_features.len() < needed * d {
                node_features.resize(needed * d, 0.0);
                expanded.resize(needed, false);
                pool_candidates.resize(needed * k, (0, 0.0));
            }
            for (r, &v) in frontier.iter().enumerate() {
                node_features[v * d..(v + 1) * d].copy_from_slice(&out_features[r * d..(r + 1) * d]);
                expanded[v] = true;
                best.clear();
                top_k_log_probs(&logits[r * head.vocab..(r + 1) * head.vocab], keep, order, &mut best);
                for b in best.iter_mut() {
                    b.0 = head.d2t[b.0 as usize];
                }
                for j in 0..k {
                    pool_candidates[v * k + j] = padded(&best, j);
                }
                children.push(best.iter().take(config.top_k).copied().collect());
            }
            Ok::<(), SpeculativeError>(())
        })?;
        // Pool nodes created by the last expansion were never expanded themselves.
        let pool_len = origin.iter().copied().max().unwrap_or(0) + 1;
        if expanded.len() < pool_len {
            expanded.resize(pool_len, false);
        }
        Ok(())
    }
}

impl Proposer for EagleProposer {
    fn feature_source(&self) -> FeatureSource {
        self.head.feature_source()
    }

    /// The head drafts from the root's parent's feature alone (deeper nodes from its own predictions); the
    /// prompt-lookup chain reads tokens only.
    fn needs_feature_history(&self) -> bool {
        false
    }

    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        self.draft(context, tree, 0)?;
        // The decoder cuts the tree to its room and token limit.
        self.lookup.extend(context.tokens, tree, usize::MAX);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{SamplingParams, SpeculativeDecoder};
    use model::{Mask, Workspace};
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;

    /// A random head file for a width-`d` model: `n` draft tokens mapped to every second target token.
    pub(crate) fn random_head_bytes(d: usize, ff: usize, n: usize, seed: u64) -> Vec<u8> {
        random_fused_head_bytes(d, ff, n, seed, &[])
    }

    /// [`random_head_bytes`] fusing the inputs of `fuse` (none: an unfused head).
    pub(crate) fn random_fused_head_bytes(d: usize, ff: usize, n: usize, seed: u64, fuse: &[usize]) -> Vec<u8> {
        let mut s = seed;
        let mut rnd = |len: usize, scale: f32| -> Vec<u8> {
            (0..len)
                .flat_map(|_| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale).to_le_bytes()
                })
                .collect()
        };
        let k = fuse.len();
        let mut tensors: Vec<(&str, Vec<usize>, Vec<u8>)> = vec![
            ("emb_norm.weight", vec![d], rnd(d, 0.2)),
            ("fc.weight", vec![d, 2 * d], rnd(2 * d * d, 0.5)),
            ("fc.bias", vec![d], rnd(d, 0.1)),
            ("mlp_norm.weight", vec![d], rnd(d, 2.0)),
            ("mlp.gate_proj.weight", vec![ff, d], rnd(ff * d, 0.5)),
            ("mlp.up_proj.weight", vec![ff, d], rnd(ff * d, 0.5)),
            ("mlp.down_proj.weight", vec![d, ff], rnd(d * ff, 0.5)),
            ("lm_head.weight", vec![n, d], rnd(n * d, 2.0)),
        ];
        let mut meta = HashMap::from([("format".to_string(), FORMAT.to_string())]);
        if k > 0 {
            tensors.push(("fuse.weight", vec![d, (1 + k) * d], rnd((1 + k) * d * d, 0.5)));
            tensors.push(("fuse_norm.weight", vec![k * d], rnd(k * d, 2.0)));
            let layers: Vec<String> = fuse.iter().map(|l| l.to_string()).collect();
            meta.insert("fuse_layers".into(), layers.join(","));
        }
        let d2t: Vec<u8> = (0..n as i64).flat_map(|j| j.to_le_bytes()).collect();
        let mut views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, shape, b)| (*name, TensorView::new(Dtype::F32, shape.clone(), b).unwrap()))
            .collect();
        views.push(("d2t", TensorView::new(Dtype::I64, vec![n], &d2t).unwrap()));
        safetensors::serialize(views, Some(meta)).unwrap()
    }

    #[test]
    fn fused_heads_fuse_the_listed_layer_inputs() {
        let (d, layers) = (32, [1usize, 3]);
        let bytes = random_fused_head_bytes(d, 64, 16, 3, &layers);
        let head = DraftHead::from_bytes(&bytes).unwrap();
        assert_eq!(head.feature_source(), FeatureSource::FinalNormAnd(layers.to_vec()));
        let model = model::testing::tiny_model("llama", None, 3, 64);
        head.check_fits(&model).unwrap();
        // The fusion against a plain f32 reference: rows [feature ; rms-normed layer inputs] through `fuse`.
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let get = |name: &str| tensor_f32(&st, name).unwrap().0;
        let (w, norm) = (get("fuse.weight"), get("fuse_norm.weight"));
        let rows: Vec<f32> = (0..2 * 3 * d).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let (pool, mut scratch, mut out) = (ThreadPool::new(1), DraftScratch::default(), Vec::new());
        head.first_input(&rows, 2, &pool, &mut scratch, &mut out);
        for r in 0..2 {
            let src = &rows[r * 3 * d..(r + 1) * 3 * d];
            let mut x = src[..d].to_vec();
            for j in 0..2 {
                let part = &src[(1 + j) * d..(2 + j) * d];
                let rms = (part.iter().map(|v| v * v).sum::<f32>() / d as f32 + head.rms_eps).sqrt();
                x.extend(part.iter().zip(&norm[j * d..(j + 1) * d]).map(|(v, g)| v / rms * g));
            }
            for o in 0..d {
                let want: f32 = (0..3 * d).map(|c| w[o * 3 * d + c] * x[c]).sum();
                let got = out[r * d + o];
                assert!((got - want).abs() <= 0.03 * (1.0 + want.abs()), "row {r} out {o}: {got} vs {want}");
            }
        }
        // Layers past the model's are refused; the metadata must list one layer per fused input.
        let deep = DraftHead::from_bytes(&random_fused_head_bytes(d, 64, 16, 3, &[1, 4])).unwrap();
        assert!(matches!(deep.check_fits(&model), Err(DraftHeadError::FuseLayerRange { layer: 4, n_layers: 3 })));
        let mut st_meta = safetensors::SafeTensors::read_metadata(&bytes).unwrap().1.metadata().clone().unwrap();
        st_meta.insert("fuse_layers".into(), "1".into());
        let views: Vec<(String, TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, TensorView::new(v.dtype(), v.shape().to_vec(), v.data()).unwrap()))
            .collect();
        let relabelled = safetensors::serialize(views, Some(st_meta)).unwrap();
        assert!(matches!(DraftHead::from_bytes(&relabelled), Err(DraftHeadError::FuseLayers { tensors: 2, .. })));
    }

    #[test]
    fn a_head_carries_its_tree_and_an_asked_tree_overrides_it() {
        let bytes = random_head_bytes(64, 32, 16, 7);
        let plain = DraftHead::from_bytes(&bytes).unwrap();
        assert_eq!(plain.tree, None);
        let asked = TreeConfig { depth: 3, top_k: 2, budget: 4, min_prob: 0.1 };
        assert_eq!(EagleProposer::tree_for(&plain, None), EagleProposer::default_tree());
        assert_eq!(EagleProposer::tree_for(&plain, Some(asked)), asked);
        let with_tree = |value: &str| {
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let mut meta =
                safetensors::SafeTensors::read_metadata(&bytes).unwrap().1.metadata().clone().unwrap_or_default();
            meta.insert("tree".into(), value.into());
            let views: Vec<(String, TensorView<'_>)> = st
                .tensors()
                .into_iter()
                .map(|(n, v)| (n, TensorView::new(v.dtype(), v.shape().to_vec(), v.data()).unwrap()))
                .collect();
            DraftHead::from_bytes(&safetensors::serialize(views, Some(meta)).unwrap())
        };
        let own = with_tree("6,1,6,0.4").unwrap();
        let six = TreeConfig { depth: 6, top_k: 1, budget: 6, min_prob: 0.4 };
        assert_eq!(own.tree, Some(six));
        assert_eq!(EagleProposer::tree_for(&own, None), six);
        assert_eq!(EagleProposer::tree_for(&own, Some(asked)), asked);
        // A value that does not parse is refused when the head loads, naming it.
        let err = with_tree("6,1").unwrap_err();
        assert!(matches!(&err, DraftHeadError::BadTree { value, .. } if value == "6,1"), "{err}");
        assert!(err.to_string().contains("expected DEPTH,TOP_K,BUDGET"), "{err}");
        // So is a tree too large to draft in reasonable time; the largest allowed one loads.
        assert!(with_tree("32,32,256,0").is_ok());
        for huge in ["1000000000,1,6", "6,33,6", "6,1,257"] {
            let err = with_tree(huge).unwrap_err();
            assert!(err.to_string().contains("at most depth 32"), "{huge}: {err}");
        }
    }

    /// The head's `k` best next tokens after every node, computed from scratch along the node's path.
    fn path_candidates(head: &DraftHead, model: &Model, root_feature: &[f32], tree: &DraftTree, k: usize) -> Vec<u32> {
        let (pool, mut scratch) = (ThreadPool::new(1), DraftScratch::default());
        let (mut feature, mut out, mut logits) = (Vec::new(), Vec::new(), Vec::new());
        let (mut order, mut best, mut path, mut want) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..tree.len() {
            head.first_input(root_feature, 1, &pool, &mut scratch, &mut feature);
            tree.path_tokens(i, &mut path);
            for &t in std::iter::once(&tree.root_token()).chain(&path) {
                head.forward(model, &[t], &feature, &pool, &mut scratch, &mut out, &mut logits).unwrap();
                feature.clone_from(&out);
            }
            best.clear();
            top_k_log_probs(&logits, k, &mut order, &mut best);
            want.extend((0..k).map(|j| head.d2t[padded(&best, j).0 as usize]));
        }
        want
    }

    #[test]
    fn candidates_of_every_node_follow_its_path_lookup_chain_included() {
        let model = model::testing::tiny_model("llama", None, 3, 64);
        let head = DraftHead::from_bytes(&random_head_bytes(32, 64, 16, 7)).unwrap();
        let (d, k) = (32, 4);
        let features: Vec<f32> = (0..12 * d).map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0).collect();
        let pool = ThreadPool::new(1);
        let root_feature = &features[10 * d..11 * d];
        // The head's first choice after the root 20: the lookup chain starts with it once (merging below the
        // head's node) and with another token once (a branch of its own).
        let mut first = vec![0u32; 0];
        let mut t = DraftTree::new(20);
        t.truncate(1);
        first.extend(path_candidates(&head, &model, root_feature, &t, 1));
        for lead in [first[0], 31] {
            let tokens = [4, 6, 20, lead, 8, 10, 12, 14, 16, 18, 6, 20];
            let context = DraftContext {
                model: &model,
                pool: &pool,
                tokens: &tokens,
                features: &features,
                feature_width: d,
                stable_prefix: 0,
            };
            let tree_config = TreeConfig { depth: 2, top_k: 2, budget: 3, min_prob: 0.0 };
            let mut proposer = EagleProposer::new(head.clone(), tree_config).with_lookup(3);
            let (mut tree, mut candidates) = (DraftTree::new(20), Vec::new());
            proposer.propose_with_candidates(&context, &mut tree, k, 3, &mut candidates).unwrap();
            let mut chain = Vec::new();
            let deepest = (0..tree.len()).max_by_key(|&i| (tree.node(i).depth, i)).unwrap();
            tree.path_tokens(deepest, &mut chain);
            assert_eq!(chain, [lead, 8, 10], "the lookup chain is the deepest path");
            assert!(tree.len() > 4, "lead {lead}: the chain added nodes to the head's 3");
            let got: Vec<u32> = candidates.iter().map(|c| c.0).collect();
            assert_eq!(got, path_candidates(&head, &model, root_feature, &tree, k), "lead {lead}");
        }
    }

    #[test]
    fn head_loads_and_checks_shapes() {
        let head = DraftHead::from_bytes(&random_head_bytes(32, 64, 16, 1)).unwrap();
        assert_eq!((head.n_embd, head.n_ff, head.vocab), (32, 64, 16));
        assert_eq!(head.d2t[5], 10); // offset j → token 2j
        let model = model::testing::tiny_model("llama", None, 3, 64);
        head.check_fits(&model).unwrap();
        let wide = DraftHead::from_bytes(&random_head_bytes(64, 64, 16, 1)).unwrap();
        assert!(matches!(wide.check_fits(&model), Err(DraftHeadError::Width { head: 64, model: 32 })));
        let small = model::testing::tiny_model("llama", None, 3, 20);
        assert!(matches!(head.check_fits(&small), Err(DraftHeadError::BadMapping { .. })));
        assert!(DraftHead::from_bytes(b"not a safetensors file").is_err());
    }

    #[test]
    fn eagle_greedy_equals_dense_greedy_on_a_tiny_model() {
        for arch in ["llama", "gemma3"] {
            let model = model::testing::tiny_model(arch, None, 11, 64);
            let n = 40;
            let want = crate::test_util::dense_greedy(&model, n);
            for fuse in [&[][..], &[1, 3]] {
                let head = DraftHead::from_bytes(&random_fused_head_bytes(32, 64, 32, 5, fuse)).unwrap();
                let proposer = EagleProposer::new(head, TreeConfig { depth: 4, top_k: 3, budget: 8, min_prob: 0.0 });
                let mut dec = SpeculativeDecoder::new(&model, 128, 2, proposer, SamplingParams::greedy());
                let got = crate::test_util::speculative_greedy(&mut dec, n);
                assert_eq!(got, want, "{arch} fuse {fuse:?}");
                assert!(dec.stats().drafted_nodes > 0, "the head drafted nothing");
            }
        }
    }

    #[test]
    fn decoders_verified_together_in_one_forward_step_as_each_alone() {
        let tree = TreeConfig { depth: 4, top_k: 3, budget: 8, min_prob: 0.0 };
        let head = || DraftHead::from_bytes(&random_head_bytes(32, 64, 32, 5)).unwrap();
        let prompts: [&[u32]; 2] = [&crate::test_util::PROMPT, &[9, 2, 2, 14, 6]];
        let n = 30;
        for arch in ["llama", "gemma3"] {
            let model = model::testing::tiny_model(arch, None, 11, 64);
            let d = model.config.n_embd;
            let new =
                || SpeculativeDecoder::new(&model, 128, 1, EagleProposer::new(head(), tree), SamplingParams::greedy());
            // Each alone: its tokens and trees.
            let alone: Vec<(Vec<u32>, Vec<Vec<u32>>)> = prompts
                .iter()
                .map(|p| {
                    let mut dec = new();
                    dec.feed(p).unwrap();
                    let (mut got, mut trees) = (Vec::new(), Vec::new());
                    while got.len() < n {
                        got.extend_from_slice(dec.step_at_most(usize::MAX).unwrap());
                        trees.push(dec.last_tree().nodes().iter().map(|node| node.token).collect());
                    }
                    (got, trees)
                })
                .collect();
            // Together, one forward a step (the second capped at 2 rows, or 1 — its root only, nothing drafted —, every other step: still lossless).
            for cap in [usize::MAX, 2, 1] {
                let mut decs: Vec<_> = prompts
                    .iter()
                    .map(|p| {
                        let mut dec = new();
                        dec.feed(p).unwrap();
                        dec
                    })
                    .collect();
                let mut ws = Workspace::new(2);
                let (mut hidden, mut normed) = (Vec::new(), Vec::new());
                let mut got = vec![Vec::new(); 2];
                let mut trees = vec![Vec::new(); 2];
                for step in 0.. {
                    if got.iter().all(|g: &Vec<u32>| g.len() >= n) {
                        break;
                    }
                    let caps = [usize::MAX, if step % 2 == 1 { cap } else { usize::MAX }];
                    let [a, b] = &mut decs[..] else { unreachable!() };
                    a.draft_rows(ws.pool(), usize::MAX, caps[0]).unwrap();
                    b.draft_rows(ws.pool(), usize::MAX, caps[1]).unwrap();
                    let ((ra, ka), (rb, kb)) = (a.pending_rows().unwrap(), b.pending_rows().unwrap());
                    let (na, nb) = (ra.tokens.len(), rb.tokens.len());
                    assert!(nb <= caps[1]);
                    let rows = [
                        model::Rows { tokens: &ra.tokens, positions: &ra.positions, mask: Mask::Allowed(&ra.mask) },
                        model::Rows { tokens: &rb.tokens, positions: &rb.positions, mask: Mask::Allowed(&rb.mask) },
                    ];
                    model.forward_rows(&rows, &mut [ka, kb], &mut ws, &mut hidden).unwrap();
                    normed.resize(hidden.len(), 0.0);
                    model.final_norm(&hidden, &mut normed);
                    let mut choices = vec![0u32; na + nb];
                    model.head_argmax(&normed, na + nb, &mut choices, &mut ws);
                    for (k, (dec, range)) in decs.iter_mut().zip([0..na, na..na + nb]).enumerate() {
                        let committed =
                            dec.commit_rows(&choices[range.clone()], &normed[range.start * d..range.end * d]);
                        got[k].extend_from_slice(committed.unwrap());
                        trees[k].push(dec.last_tree().nodes().iter().map(|node| node.token).collect::<Vec<u32>>());
                    }
                }
                for k in 0..2 {
                    got[k].truncate(n);
                    let mut want = alone[k].0.clone();
                    want.truncate(n);
                    assert_eq!(got[k], want, "{arch}, sequence {k}, cap {cap}");
                    if cap == usize::MAX {
                        assert_eq!(
                            trees[k][..alone[k].1.len().min(trees[k].len())],
                            alone[k].1[..alone[k].1.len().min(trees[k].len())],
                            "{arch}: other trees"
                        );
                    }
                }
                assert!(trees.iter().flatten().any(|t| t.len() > 2), "nothing drafted");
            }
            // A commit without a drafted step, or with rows that do not match the tree, is refused.
            let mut dec = new();
            dec.feed(prompts[0]).unwrap();
            assert!(dec.commit_rows(&[1], &vec![0.0; d]).is_err());
            let ws = Workspace::new(1);
            assert!(dec.pending_rows().is_none());
            dec.draft_rows(ws.pool(), usize::MAX, usize::MAX).unwrap();
            let before = dec.pending_rows().unwrap().1.seq_len();
            assert!(dec.commit_rows(&[1], &vec![0.0; d]).is_err());
            assert!(dec.pending_rows().is_none());
            dec.draft_rows(ws.pool(), usize::MAX, usize::MAX).unwrap();
            assert_eq!(dec.pending_rows().unwrap().1.seq_len(), before);
        }
    }

    #[test]
    fn a_resumed_decoder_goes_on_as_dense_from_another_decoders_cache() {
        let tree = TreeConfig { depth: 4, top_k: 3, budget: 8, min_prob: 0.0 };
        let head = || DraftHead::from_bytes(&random_head_bytes(32, 64, 32, 5)).unwrap();
        for arch in ["llama", "gemma3"] {
            let model = model::testing::tiny_model(arch, None, 11, 64);
            let n = 40;
            let want = crate::test_util::dense_greedy(&model, n);
            // The same run uninterrupted: its draft trees after the first step are what the resumed one must draft
            // (the head reads the root's parent's feature: a wrong one drafts other trees).
            let mut whole =
                SpeculativeDecoder::new(&model, 128, 2, EagleProposer::new(head(), tree), SamplingParams::greedy());
            whole.feed(&crate::test_util::PROMPT).unwrap();
            let mut trees = Vec::new();
            let mut steps = 0;
            while whole.tokens().len() < crate::test_util::PROMPT.len() + n {
                whole.step_at_most(if steps == 0 { 3 } else { usize::MAX }).unwrap();
                if steps > 0 {
                    trees.push(whole.last_tree().nodes().iter().map(|node| node.token).collect::<Vec<_>>());
                }
                steps += 1;
            }
            let mut first =
                SpeculativeDecoder::new(&model, 128, 2, EagleProposer::new(head(), tree), SamplingParams::greedy());
            first.feed(&crate::test_util::PROMPT).unwrap();
            let mut got = first.step_at_most(3).unwrap().to_vec();
            let tokens = first.tokens().to_vec();
            let width = first.features().len() / (tokens.len() - 1);
            let root_feature = first.features()[first.features().len() - width..].to_vec();
            let (kv, ws) = first.into_parts();
            // Shapes that do not agree are refused (one token too many; a feature row too short).
            let other = model.new_cache(128);
            let greedy = SamplingParams::greedy;
            let short = &root_feature[1..];
            for (kv, toks, feature) in
                [(other, &tokens[..], &root_feature[..]), (model.new_cache(8), &tokens[..3], short)]
            {
                let p = EagleProposer::new(head(), tree);
                assert!(SpeculativeDecoder::resume(&model, kv, Workspace::new(1), p, greedy(), toks.to_vec(), feature)
                    .is_err());
            }
            let proposer = EagleProposer::new(head(), tree);
            let mut dec =
                SpeculativeDecoder::resume(&model, kv, ws, proposer, greedy(), tokens, &root_feature).unwrap();
            let mut resumed_trees = Vec::new();
            while got.len() < n {
                got.extend_from_slice(dec.step_at_most(usize::MAX).unwrap());
                resumed_trees.push(dec.last_tree().nodes().iter().map(|node| node.token).collect::<Vec<_>>());
            }
            got.truncate(n);
            assert_eq!(got, want, "{arch}");
            assert_eq!(resumed_trees, trees, "{arch}: the resumed decoder drafted other trees");
            assert!(trees.iter().any(|t| t.len() > 1), "the head drafted nothing");
        }
        // A fused head's feature rows carry layer inputs too: the final-normed row alone is refused.
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let fused = DraftHead::from_bytes(&random_fused_head_bytes(32, 64, 32, 5, &[1, 3])).unwrap();
        let mut kv = model.new_cache(16);
        model.forward(&[1, 2, 3], &mut kv, &mut Workspace::new(1), &mut Vec::new(), model::Logits::None).unwrap();
        let p = EagleProposer::new(fused, tree);
        let resumed = SpeculativeDecoder::resume(
            &model,
            kv,
            Workspace::new(1),
            p,
            SamplingParams::greedy(),
            vec![1, 2, 3, 4],
            &[0.0; 32],
        );
        assert!(resumed.is_err());
    }
}
