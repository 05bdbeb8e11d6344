//! Typed handles to a model's tensors inside the memory-mapped GGUF file. Quantized matrices stay in their file
//! form (never expanded to f32); small vectors (norm weights, biases) are copied out as f32 at load.

use crate::error::ModelError;
use gguf::{GgmlType, GgufFile, TensorInfo};

/// A 2-D weight matrix in the file: `rows` rows of `cols` elements (GGUF dims `[cols, rows]`).
#[derive(Clone, Debug)]
pub struct Matrix {
    pub info: TensorInfo,
    /// The type the kernels see: the file's, or the type of `owned` when the matrix was converted at load.
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// The matrix converted at load into a faster type or layout (see [`Matrix::repack`]); `None`: the file's
    /// bytes.
    pub owned: Option<std::sync::Arc<[u8]>>,
    /// The block order the kernels see (interleaved when repacked).
    pub layout: kernels::Layout,
}

impl Matrix {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols).unwrap_or(0)
    }

    /// Converts a matrix into an exactly equal form whose kernels are faster ([`kernels::repack`]): matrices with
    /// a multiple of 8 rows whose interleaved kernels are faster on this CPU ([`kernels::repack::interleave_pays`]:
    /// Q4_0, Q4_1, Q4_K; Q5_0 and Q6_K with AVX2 or AVX-512 VNNI, Q8_0 with AVX-512 VNNI) into groups of 8
    /// interleaved rows; Q5_0 without its interleaved kernel into Q8_0 (then interleaved where that pays); other
    /// types are left as they are.
    pub fn repack(&mut self, file: &GgufFile) {
        if self.owned.is_some() {
            return;
        }
        let bytes = file.tensor_bytes(&self.info);
        let interleaves = |ty| kernels::repack::interleave_pays(ty) && self.rows % 8 == 0;
        let converted =
            (self.ty == GgmlType::Q5_0 && !interleaves(GgmlType::Q5_0)).then(|| kernels::repack::q5_0_to_q8_0(bytes));
        let ty = if converted.is_some() { GgmlType::Q8_0 } else { self.ty };
        let source = converted.as_deref().unwrap_or(bytes);
        if interleaves(ty) {
            self.owned = Some(kernels::repack::interleave8(ty, source, self.rows, self.cols).into());
            self.layout = kernels::Layout::Interleaved8;
        } else if let Some(converted) = converted {
            self.owned = Some(converted.into());
        } else {
            return;
        }
        self.ty = ty;
        file.release_tensor(&self.info);
    }
}

/// One transformer block's weights. Optional members exist only for the architectures that have them.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct Weights {
    pub token_embd: Matrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output head; `token_embd` itself when the embeddings are tied.
    pub output: Matrix,
}

/// Looks tensors up by their GGUF names and checks their shapes.
pub struct TensorLoader<'a> {
    pub file: &'a GgufFile,
}

impl<'a> TensorLoader<'a> {
    fn info(&self, name: &str) -> Result<&'a TensorInfo, ModelError> {
        self.file.tensor(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })
    }

    /// Whether the file holds a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    /// A matrix with `rows` rows of `cols` elements, in a type the kernels support.
    pub fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Matrix, ModelError> {
        let info = self.info(name)?;
        if info.dims != [cols, rows] {
            return Err(ModelError::BadShape {
                name: name.into(),
                expected: vec![cols, rows],
                found: info.dims.clone(),
            });
        }
        if !kernels::is_supported(info.ty) {
            return Err(ModelError::UnsupportedTensorType { name: name.into(), ty: info.ty.name() });
        }
        Ok(Matrix { info: info.clone(), ty: info.ty, rows, cols, owned: None, layout: kernels::Layout::Rows })
    }

    /// A vector of `n` elements, converted to f32.
    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let info = self.info(name)?;
        if info.dims != [n] {
            return Err(ModelError::BadShape { name: name.into(), expected: vec![n], found: info.dims.clone() });
        }
        if !matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(ModelError::UnsupportedTensorType { name: name.into(), ty: info.ty.name() });
        }
        let mut out = vec![0f32; n];
        kernels::dequantize_row(info.ty, self.file.tensor_bytes(info), &mut out);
        Ok(out)
    }

    /// A vector if present.
    pub fn opt_vector(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
        if self.has(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }
}
