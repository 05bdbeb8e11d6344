//! The draft head as a trainable candle network (the same computation as
//! [`decode::speculative::eagle`], which runs it at inference on our own kernels), its initialisation from the
//! target, and its safetensors file.

use crate::TrainError;
use candle_core::{DType, Device, Tensor, Var, D};
use decode::speculative::eagle::FORMAT;
use std::collections::HashMap;
use std::path::Path;

/// Sizes of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    pub d: usize,
    pub ff: usize,
    pub vocab: usize,
    /// Fused layer-input rows besides the final-normed feature (0: an unfused EAGLE-1-style head).
    pub aux: usize,
}

/// Trainable parameters, in file order.
pub struct HeadNet {
    pub shape: HeadShape,
    pub eps: f64,
    pub emb_norm: Var,
    pub fc_w: Var,
    pub fc_b: Var,
    pub mlp_norm: Var,
    pub gate: Var,
    pub up: Var,
    pub down: Var,
    pub lm_head: Var,
    /// With [`HeadShape::aux`] > 0: the RMS-norm weights of the aux rows (`aux·d`) and the fusion
    /// `[d, (1 + aux)·d]` that maps `[feature ; normed aux rows]` to the first step's feature.
    pub fuse: Option<(Var, Var)>,
}

/// Tensor names in the head file, matching [`HeadNet::vars`].
const NAMES: [&str; 8] = [
    "emb_norm.weight",
    "fc.weight",
    "fc.bias",
    "mlp_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "lm_head.weight",
];

/// RMS norm over the last dimension, times `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// Tensor names of the fusion, matching [`HeadNet::fuse`].
pub const FUSE_NAMES: [&str; 2] = ["fuse_norm.weight", "fuse.weight"];

/// Outputs of one draft step.
pub struct StepOut {
    /// Predicted features `[B, d]`.
    pub features: Tensor,
    /// Draft-vocabulary logits `[B, N]`.
    pub logits: Tensor,
}

impl HeadNet {
    /// A fresh head: `lm_head` from the target's head rows (`head_rows`, `N × d`), `fc` passing the feature
    /// through (`[0 | I]` plus a little noise), the feed-forward block's output projection at zero — so an
    /// untrained head already predicts "the feature stays", a sane start.
    pub fn new(shape: HeadShape, eps: f64, head_rows: &[f32], seed: u64) -> Result<HeadNet, TrainError> {
        let dev = Device::Cpu;
        let HeadShape { d, ff, vocab, aux } = shape;
        let mut rng = Lcg(seed);
        let mut fc = vec![0f32; d * 2 * d];
        for r in 0..d {
            for c in 0..2 * d {
                fc[r * 2 * d + c] = rng.normal() * 0.02 + if c == d + r { 1.0 } else { 0.0 };
            }
        }
        let scale = 1.0 / (d as f32).sqrt();
        let gate: Vec<f32> = (0..ff * d).map(|_| rng.normal() * scale).collect();
        let up: Vec<f32> = (0..ff * d).map(|_| rng.normal() * scale).collect();
        let t = |v: Vec<f32>, dims: &[usize]| -> Result<Var, TrainError> {
            Ok(Var::from_tensor(&Tensor::from_vec(v, dims, &dev)?)?)
        };
        Ok(HeadNet {
            shape,
            eps,
            emb_norm: t(vec![1.0; d], &[d])?,
            fc_w: t(fc, &[d, 2 * d])?,
            fc_b: t(vec![0.0; d], &[d])?,
            mlp_norm: t(vec![1.0; d], &[d])?,
            gate: t(gate, &[ff, d])?,
            up: t(up, &[ff, d])?,
            down: t(vec![0.0; d * ff], &[d, ff])?,
            lm_head: t(head_rows.to_vec(), &[vocab, d])?,
            // The fusion starts as "the feature alone" (identity on it, zero on the aux rows), so a fresh fused
            // head computes what a fresh unfused one does.
            fuse: if aux == 0 {
                None
            } else {
                let w = (1 + aux) * d;
                let fuse = (0..d * w).map(|i| if i % w == i / w { 1.0 } else { 0.0 }).collect();
                Some((t(vec![1.0; aux * d], &[aux * d])?, t(fuse, &[d, w])?))
            },
        })
    }

    /// The first step's input feature: the target's final-normed feature `feat` `[B, d]` fused with its aux rows
    /// `aux` `[B, aux·d]` (each RMS-normed); `feat` itself for an unfused head.
    pub fn fuse(&self, feat: &Tensor, aux: Option<&Tensor>) -> candle_core::Result<Tensor> {
        let (Some((norm, w)), Some(aux)) = (&self.fuse, aux) else { return Ok(feat.clone()) };
        let (b, d) = (feat.dim(0)?, self.shape.d);
        let k = self.shape.aux;
        let rows = aux.reshape((b, k, d))?;
        let ms = rows.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = rows.broadcast_div(&(ms + self.eps)?.sqrt()?)?.reshape((b, k * d))?.broadcast_mul(norm)?;
        Tensor::cat(&[feat, &normed], 1)?.matmul(&w.t()?)
    }

