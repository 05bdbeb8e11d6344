//! Compute kernels for specee: ggml-compatible quantized weight formats, matrix × activation products
//! with runtime SIMD dispatch, and the persistent thread pool they run on.
//!
//! How a linear layer is computed ([`matmul`]), numerically like llama.cpp's CPU backend:
//! 1. The f32 activations are converted to the weight type's "vec_dot_type" ([`quantize`]: Q8_0 for
//!    Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the k-quants, f16/bf16 rounding for F16/BF16).
//! 2. Weight rows are split across the [`ThreadPool`]; each weight block is loaded once and dotted with a
//!    tile of up to 8 activation rows (cheap multi-token verification for speculative decoding).
//! 3. Dot products use integer block sums scaled per block ([`kernel`]): AVX-512 VNNI, AVX2 or scalar,
//!    chosen at run time ([`detected_isa`], env `SPECEE_KERNEL=scalar|avx2|avx512`); AMX tiles for ≥ 10
//!    activation rows in the head screen where the CPU has them (`SPECEE_AMX=0`: off) and, with `SPECEE_AMX=1`, in
//!    the matmuls too (opt-in: no faster end to end where measured, `kernel/amx.rs`).
//!
//! [`colskip`] holds column-major products that skip the columns of zero inputs (activation sparsity, issue #39):
//! measured 1.4–2.4× dense's cost per weight read, so no faster than dense below 30–70% zero inputs; no model
//! path uses them (`bench/colskip_ceiling.sh`, heads/README.md).
//!
//! ```
//! use kernels::{matmul, MatmulScratch, QMatrix, ThreadPool};
//! let pool = ThreadPool::new(2);
//! let w: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! let m = QMatrix::new(gguf::GgmlType::F32, &w, 2, 2).unwrap();
//! let mut out = [0.0; 2];
//! matmul(&pool, &m, &[1.0, 1.0], 1, &mut out, &mut MatmulScratch::default());
//! assert_eq!(out, [3.0, 7.0]);
//! ```

// `x % n == 0` is kept over `is_multiple_of` for the workspace's minimum Rust version.
#![allow(clippy::manual_is_multiple_of)]

pub mod blocks;
pub mod colskip;
pub mod dequant;
pub(crate) mod kernel;
pub mod matmul;
pub mod pool;
pub(crate) mod quantize;
pub mod repack;
pub mod screen;

pub use colskip::{colskip_matvec, ColMatrix, ColScratch};
pub use dequant::dequantize_row;
pub use gguf::GgmlType;
pub use matmul::{
    matmul, matmul_many, matmul_pair_then, matmul_rows, matmul_rows_grouped, Layout, MatmulScratch, QMatrix,
};
pub use pool::{parallel_for, ThreadPool};
pub use quantize::quantize_q8_0_weights;
pub use screen::HeadScreen;

/// Errors from building kernel inputs.
#[derive(thiserror::Error, Debug)]
pub enum KernelError {
    /// The tensor type has no kernel.
    #[error("unsupported tensor type {0} for matmul")]
    UnsupportedType(&'static str),
    /// The matrix shape does not fit the data or the type's block size.
    #[error("bad {ty} matrix shape {rows}x{cols} with {data_len} bytes: {reason}")]
    BadShape {
        /// Type name.
        ty: &'static str,
        /// Rows requested.
        rows: usize,
        /// Columns requested.
        cols: usize,
        /// Bytes given.
        data_len: usize,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Whether [`matmul`] and [`dequantize_row`] support weights of type `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    quantize::act_kind(ty).is_some()
}

/// The instruction set the kernels use in this process, for logs (e.g. `"avx512-vnni"`).
pub fn detected_isa() -> &'static str {
    kernel::Isa::current().name()
}

#[cfg(test)]
mod tests;
