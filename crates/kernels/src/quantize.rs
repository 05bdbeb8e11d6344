//! Activation quantization: f32 activation rows converted to the "vec_dot_type" of the weight type,
//! exactly as ggml's CPU backend does before a matmul (`quantize_row_q8_0/q8_1` as in ggml's x86 build,
//! `quantize_row_q8_K_ref`, f16/bf16 rounding).
//!
//! The result is stored in a SIMD-friendly split layout ([`Acts`]) rather than ggml's interleaved blocks:
//! all `qs` of a token row are contiguous, block scales live in their own arrays. The numbers are the same.

use crate::blocks::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, nearest_int, QK, QK_K};
use gguf::GgmlType;

/// The activation format a weight type is dotted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    /// Plain f32 (F32 weights).
    F32,
    /// f32 values rounded through f16 (F16 weights).
    F16,
    /// f32 values rounded through bf16 (BF16 weights).
    BF16,
    /// 32-element blocks, f16 scale (Q4_0, Q5_0, Q8_0 weights).
    Q8_0,
    /// 32-element blocks, f16 scale and f16 `d * sum` (Q4_1, Q5_1 weights).
    Q8_1,
    /// 256-element blocks, f32 scale, 16 partial sums (k-quant weights).
    Q8K,
}

/// The activation format for weights of type `ty` (None if unsupported).
pub(crate) fn act_kind(ty: GgmlType) -> Option<ActKind> {
    Some(match ty {
        GgmlType::F32 => ActKind::F32,
        GgmlType::F16 => ActKind::F16,
        GgmlType::BF16 => ActKind::BF16,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => ActKind::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => ActKind::Q8_1,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActKind::Q8K,
        _ => return None,
    })
}

/// Quantized activations of `n_tokens` rows of `cols` elements, borrowed from a scratch buffer.
///
/// Per token `t`: `qs[t*cols..]` (i8 values), `d[t*nb..]` (block scale as f32; for Q8_0/Q8_1 already
/// rounded through f16), `s[t*nb..]` (block `d * sum(qs)`: for Q8_1 ggml's f16 `s`, for Q8_0 computed in
/// f32 from the f16 `d`), `bsums[t*nb*16..]` (Q8_K sums of 16 consecutive values), `f[t*cols..]` (f32/f16/
/// bf16 activations). `nb` is the number of activation blocks per row.
#[derive(Clone, Copy)]
pub(crate) struct Acts<'a> {
    pub qs: &'a [i8],
    /// `qs` with 128 added (as u8), for kernels that need an unsigned activation operand.
    pub qu: &'a [u8],
    pub d: &'a [f32],
    /// Q8_0/Q8_1: each block's `d` repeated 8 times (one 8-lane vector per block).
    pub dexp: &'a [f32],
    pub s: &'a [f32],
    pub bsums: &'a [i16],
    pub f: &'a [f32],
    pub cols: usize,
    pub nb: usize,
}

/// Growable buffers behind [`Acts`].
#[derive(Default)]
pub(crate) struct ActBuffers {
    pub qs: Vec<i8>,
    pub qu: Vec<u8>,
    pub d: Vec<f32>,
    pub dexp: Vec<f32>,
    pub s: Vec<f32>,
    pub bsums: Vec<i16>,
    pub f: Vec<f32>,
}

fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

impl ActBuffers {
    /// Makes room for `n_tokens` rows of `cols` elements in format `kind` (never shrinks).
    pub fn reserve(&mut self, kind: ActKind, n_tokens: usize, cols: usize) {
        match kind {
            ActKind::F32 => {}
            ActKind::F16 | ActKind::BF16 => grow(&mut self.f, n_tokens * cols),
            ActKind::Q8_0 | ActKind::Q8_1 => {
                grow(&mut self.qs, n_tokens * cols);
                grow(&mut self.qu, n_tokens * cols);
                grow(&mut self.d, n_tokens * cols / QK);
                grow(&mut self.dexp, n_tokens * cols / QK * 8);
                grow(&mut self.s, n_tokens * cols / QK);
            }
            ActKind::Q8K => {
                grow(&mut self.qs, n_tokens * cols);
                grow(&mut self.d, n_tokens * cols / QK_K);
                grow(&mut self.bsums, n_tokens * cols / 16);
            }
        }
    }

    /// Quantizes token rows `tokens` of `x` (each `cols` long) into the buffers. `reserve` must have
    /// been called for at least `tokens.end` rows.
    pub fn quantize_tokens(&mut self, kind: ActKind, x: &[f32], cols: usize, tokens: std::ops::Range<usize>) {
        for t in tokens {
            let xr = &x[t * cols..(t + 1) * cols];
            match kind {
                ActKind::F32 => {}
                ActKind::F16 => {
                    for (o, &v) in self.f[t * cols..(t + 1) * cols].iter_mut().zip(xr) {
                        *o = f16_to_f32(f32_to_f16(v));
                    }
                }
                ActKind::BF16 => {
                    for (o, &v) in self.f[t * cols..(t + 1) * cols].iter_mut().zip(xr) {
                        *o = bf16_to_f32(f32_to_bf16(v));
                    }
                }
                ActKind::Q8_0 | ActKind::Q8_1 => {
                    let nb = cols / QK;
                    let qs = &mut self.qs[t * cols..(t + 1) * cols];
                    let d = &mut self.d[t * nb..(t + 1) * nb];
                    let s = &mut self.s[t * nb..(t + 1) * nb];
                    quantize_q8_row(xr, qs, d, s, kind == ActKind::Q8_1);
                    for (u, &q) in self.qu[t * cols..(t + 1) * cols].iter_mut().zip(qs.iter()) {
                        *u = (q as u8) ^ 0x80;
                    }
                    for (e, &dv) in self.dexp[t * nb * 8..(t + 1) * nb * 8].chunks_exact_mut(8).zip(d.iter()) {
                        e.fill(dv);
                    }
                }
                ActKind::Q8K => {
                    let nb = cols / QK_K;
                    let qs = &mut self.qs[t * cols..(t + 1) * cols];
                    let d = &mut self.d[t * nb..(t + 1) * nb];
                    let bsums = &mut self.bsums[t * nb * 16..(t + 1) * nb * 16];
                    quantize_q8k_row(xr, qs, d, bsums);
                }
            }
        }
    }

