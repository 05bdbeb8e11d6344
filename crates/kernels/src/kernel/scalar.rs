//! Portable scalar dot products of one weight row with one quantized activation row, following ggml's
//! generic `ggml_vec_dot_*` (integer block sums, then the float scale formulas). This is the reference
//! every SIMD path is tested against, and the fallback for types without a SIMD kernel.

use super::RowKernel;
use crate::blocks::*;
use crate::quantize::Acts;
use gguf::GgmlType;

/// The scalar row kernel for weight type `ty` (None if unsupported).
pub(crate) fn kernel(ty: GgmlType) -> Option<RowKernel> {
    Some(match ty {
        GgmlType::F32 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_f32),
        GgmlType::F16 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_f16),
        GgmlType::BF16 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_bf16),
        GgmlType::Q4_0 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q4_0),
        GgmlType::Q4_1 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q4_1),
        GgmlType::Q5_0 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q5_0),
        GgmlType::Q5_1 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q5_1),
        GgmlType::Q8_0 => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q8_0),
        GgmlType::Q2_K => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q2_k),
        GgmlType::Q3_K => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q3_k),
        GgmlType::Q4_K => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q4_k),
        GgmlType::Q5_K => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q5_k),
        GgmlType::Q6_K => |w, rb, a, t0, nt, o| rows(w, rb, a, t0, nt, o, dot_q6_k),
        _ => return None,
    })
}

#[inline(always)]
fn rows(
    w: &[u8],
    row_bytes: usize,
    acts: &Acts,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    dot: impl Fn(&[u8], &Acts, usize) -> f32,
) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(nt)) {
        for (j, o) in o.iter_mut().enumerate() {
            *o = dot(row, acts, t0 + j);
        }
    }
}

/// Activation slices of token `t`: (qs, d, s).
#[inline(always)]
fn q8<'a>(a: &'a Acts, t: usize) -> (&'a [i8], &'a [f32], &'a [f32]) {
    (&a.qs[t * a.cols..(t + 1) * a.cols], &a.d[t * a.nb..(t + 1) * a.nb], &a.s[t * a.nb..(t + 1) * a.nb])
}

fn dot_f32(row: &[u8], a: &Acts, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    let mut sum = 0.0f64;
    for (w, &x) in row.chunks_exact(4).zip(x) {
        sum += (f32::from_le_bytes([w[0], w[1], w[2], w[3]]) * x) as f64;
    }
    sum as f32
}

fn dot_f16(row: &[u8], a: &Acts, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    let mut sum = 0.0f64;
    for (w, &x) in row.chunks_exact(2).zip(x) {
        sum += (f16_to_f32(u16::from_le_bytes([w[0], w[1]])) * x) as f64;
    }
    sum as f32
}

fn dot_bf16(row: &[u8], a: &Acts, t: usize) -> f32 {
    let x = &a.f[t * a.cols..(t + 1) * a.cols];
    let mut sum = 0.0f64;
    for (w, &x) in row.chunks_exact(2).zip(x) {
        sum += (bf16_to_f32(u16::from_le_bytes([w[0], w[1]])) * x) as f64;
    }
    sum as f32
}

fn dot_q4_0(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, _) = q8(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q4_0_BYTES).enumerate() {
        let y = &qs[ib * QK..ib * QK + QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += ((b[2 + j] & 0xF) as i32 - 8) * y[j] as i32 + ((b[2 + j] >> 4) as i32 - 8) * y[j + 16] as i32;
        }
        sumf += sumi as f32 * read_f16(b, 0) * d[ib];
    }
    sumf
}

fn dot_q4_1(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, s) = q8(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q4_1_BYTES).enumerate() {
        let y = &qs[ib * QK..ib * QK + QK];
        let mut sumi = 0i32;
        for j in 0..16 {
            sumi += (b[4 + j] & 0xF) as i32 * y[j] as i32 + (b[4 + j] >> 4) as i32 * y[j + 16] as i32;
        }
        sumf += (read_f16(b, 0) * d[ib]) * sumi as f32 + read_f16(b, 2) * s[ib];
    }
    sumf
}