    /// The parameters, in [`NAMES`] order.
    pub fn vars(&self) -> Vec<Var> {
        let mut vars: Vec<Var> =
            [&self.emb_norm, &self.fc_w, &self.fc_b, &self.mlp_norm, &self.gate, &self.up, &self.down, &self.lm_head]
                .into_iter()
                .cloned()
                .collect();
        if let Some((norm, w)) = &self.fuse {
            vars.extend([norm.clone(), w.clone()]);
        }
        vars
    }

    /// Tensor names of [`HeadNet::vars`], in order.
    fn names(&self) -> Vec<&'static str> {
        let fused = if self.fuse.is_some() { &FUSE_NAMES[..] } else { &[] };
        NAMES.iter().chain(fused).copied().collect()
    }

    /// One step: embeddings `emb` `[B, d]` (the target's, raw) and input features `feat` `[B, d]`.
    pub fn step(&self, emb: &Tensor, feat: &Tensor) -> candle_core::Result<StepOut> {
        let e = rms_norm(emb, &self.emb_norm, self.eps)?;
        let inp = Tensor::cat(&[&e, feat], 1)?;
        let x = inp.matmul(&self.fc_w.t()?)?.broadcast_add(&self.fc_b)?;
        let n = rms_norm(&x, &self.mlp_norm, self.eps)?;
        let g = n.matmul(&self.gate.t()?)?.silu()?;
        let u = n.matmul(&self.up.t()?)?;
        let h = (x + (g * u)?.matmul(&self.down.t()?)?)?;
        let logits = h.matmul(&self.lm_head.t()?)?;
        Ok(StepOut { features: h, logits })
    }

    /// Writes the head (weights as `dtype`, F16 for the shipped file, F32 for checkpoints) with `d2t` offsets
    /// and metadata.
    pub fn save(
        &self,
        path: &Path,
        d2t: &[u32],
        dtype: DType,
        mut metadata: HashMap<String, String>,
    ) -> Result<(), TrainError> {
        metadata.insert("format".into(), FORMAT.into());
        metadata.insert("rms_eps".into(), self.eps.to_string());
        let blobs = self
            .names()
            .into_iter()
            .zip(self.vars())
            .map(|(name, var)| tensor_blob(name, var.as_tensor(), dtype))
            .collect::<Result<Vec<_>, _>>()?;
        write_head_file(path, blobs, d2t, metadata)
    }

    /// Loads the weights of a head file written by [`HeadNet::save`] into this net (shapes must match);
    /// returns the file's metadata and `d2t`.
    pub fn load_into(&self, path: &Path) -> Result<(HashMap<String, String>, Vec<u32>), TrainError> {
        let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
        let head = decode::speculative::DraftHead::from_bytes(&bytes).map_err(|e| TrainError::Format(e.to_string()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Format(e.to_string()))?;
        for (name, var) in self.names().into_iter().zip(self.vars()) {
            let view = st.tensor(name).map_err(|e| TrainError::Format(e.to_string()))?;
            if view.shape() != var.dims() {
                return Err(TrainError::Format(format!(
                    "{}: `{name}` has shape {:?}, expected {:?}",
                    path.display(),
                    view.shape(),
                    var.dims()
                )));
            }
            let values: Vec<f32> = match view.dtype() {
                safetensors::Dtype::F32 => {
                    view.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
                }
                _ => view.data().chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            };
            var.set(&Tensor::from_vec(values, view.shape(), &Device::Cpu)?)?;
        }
        Ok((head.metadata, head.d2t))
    }
}

/// One tensor of a head file: name, type, shape, little-endian bytes.
pub(crate) type Blob = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// `t` as a [`Blob`] of `dtype` (F16, or F32 for anything else).
pub(crate) fn tensor_blob(name: &str, t: &Tensor, dtype: DType) -> Result<Blob, TrainError> {
    let flat = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let (st, bytes) = match dtype {
        DType::F16 => {
            (safetensors::Dtype::F16, flat.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect())
        }
        _ => (safetensors::Dtype::F32, flat.iter().flat_map(|v| v.to_le_bytes()).collect()),
    };
    Ok((name.to_string(), st, t.dims().to_vec(), bytes))
}

/// Writes a head file: `blobs`, then `d2t` as I64 offsets (draft id `j` is target token `j + d2t[j]`), with
/// `metadata`; through a temporary file, so a crash never leaves half a head.
pub(crate) fn write_head_file(
    path: &Path,
    mut blobs: Vec<Blob>,
    d2t: &[u32],
    metadata: HashMap<String, String>,
) -> Result<(), TrainError> {
    use safetensors::tensor::TensorView;
    let offsets: Vec<u8> = d2t.iter().enumerate().flat_map(|(j, &t)| (t as i64 - j as i64).to_le_bytes()).collect();
    blobs.push(("d2t".into(), safetensors::Dtype::I64, vec![d2t.len()], offsets));
    let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
    let views = blobs
        .iter()
        .map(|(n, dt, dims, b)| Ok((n.as_str(), TensorView::new(*dt, dims.clone(), b).map_err(err)?)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    let tmp = path.with_extension("tmp");
    safetensors::serialize_to_file(views, Some(metadata), &tmp).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(|e| TrainError::Io(path.display().to_string(), e))
}

/// A small deterministic generator for initialisation and shuffling.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 ^ (self.0 >> 29)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform().max(1e-7), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }
}