    /// A view of the first `n_tokens` rows (`x` is the original activation, used for F32).
    pub fn view<'a>(&'a self, kind: ActKind, x: &'a [f32], cols: usize) -> Acts<'a> {
        let nb = match kind {
            ActKind::Q8_0 | ActKind::Q8_1 => cols / QK,
            ActKind::Q8K => cols / QK_K,
            _ => cols,
        };
        let f: &[f32] = match kind {
            ActKind::F32 => x,
            _ => &self.f,
        };
        Acts { qs: &self.qs, qu: &self.qu, d: &self.d, dexp: &self.dexp, s: &self.s, bsums: &self.bsums, f, cols, nb }
    }
}

/// Q8_0 / Q8_1 quantization of one row as ggml's x86 `quantize_row_q8_0/1`: `d = amax / 127` stored as
/// f16, `q = round_half_even(x * (127 / amax))`; for Q8_1 `s = f16(d * sum(q))` with the unrounded `d`.
/// For Q8_0 `s` receives `f16(d) * sum(q)` (our kernels use it; ggml's Q8_0 has no `s`).
pub(crate) fn quantize_q8_row(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32], q8_1: bool) {
    for ((xb, qb), (d_o, s_o)) in
        x.chunks_exact(QK).zip(qs.chunks_exact_mut(QK)).zip(d_out.iter_mut().zip(s_out.iter_mut()))
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            let r = (v * id).round_ties_even() as i32;
            *q = r as i8;
            sum += r;
        }
        let d16 = f16_to_f32(f32_to_f16(d));
        *d_o = d16;
        *s_o = if q8_1 { f16_to_f32(f32_to_f16(d * sum as f32)) } else { d16 * sum as f32 };
    }
}

/// Q8_K quantization of one row (`quantize_row_q8_K_ref`): per 256 elements `iscale = -127 / max` where
/// `max` is the signed value of largest magnitude, `q = min(127, nearest_int(iscale * x))`, `d = 1 / iscale`,
/// and the sums of each 16 consecutive `q`.
pub(crate) fn quantize_q8k_row(x: &[f32], qs: &mut [i8], d_out: &mut [f32], bsums: &mut [i16]) {
    for ((xb, qb), (d_o, bs)) in
        x.chunks_exact(QK_K).zip(qs.chunks_exact_mut(QK_K)).zip(d_out.iter_mut().zip(bsums.chunks_exact_mut(16)))
    {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *d_o = 0.0;
            qb.fill(0);
            bs.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, group) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *sum = group.iter().map(|&q| q as i16).sum();
        }
        *d_o = 1.0 / iscale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::testutil::Rng;

    #[test]
    fn q8_0_roundtrip_error_is_within_half_step() {
        let mut rng = Rng(7);
        let x: Vec<f32> = (0..256).map(|_| rng.f32() * 3.0).collect();
        let (mut qs, mut d, mut s) = (vec![0i8; 256], vec![0.0; 8], vec![0.0; 8]);
        quantize_q8_row(&x, &mut qs, &mut d, &mut s, true);
        for b in 0..8 {
            let mut sum = 0;
            for j in 0..32 {
                let v = x[b * 32 + j];
                assert!((qs[b * 32 + j] as f32 * d[b] - v).abs() <= d[b] * 0.51 + 1e-3 * v.abs());
                sum += qs[b * 32 + j] as i32;
            }
            // s is f16(d * sum) with the unrounded d: close to d16 * sum.
            assert!((s[b] - d[b] * sum as f32).abs() <= 2e-3 * s[b].abs() + 1e-3);
            let amax = x[b * 32..b * 32 + 32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(qs[b * 32..b * 32 + 32].iter().any(|q| q.abs() == 127) || amax == 0.0);
        }
    }

    #[test]
    fn q8_k_matches_ggml_reference_rules() {
        let mut rng = Rng(11);
        let mut x: Vec<f32> = (0..512).map(|_| rng.f32()).collect();
        x[3] = -2.0; // the element of largest magnitude always maps to -127, whatever its sign
        x[300] = 1.5;
        let (mut qs, mut d, mut bsums) = (vec![0i8; 512], vec![0.0; 2], vec![0i16; 32]);
        quantize_q8k_row(&x, &mut qs, &mut d, &mut bsums);
        assert_eq!(qs[3], -127);
        assert_eq!(qs[300], -127);
        for (i, &v) in x.iter().enumerate() {
            let b = i / 256;
            assert!((qs[i] as f32 * d[b] - v).abs() <= d[b].abs() * 0.51, "element {i}");
        }
        for g in 0..32 {
            assert_eq!(bsums[g] as i32, qs[g * 16..g * 16 + 16].iter().map(|&q| q as i32).sum::<i32>());
        }
        // All-zero block.
        quantize_q8k_row(&[0.0; 256], &mut qs[..256], &mut d[..1], &mut bsums[..16]);
        assert_eq!(d[0], 0.0);
    }
}