/// The 32 five-bit values of a Q5_0/Q5_1 block (`qh` bit j is the high bit of element j).
#[inline(always)]
fn q5_values(qh: u32, qs: &[u8]) -> [i32; 32] {
    let mut v = [0i32; 32];
    for j in 0..16 {
        v[j] = ((qs[j] & 0xF) as u32 | (((qh >> j) & 1) << 4)) as i32;
        v[j + 16] = ((qs[j] >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4)) as i32;
    }
    v
}

fn dot_q5_0(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, _) = q8(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q5_0_BYTES).enumerate() {
        let y = &qs[ib * QK..ib * QK + QK];
        let v = q5_values(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]);
        let sumi: i32 = v.iter().zip(y).map(|(&v, &y)| (v - 16) * y as i32).sum();
        sumf += (read_f16(b, 0) * d[ib]) * sumi as f32;
    }
    sumf
}

fn dot_q5_1(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, s) = q8(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q5_1_BYTES).enumerate() {
        let y = &qs[ib * QK..ib * QK + QK];
        let v = q5_values(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]);
        let sumi: i32 = v.iter().zip(y).map(|(&v, &y)| v * y as i32).sum();
        sumf += (read_f16(b, 0) * d[ib]) * sumi as f32 + read_f16(b, 2) * s[ib];
    }
    sumf
}

fn dot_q8_0(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, _) = q8(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q8_0_BYTES).enumerate() {
        let y = &qs[ib * QK..ib * QK + QK];
        let sumi: i32 = b[2..34].iter().zip(y).map(|(&w, &y)| (w as i8) as i32 * y as i32).sum();
        sumf += sumi as f32 * (read_f16(b, 0) * d[ib]);
    }
    sumf
}

/// The head screen's interleaved 6-bit groups ([`crate::screen`]) × `nt` Q8_0 activation rows from `t0`, into
/// `out[j * stride + r]`: per block the integer sum starts at `Acts::zb` (the `+ 32` offset off), then
/// `acc += sum · (d_w · d_x)` in f32, as the SIMD kernels do (which fuse the multiply-add).
pub(crate) fn screen6(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    use crate::screen::{scale, value, BLOCK_BYTES, GROUP};
    let nb = cols / QK;
    for (g, grp) in w.chunks_exact(nb * BLOCK_BYTES).enumerate() {
        for j in 0..nt {
            let t = t0 + j;
            let (qs, d, _) = q8(a, t);
            let zb = &a.zb[t * nb..(t + 1) * nb];
            for r in 0..GROUP {
                let mut acc = 0.0f32;
                for (b, blk) in grp.chunks_exact(BLOCK_BYTES).enumerate() {
                    let y = &qs[b * QK..(b + 1) * QK];
                    let sum = y.iter().enumerate().fold(zb[b], |s, (e, &y)| s + value(blk, r, e) as i32 * y as i32);
                    acc += sum as f32 * (scale(blk, r) * d[b]);
                }
                out[j * stride + g * GROUP + r] = acc;
            }
        }
    }
}

/// Activation slices of token `t` for Q8_K: (qs, d, bsums).
#[inline(always)]
fn q8k<'a>(a: &'a Acts, t: usize) -> (&'a [i8], &'a [f32], &'a [i16]) {
    (&a.qs[t * a.cols..(t + 1) * a.cols], &a.d[t * a.nb..(t + 1) * a.nb], &a.bsums[t * a.nb * 16..(t + 1) * a.nb * 16])
}

fn dot_q4_k(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, bsums) = q8k(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q4_K_BYTES).enumerate() {
        let y = &qs[ib * QK_K..ib * QK_K + QK_K];
        let bs = &bsums[ib * 16..ib * 16 + 16];
        let (mut isum, mut msum) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            let q = &b[16 + 32 * (j / 2)..16 + 32 * (j / 2) + 32];
            let yj = &y[32 * j..32 * j + 32];
            let dot: i32 = if j % 2 == 0 {
                q.iter().zip(yj).map(|(&q, &y)| (q & 0xF) as i32 * y as i32).sum()
            } else {
                q.iter().zip(yj).map(|(&q, &y)| (q >> 4) as i32 * y as i32).sum()
            };
            isum += sc as i32 * dot;
            msum += m as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        sumf += d[ib] * read_f16(b, 0) * isum as f32 - d[ib] * read_f16(b, 2) * msum as f32;
    }
    sumf
}

fn dot_q5_k(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, bsums) = q8k(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q5_K_BYTES).enumerate() {
        let y = &qs[ib * QK_K..ib * QK_K + QK_K];
        let bs = &bsums[ib * 16..ib * 16 + 16];
        let qh = &b[16..48];
        let (mut isum, mut msum) = (0i32, 0i32);
        for j in 0..8 {
            let (sc, m) = scale_min_k4(j, &b[4..16]);
            let q = &b[48 + 32 * (j / 2)..48 + 32 * (j / 2) + 32];
            let mut dot = 0i32;
            for l in 0..32 {
                let low = if j % 2 == 0 { q[l] & 0xF } else { q[l] >> 4 };
                let v = low as i32 | ((((qh[l] >> j) & 1) as i32) << 4);
                dot += v * y[32 * j + l] as i32;
            }
            isum += sc as i32 * dot;
            msum += m as i32 * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
        }
        sumf += d[ib] * read_f16(b, 0) * isum as f32 - d[ib] * read_f16(b, 2) * msum as f32;
    }
    sumf
}

fn dot_q6_k(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, _) = q8k(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q6_K_BYTES).enumerate() {
        let y = &qs[ib * QK_K..ib * QK_K + QK_K];
        let mut isum = 0i32;
        for n in 0..2 {
            let ql = &b[64 * n..64 * n + 64];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            // Four quarters of 32 elements; each quarter has two 16-element scales.
            for k in 0..4 {
                for half in 0..2 {
                    let mut dot = 0i32;
                    for l in 16 * half..16 * half + 16 {
                        let q = ql[l + 32 * (k % 2)];
                        let low = if k < 2 { q & 0xF } else { q >> 4 };
                        let v = (low | (((qh[l] >> (2 * k)) & 3) << 4)) as i32 - 32;
                        dot += v * y[128 * n + 32 * k + l] as i32;
                    }
                    isum += (b[192 + 8 * n + 2 * k + half] as i8) as i32 * dot;
                }
            }
        }
        sumf += d[ib] * read_f16(b, 208) * isum as f32;
    }
    sumf
}

fn dot_q2_k(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, bsums) = q8k(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q2_K_BYTES).enumerate() {
        let y = &qs[ib * QK_K..ib * QK_K + QK_K];
        let bs = &bsums[ib * 16..ib * 16 + 16];
        let (mut isum, mut msum) = (0i32, 0i32);
        for g in 0..16 {
            let sc = b[g];
            msum += (sc >> 4) as i32 * bs[g] as i32;
            // Group g: half n = g / 8, shift index (g % 8) / 2, bytes 16 * (g % 2)..+16.
            let (n, shift, off) = (g / 8, 2 * ((g % 8) / 2), 16 * (g % 2));
            let mut dot = 0i32;
            for l in 0..16 {
                let q = (b[16 + 32 * n + off + l] >> shift) & 3;
                dot += q as i32 * y[16 * g + l] as i32;
            }
            isum += (sc & 0xF) as i32 * dot;
        }
        sumf += d[ib] * read_f16(b, 80) * isum as f32 - d[ib] * read_f16(b, 82) * msum as f32;
    }
    sumf
}

fn dot_q3_k(row: &[u8], a: &Acts, t: usize) -> f32 {
    let (qs, d, _) = q8k(a, t);
    let mut sumf = 0.0f32;
    for (ib, b) in row.chunks_exact(Q3_K_BYTES).enumerate() {
        let y = &qs[ib * QK_K..ib * QK_K + QK_K];
        let scales = q3_k_scales(&b[96..108]);
        let mut isum = 0i32;
        for g in 0..16 {
            let (n, shift_index, off) = (g / 8, (g % 8) / 2, 16 * (g % 2));
            let mut dot = 0i32;
            for l in off..off + 16 {
                let q = ((b[32 + 32 * n + l] >> (2 * shift_index)) & 3) as i32;
                let high = (b[l] >> (4 * n + shift_index)) & 1;
                dot += (q - if high == 1 { 0 } else { 4 }) * y[16 * g + l - off] as i32;
            }
            isum += scales[g] as i32 * dot;
        }
        sumf += d[ib] * read_f16(b, 108) * isum as f32;
    }
    sumf
}

/// Q4_0 (`MIN = false`), Q4_1 (`MIN`) or Q5_0 (`FIVE`) weights interleaved by 8 rows
/// ([`crate::repack::interleave8`]) × `nt` activation rows: `out[j * stride + r] = dot(row r, activation row t0 +
/// j)`, the formulas of [`dot_q4_0`]/[`dot_q4_1`] (`-8 · d · Σ(y · d_y)` for Q4_0's offset, `-16 · …` for Q5_0's,
/// whose values are the nibble plus 16 where the fifth bit is set).
pub(crate) fn q4_x8<const MIN: bool, const FIVE: bool>(
    w: &[u8],
    cols: usize,
    a: &Acts,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    use crate::repack::Q5_0_X8_QH;
    let nb = cols / QK;
    let (xb, regs) = crate::repack::x8_nibble_layout(MIN, FIVE);
    let offset = if FIVE { -16.0 } else { -8.0 };
    for (g, grp) in w.chunks_exact(nb * xb).enumerate() {
        for j in 0..nt {
            let (qs, d, s) = q8(a, t0 + j);
            let mut sumf = [0.0f32; 8];
            for (b, blk) in grp.chunks_exact(xb).enumerate() {
                let y = &qs[b * QK..b * QK + QK];
                // The fifth bit of byte `bit` of register `i`'s low (`half` 0) or high (4) nibbles.
                let fifth = |i: usize, half: usize, bit: usize| -> i32 {
                    if FIVE {
                        let m = &blk[Q5_0_X8_QH + 8 * i + half..][..4];
                        16 * ((u32::from_le_bytes([m[0], m[1], m[2], m[3]]) >> bit) & 1) as i32
                    } else {
                        0
                    }
                };
                for (r, sumf) in sumf.iter_mut().enumerate() {
                    let mut sumi = 0i32;
                    for i in 0..4 {
                        for e in 0..4 {
                            let q = blk[regs + 32 * i + 4 * r + e];
                            let lo = (q & 0xF) as i32 + fifth(i, 0, 4 * r + e);
                            let hi = (q >> 4) as i32 + fifth(i, 4, 4 * r + e);
                            sumi += lo * y[4 * i + e] as i32 + hi * y[16 + 4 * i + e] as i32;
                        }
                    }
                    let dw = read_f16(blk, 2 * r);
                    let cw = if MIN { read_f16(blk, 16 + 2 * r) } else { offset * dw };
                    *sumf += (dw * d[b]) * sumi as f32 + cw * s[b];
                }
            }
            out[j * stride + 8 * g..j * stride + 8 * g + 8].copy_from_slice(&sumf);
        }
    }
}

/// Q8_0 weights interleaved by 8 rows ([`crate::repack::interleave8`]) × `nt` activation rows:
/// `out[j * stride + r] = dot(row r, activation row t0 + j)`, the formula of [`dot_q8_0`].
pub(crate) fn q8_x8(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    use crate::repack::{Q8_0_X8_BYTES, Q8_0_X8_QS};
    let nb = cols / QK;
    for (g, grp) in w.chunks_exact(nb * Q8_0_X8_BYTES).enumerate() {
        for j in 0..nt {
            let (qs, d, _) = q8(a, t0 + j);
            let mut sumf = [0.0f32; 8];
            for (b, blk) in grp.chunks_exact(Q8_0_X8_BYTES).enumerate() {
                let y = &qs[b * QK..b * QK + QK];
                for (r, sumf) in sumf.iter_mut().enumerate() {
                    let mut sumi = 0i32;
                    for i in 0..8 {
                        for e in 0..4 {
                            sumi += blk[Q8_0_X8_QS + 32 * i + 4 * r + e] as i8 as i32 * y[4 * i + e] as i32;
                        }
                    }
                    *sumf += (read_f16(blk, 2 * r) * d[b]) * sumi as f32;
                }
            }
            out[j * stride + 8 * g..j * stride + 8 * g + 8].copy_from_slice(&sumf);
        }
    }
}

/// Q4_K weights interleaved by 8 rows ([`crate::repack::interleave8`]) × `nt` activation rows:
/// `out[j * stride + r] = dot(row r, activation row t0 + j)`, the formula of [`dot_q4_k`].
pub(crate) fn q4_k_x8(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    use crate::repack::{Q4_K_X8_BYTES, Q4_K_X8_MINS, Q4_K_X8_QS, Q4_K_X8_SCALES};
    let nb = cols / QK_K;
    for (g, grp) in w.chunks_exact(nb * Q4_K_X8_BYTES).enumerate() {
        for j in 0..nt {
            let (qs, d, bsums) = q8k(a, t0 + j);
            let mut sumf = [0.0f32; 8];
            for (ib, blk) in grp.chunks_exact(Q4_K_X8_BYTES).enumerate() {
                let y = &qs[ib * QK_K..ib * QK_K + QK_K];
                let bs = &bsums[ib * 16..ib * 16 + 16];
                for (r, sumf) in sumf.iter_mut().enumerate() {
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for sb in 0..8 {
                        let mut dot = 0i32;
                        for i in 0..8 {
                            for e in 0..4 {
                                let q = blk[Q4_K_X8_QS + 256 * (sb / 2) + 32 * i + 4 * r + e];
                                let v = if sb % 2 == 0 { q & 0xF } else { q >> 4 };
                                dot += v as i32 * y[32 * sb + 4 * i + e] as i32;
                            }
                        }
                        isum += blk[Q4_K_X8_SCALES + 8 * sb + r] as i32 * dot;
                        msum += blk[Q4_K_X8_MINS + 8 * sb + r] as i32 * (bs[2 * sb] as i32 + bs[2 * sb + 1] as i32);
                    }
                    *sumf +=
                        d[ib] * read_f16(blk, 2 * r) * isum as f32 - d[ib] * read_f16(blk, 16 + 2 * r) * msum as f32;
                }
            }
            out[j * stride + 8 * g..j * stride + 8 * g + 8].copy_from_slice(&sumf);
        }
    }
}

/// Q6_K weights interleaved by 8 rows ([`crate::repack::interleave8`]) × `nt` activation rows:
/// `out[j * stride + r] = dot(row r, activation row t0 + j)` = `d_x·d_w·(Σ sc·Σ q·y − 32·Σ sc·bsum)` over the
/// sub-blocks (values stored as `q` in 0..64 for the weight `d·sc·(q − 32)`).
pub(crate) fn q6_k_x8(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    use crate::repack::{Q6_K_X8_BYTES, Q6_K_X8_QS, Q6_K_X8_SCALES};
    let nb = cols / QK_K;
    for (g, grp) in w.chunks_exact(nb * Q6_K_X8_BYTES).enumerate() {
        for j in 0..nt {
            let (qs, d, bsums) = q8k(a, t0 + j);
            let mut sumf = [0.0f32; 8];
            for (ib, blk) in grp.chunks_exact(Q6_K_X8_BYTES).enumerate() {
                let y = &qs[ib * QK_K..ib * QK_K + QK_K];
                let bs = &bsums[ib * 16..ib * 16 + 16];
                for (r, sumf) in sumf.iter_mut().enumerate() {
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for s in 0..16 {
                        let unit = &blk[Q6_K_X8_QS + 96 * s..][..96];
                        let mut dot = 0i32;
                        for k in 0..4 {
                            for e in 0..4 {
                                let nib = unit[32 * (k / 2) + 4 * r + e];
                                let low = if k % 2 == 0 { nib & 0x0F } else { nib >> 4 };
                                let q = low | ((unit[64 + 4 * r + e] >> (2 * k)) & 3) << 4;
                                dot += q as i32 * y[16 * s + 4 * k + e] as i32;
                            }
                        }
                        let sc = blk[Q6_K_X8_SCALES + 8 * s + r] as i8 as i32;
                        isum += sc * dot;
                        msum += sc * bs[s] as i32;
                    }
                    *sumf += (read_f16(blk, 2 * r) * d[ib]) * (isum - 32 * msum) as f32;
                }
            }
            out[j * stride + 8 * g..j * stride + 8 * g + 8].copy_from_slice(&sumf);
        }
    }
}
