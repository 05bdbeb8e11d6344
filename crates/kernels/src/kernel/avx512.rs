//! AVX-512 (F, BW, VL) + VNNI row kernels.
//!
//! Legacy quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are processed two blocks (64 elements) per register.
//! Each weight pair is unpacked once to 64 signed or unsigned bytes and then dotted with every activation
//! row of the tile by `vpdpbusd` (u8 × i8 → i32). Signed weights are paired with the activations shifted
//! to unsigned (`q + 128`), and the accumulator starts at `-128 · Σw` (computed once per pair by the same
//! instruction), so the block sums are exact integers as in ggml. Per block the sum is scaled by
//! `d_w · d_x` in f32; Q4_1/Q5_1 add `Σ m · s` per row segment as one vector dot.
//!
//! K-quants (Q4_K, Q5_K, Q6_K) unpack 64 unsigned values per register; `vpmaddubsw` then `vpdpwssd` with
//! the sub-block scales accumulate the whole 256-element super-block in i32, scaled once in f32.
//! F32/F16/BF16 weights are widened to f32 and FMA'd. Q2_K/Q3_K use the scalar kernels.
//!
//! Every kernel is generic over the tile size `N` (activation rows, 1..=8) so accumulators stay in
//! registers; the per-token arithmetic does not depend on `N`, so results are identical for any tiling.

use super::{prefetch_ahead, tile, RowKernel};
use crate::blocks::k4_scales_mins;
use crate::quantize::Acts;
use gguf::GgmlType;
use std::arch::x86_64::*;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;

/// The AVX-512 row kernel for `ty`, if there is one. Only called after `Isa::Avx512.available()`.
pub(crate) fn kernel(ty: GgmlType) -> Option<RowKernel> {
    // SAFETY (all closures): the dispatcher hands these out only when the CPU has avx512f/bw/vl/vnni,
    // fma and f16c (`Isa::Avx512.available()`), and `matmul` passes consistent shapes.
    Some(match ty {
        GgmlType::Q4_0 => |w, rb, a, t0, nt, o| unsafe { tile!(legacy::<Q4_0>, nt, w, rb, a, t0, o) },
        GgmlType::Q4_1 => |w, rb, a, t0, nt, o| unsafe { tile!(legacy::<Q4_1>, nt, w, rb, a, t0, o) },
        GgmlType::Q5_0 => |w, rb, a, t0, nt, o| unsafe { tile!(legacy::<Q5_0>, nt, w, rb, a, t0, o) },
        GgmlType::Q5_1 => |w, rb, a, t0, nt, o| unsafe { tile!(legacy::<Q5_1>, nt, w, rb, a, t0, o) },
        GgmlType::Q8_0 => |w, rb, a, t0, nt, o| unsafe { tile!(legacy::<Q8_0>, nt, w, rb, a, t0, o) },
        GgmlType::Q4_K => |w, rb, a, t0, nt, o| unsafe { tile!(q4_k::<false>, nt, w, rb, a, t0, o) },
        GgmlType::Q5_K => |w, rb, a, t0, nt, o| unsafe { tile!(q4_k::<true>, nt, w, rb, a, t0, o) },
        GgmlType::Q6_K => |w, rb, a, t0, nt, o| unsafe { tile!(q6_k, nt, w, rb, a, t0, o) },
        GgmlType::F32 => |w, rb, a, t0, nt, o| unsafe { tile!(float::<0>, nt, w, rb, a, t0, o) },
        GgmlType::F16 => |w, rb, a, t0, nt, o| unsafe { tile!(float::<1>, nt, w, rb, a, t0, o) },
        GgmlType::BF16 => |w, rb, a, t0, nt, o| unsafe { tile!(float::<2>, nt, w, rb, a, t0, o) },
        _ => return None,
    })
}

const fn block_bytes(k: u8) -> usize {
    match k {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// Blocks per segment for the `Σ m · s` term of Q4_1/Q5_1.
const SEG: usize = 64;

/// Unpacks one or two consecutive legacy blocks at `p` into 64 weight bytes (block 1 zero if `!two`),
/// the scale vector `[d0 ×8, d1 ×8]` and, for Q4_1/Q5_1, the mins `(m0, m1)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn unpack_pair<const K: u8>(p: *const u8, two: bool) -> (__m512i, __m512, f32, f32) {
    let bytes = block_bytes(K);
    let has_min = K == Q4_1 || K == Q5_1;
    // Scales (and mins) through F16C: lanes [d0, m0, d1, m1] or [d0, d1, ..].
    let (dx, m0, m1) = if has_min {
        let h0 = (p as *const u32).read_unaligned();
        let h1 = if two { (p.add(bytes) as *const u32).read_unaligned() } else { 0 };
        let f = _mm_cvtph_ps(_mm_set_epi32(0, 0, h1 as i32, h0 as i32));
        let idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        let dx = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f));
        let m0 = _mm_cvtss_f32(_mm_shuffle_ps::<0b01>(f, f));
        let m1 = _mm_cvtss_f32(_mm_shuffle_ps::<0b11>(f, f));
        (dx, m0, m1)
    } else {
        let h0 = (p as *const u16).read_unaligned() as i32;
        let h1 = if two { (p.add(bytes) as *const u16).read_unaligned() as i32 } else { 0 };
        let f = _mm_cvtph_ps(_mm_cvtsi32_si128(h0 | (h1 << 16)));
        let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        (_mm512_permutexvar_ps(idx, _mm512_castps128_ps512(f)), 0.0, 0.0)
    };
    let w = if K == Q8_0 {
        let lo = _mm256_loadu_si256(p.add(2) as *const __m256i);
        let hi = if two { _mm256_loadu_si256(p.add(bytes + 2) as *const __m256i) } else { _mm256_setzero_si256() };
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    } else {
        let qs_at = match K {
            Q4_0 => 2,
            Q4_1 => 4,
            Q5_0 => 6,
            _ => 8,
        };
        let lo = _mm_loadu_si128(p.add(qs_at) as *const __m128i);
        let hi = if two { _mm_loadu_si128(p.add(bytes + qs_at) as *const __m128i) } else { _mm_setzero_si128() };
        let z = _mm512_castsi256_si512(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi));
        let z = _mm512_shuffle_i64x2::<0b01_01_00_00>(z, z);
        let z = _mm512_mask_srli_epi16::<4>(z, 0xFF00_FF00, z);
        let w = _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
        match K {
            Q4_0 => _mm512_sub_epi8(w, _mm512_set1_epi8(8)),
            Q4_1 => w,
            _ => {
                let qh_at = if K == Q5_0 { 2 } else { 4 };
                let h0 = (p.add(qh_at) as *const u32).read_unaligned() as u64;
                let h1 = if two { (p.add(bytes + qh_at) as *const u32).read_unaligned() as u64 } else { 0 };
                let high: __mmask64 = h0 | (h1 << 32);
                if K == Q5_0 {
                    _mm512_mask_sub_epi8(w, !high, w, _mm512_set1_epi8(16))
                } else {
                    _mm512_mask_add_epi8(w, high, w, _mm512_set1_epi8(16))
                }
            }
        }
    };
    (w, dx, m0, m1)
}

/// Legacy quant rows × `N` activation rows (see the module header).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn legacy<const K: u8, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let bytes = block_bytes(K);
    let signed = K == Q4_0 || K == Q5_0 || K == Q8_0;
    let has_min = !signed;
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.dexp.len() >= (t0 + N) * nb * 8);
    let zero = _mm512_setzero_si512();
    let c128 = _mm512_set1_epi8(-128);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let row = row.as_ptr();
        let mut acc = [_mm512_setzero_ps(); N];
        let mut mins = [0.0f32; SEG];
        let mut seg_start = 0;
        let mut b = 0;
        while b < nb {
            let two = b + 1 < nb;
            let (wv, dx, m0, m1) = unpack_pair::<K>(row.add(b * bytes), two);
            let init = if signed { _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, c128, wv)) } else { zero };
            if two {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let t = t0 + j;
                    let dp = if signed {
                        let y = _mm512_loadu_si512(a.qu.as_ptr().add(t * cols + b * 32) as *const _);
                        _mm512_dpbusd_epi32(init, y, wv)
                    } else {
                        let y = _mm512_loadu_si512(a.qs.as_ptr().add(t * cols + b * 32) as *const _);
                        _mm512_dpbusd_epi32(zero, wv, y)
                    };
                    let dy = _mm512_loadu_ps(a.dexp.as_ptr().add((t * nb + b) * 8));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dx, dy), *acc);
                }
            } else {
                for (j, acc) in acc.iter_mut().enumerate() {
                    let t = t0 + j;
                    let dp = if signed {
                        let y = _mm512_maskz_loadu_epi8(0xFFFF_FFFF, a.qu.as_ptr().add(t * cols + b * 32) as *const i8);
                        _mm512_dpbusd_epi32(init, y, wv)
                    } else {
                        let y = _mm512_maskz_loadu_epi8(0xFFFF_FFFF, a.qs.as_ptr().add(t * cols + b * 32));
                        _mm512_dpbusd_epi32(zero, wv, y)
                    };
                    let dy = _mm512_maskz_loadu_ps(0x00FF, a.dexp.as_ptr().add((t * nb + b) * 8));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dx, dy), *acc);
                }
            }
            if has_min {
                mins[b - seg_start] = m0;
                if two {
                    mins[b + 1 - seg_start] = m1;
                }
            }
            b += 2;
            let b_end = b.min(nb);
            if has_min && (b_end - seg_start == SEG || b_end == nb) {
                let len = b_end - seg_start;
                let mut i = 0;
                while i < len {
                    let mask: __mmask16 = if len - i >= 16 { 0xFFFF } else { (1u16 << (len - i)) - 1 };
                    let mv = _mm512_maskz_loadu_ps(mask, mins.as_ptr().add(i));
                    for (j, acc) in acc.iter_mut().enumerate() {
                        let s = _mm512_maskz_loadu_ps(mask, a.s.as_ptr().add((t0 + j) * nb + seg_start + i));
                        *acc = _mm512_fmadd_ps(mv, s, *acc);
                    }
                    i += 16;
                }
                seg_start = b_end;
            }
        }
        for j in 0..N {
            out[r * N + j] = _mm512_reduce_add_ps(acc[j]);
        }
    }
}

/// Q4_K (or Q5_K when `FIVE`) rows × `N` activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4_k<const FIVE: bool, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let bytes = if FIVE { 176 } else { 144 };
    let qs_at = if FIVE { 48 } else { 16 };
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.bsums.len() >= (t0 + N) * nb * 16);
    let low4 = _mm512_set1_epi8(0x0F);
    // vpermw indices: chunk k takes scale 2k for its first 16 i16 lanes and 2k+1 for the last 16.
    let idx: [__m512i; 4] = core::array::from_fn(|k| {
        _mm512_mask_set1_epi16(_mm512_set1_epi16(2 * k as i16), 0xFFFF_0000, 2 * k as i16 + 1)
    });
    let min_idx = _mm256_set_epi16(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let mut acc = [_mm512_setzero_ps(); N];
        for ib in 0..nb {
            let blk = &row[ib * bytes..(ib + 1) * bytes];
            let p = blk.as_ptr();
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32));
            let d = _mm_cvtss_f32(dm);
            let dmin = _mm_cvtss_f32(_mm_shuffle_ps::<0b01>(dm, dm));
            let (sc, mn) = k4_scales_mins(&blk[4..16]);
            let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let mn16 = _mm256_permutexvar_epi16(
                min_idx,
                _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64))),
            );
            let qh = if FIVE {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(16) as *const __m256i))
            } else {
                _mm512_setzero_si512()
            };
            let mut wq = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                let q = _mm256_loadu_si256(p.add(qs_at + 32 * k) as *const __m256i);
                let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q), q);
                let z = _mm512_mask_srli_epi16::<4>(z, 0xFFFF_0000, z);
                let mut v = _mm512_and_si512(z, low4);
                if FIVE {
                    let bits =
                        _mm512_mask_set1_epi8(_mm512_set1_epi8(1 << (2 * k)), 0xFFFF_FFFF_0000_0000, 2 << (2 * k));
                    let high = _mm512_test_epi8_mask(qh, bits);
                    v = _mm512_mask_add_epi8(v, high, v, _mm512_set1_epi8(16));
                }
                wq[k] = v;
                scv[k] = _mm512_permutexvar_epi16(idx[k], sc16);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = a.qs.as_ptr().add(t * cols + ib * 256);
                let mut isum = _mm512_setzero_si512();
                for k in 0..4 {
                    let yk = _mm512_loadu_si512(y.add(64 * k) as *const _);
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wq[k], yk), scv[k]);
                }
                let bs = _mm256_loadu_si256(a.bsums.as_ptr().add((t * nb + ib) * 16) as *const __m256i);
                let msum = _mm512_zextsi256_si512(_mm256_madd_epi16(mn16, bs));
                let dy = *a.d.get_unchecked(t * nb + ib);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dy * d), *acc);
                *acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_set1_ps(dy * dmin), *acc);
            }
        }
        for j in 0..N {
            out[r * N + j] = _mm512_reduce_add_ps(acc[j]);
        }
    }
}

/// Q6_K rows × `N` activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q6_k<const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.bsums.len() >= (t0 + N) * nb * 16);
    let low4 = _mm512_set1_epi8(0x0F);
    let low2 = _mm512_set1_epi8(0x03);
    // Chunk c (64 elements) uses scales 4c .. 4c+3, one per 8 i16 lanes after vpmaddubsw.
    let idx: [__m512i; 4] = core::array::from_fn(|c| {
        let c = 4 * c as i16;
        _mm512_set_epi16(
            c + 3,
            c + 3,
            c + 3,
            c + 3,
            c + 3,
            c + 3,
            c + 3,
            c + 3,
            c + 2,
            c + 2,
            c + 2,
            c + 2,
            c + 2,
            c + 2,
            c + 2,
            c + 2,
            c + 1,
            c + 1,
            c + 1,
            c + 1,
            c + 1,
            c + 1,
            c + 1,
            c + 1,
            c,
            c,
            c,
            c,
            c,
            c,
            c,
            c,
        )
    });
    // qh shifts: part a takes bit pairs 0 and 2 (first / second 32 elements), part b pairs 4 and 6.
    let shift_a = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF_0000, 2);
    let shift_b = _mm512_mask_set1_epi16(_mm512_set1_epi16(4), 0xFFFF_0000, 6);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let mut acc = [_mm512_setzero_ps(); N];
        for ib in 0..nb {
            let p = row[ib * 210..(ib + 1) * 210].as_ptr();
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p.add(208) as *const u16).read_unaligned() as i32)));
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            let mut wq = [_mm512_setzero_si512(); 4];
            let mut scv = [_mm512_setzero_si512(); 4];
            for n in 0..2 {
                let ql = _mm512_loadu_si512(p.add(64 * n) as *const _);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i));
                let ha = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_a), low2);
                let hb = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_b), low2);
                wq[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16::<4>(ha));
                wq[2 * n + 1] =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low4), _mm512_slli_epi16::<4>(hb));
            }
            for c in 0..4 {
                scv[c] = _mm512_permutexvar_epi16(idx[c], _mm512_castsi256_si512(sc16));
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = a.qs.as_ptr().add(t * cols + ib * 256);
                let mut isum = _mm512_setzero_si512();
                for c in 0..4 {
                    let yc = _mm512_loadu_si512(y.add(64 * c) as *const _);
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wq[c], yc), scv[c]);
                }
                // The stored values are q + 32: subtract 32 · Σ scale · (sum of 16 activations).
                let bs = _mm256_loadu_si256(a.bsums.as_ptr().add((t * nb + ib) * 16) as *const __m256i);
                let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bs));
                isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(corr));
                let dy = *a.d.get_unchecked(t * nb + ib);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dy * d), *acc);
            }
        }
        for j in 0..N {
            out[r * N + j] = _mm512_reduce_add_ps(acc[j]);
        }
    }
}

/// F32 (`K = 0`), F16 (`K = 1`) or BF16 (`K = 2`) rows × `N` activation rows (f32 FMA).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn float<const K: u8, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let cols = a.cols;
    debug_assert!(a.f.len() >= (t0 + N) * cols);
    let elem = if K == 0 { 4 } else { 2 };
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let p = row.as_ptr();
        let mut acc = [_mm512_setzero_ps(); N];
        let mut c = 0;
        while c < cols {
            let mask: __mmask16 = if cols - c >= 16 { 0xFFFF } else { (1u16 << (cols - c)) - 1 };
            let wv = match K {
                0 => _mm512_maskz_loadu_ps(mask, p.add(c * elem) as *const f32),
                1 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p.add(c * elem) as *const i16)),
                _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                    mask,
                    p.add(c * elem) as *const i16,
                )))),
            };
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_maskz_loadu_ps(mask, a.f.as_ptr().add((t0 + j) * cols + c));
                *acc = _mm512_fmadd_ps(wv, x, *acc);
            }
            c += 16;
        }
        for j in 0..N {
            out[r * N + j] = _mm512_reduce_add_ps(acc[j]);
        }
    }
}

/// The interleaved Q4_0 (`MIN = false`) or Q4_1 kernel ([`crate::repack::interleave8`]) with VNNI. Only called
/// after `Isa::Avx512.available()`.
pub(crate) fn q4_x8_kernel<const MIN: bool, const FIVE: bool>() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx512f/bw/vl/vnni, fma and f16c; `q4_x8` checks the shapes it
    // reads.
    |w, cols, a, t0, nt, o, stride| unsafe { q4_x8::<MIN, FIVE>(w, cols, a, t0, nt, o, stride) }
}

/// Q4_0/Q4_1 (or Q5_0 when `FIVE`) weights interleaved by 8 rows × `nt` activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q4_x8<const MIN: bool, const FIVE: bool>(
    w: &[u8],
    cols: usize,
    a: &Acts,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
) {
    let nb = cols / 32;
    assert!(a.nb == nb && a.cols == cols);
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb && a.s.len() >= (t0 + nt) * nb);
    let group_bytes = nb * crate::repack::x8_nibble_layout(MIN, FIVE).0;
    for_group_pairs(w, group_bytes, nt, out, stride, |grp, second, j, n, o| {
        tile!(q4_x16_tokens::<MIN, FIVE>, n, grp, second, a, t0 + j, o, stride)
    });
}

/// Walks `w`'s groups of 8 interleaved rows (`group_bytes` each) two at a time: `pair(grp, second, j, n, out)` for
/// each pair and tile of `n ≤ TILE` activation rows from `j`, where the pair's second group is `second` bytes after
/// the first (`0` for an odd last group: the kernel then reads it twice and writes 8 results, not 16).
#[inline(always)]
unsafe fn for_group_pairs(
    w: &[u8],
    group_bytes: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
    mut pair: impl FnMut(*const u8, usize, usize, usize, *mut f32),
) {
    let groups = w.len() / group_bytes;
    assert!(w.len() % group_bytes == 0 && nt >= 1 && out.len() >= (nt - 1) * stride + 8 * groups);
    for g in (0..groups).step_by(2) {
        let grp = w.as_ptr().add(g * group_bytes);
        let second = if g + 1 < groups { group_bytes } else { 0 };
        let mut j = 0;
        while j < nt {
            let n = (nt - j).min(super::TILE);
            pair(grp, second, j, n, out.as_mut_ptr().add(j * stride + 8 * g));
            j += n;
        }
    }
}

/// Stores the `G` rows' 16 results at `out + j * stride`, or only the first 8 of each for a lone group
/// (`second == 0`, see [`for_group_pairs`]).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store_pair_rows<const G: usize>(acc: &[__m512; G], second: usize, out: *mut f32, stride: usize) {
    let mask: __mmask16 = if second == 0 { 0x00FF } else { 0xFFFF };
    for (j, acc) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(out.add(j * stride), mask, *acc);
    }
}

/// The 16 values at `b0 + off` (8 f16) and `b1 + off` (8 f16) as floats: two interleaved groups' scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[inline]
pub(super) unsafe fn pair_f16(b0: *const u8, b1: *const u8, off: usize) -> __m512 {
    let lo = _mm_loadu_si128(b0.add(off) as *const __m128i);
    let hi = _mm_loadu_si128(b1.add(off) as *const __m128i);
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
}

/// Register `off` of group `b0` and the same register of group `b1` side by side: 16 rows' 4 values each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn pair_reg(b0: *const u8, b1: *const u8, off: usize) -> __m512i {
    let lo = _mm256_loadu_si256(b0.add(off) as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), _mm256_loadu_si256(b1.add(off) as *const __m256i))
}

/// Two groups of 8 interleaved Q4_0/Q4_1/Q5_0 rows (`grp` and `grp + second`; see [`for_group_pairs`]) ×
/// activation rows `t..t+G`, written to `out[j * stride + 0..16]`.
///
/// Per block and register `i` (values `4i..4i+4` and `16+4i..` of the 16 rows): the nibbles are unpacked once
/// (Q5_0: plus 16 where the fifth bit is set, one masked byte add per nibble half with the two groups' 32-bit masks
/// as one 64-bit mask), and per activation row two `vpdpbusd` (unsigned values × the row's 4 signed values
/// broadcast to every lane) add into the 16 rows' i32 block sums — no i16 stage. Then, as the AVX2 kernel (same
/// integers, same float operations, so the same results): `d_w·d_x·sum + c_w·s_x` with `c_w = m_w` (Q4_1),
/// `-8·d_w` (Q4_0) or `-16·d_w` (Q5_0) and `s_x = d_x·Σx`. With few activation rows the low and high nibbles add
/// into separate sums (shorter chains). Two groups per 512-bit register halve the instructions per weight row of
/// one group per 256-bit register.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn q4_x16_tokens<const MIN: bool, const FIVE: bool, const G: usize>(
    grp: *const u8,
    second: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nb, cols) = (a.nb, a.cols);
    let (xb, regs) = crate::repack::x8_nibble_layout(MIN, FIVE);
    let split = G <= 4;
    let low4 = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(16);
    let offset = _mm512_set1_ps(if FIVE { -16.0 } else { -8.0 });
    let y0 = a.qs.as_ptr().add(t * cols);
    let (d0, s0) = (a.d.as_ptr().add(t * nb), a.s.as_ptr().add(t * nb));
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        let (b0, b1) = (grp.add(b * xb), grp.add(second + b * xb));
        prefetch_ahead(b0, xb);
        prefetch_ahead(b1, xb);
        let mut lo_sum = [_mm512_setzero_si512(); G];
        let mut hi_sum = [_mm512_setzero_si512(); G];
        for i in 0..4 {
            let p = pair_reg(b0, b1, regs + 32 * i);
            let mut lo = _mm512_and_si512(p, low4);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(p), low4);
            if FIVE {
                // The two groups' masks of this register: the first group's bytes are the low 256 bits.
                let mask = |half: usize| {
                    let at = crate::repack::Q5_0_X8_QH + 8 * i + half;
                    let m0 = (b0.add(at) as *const u32).read_unaligned() as u64;
                    _cvtu64_mask64(m0 | ((b1.add(at) as *const u32).read_unaligned() as u64) << 32)
                };
                lo = _mm512_mask_add_epi8(lo, mask(0), lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, mask(4), hi, sixteen);
            }
            dot_tokens(lo, hi, y0.add(32 * b + 4 * i), cols, split, &mut lo_sum, &mut hi_sum);
        }
        let dw = pair_f16(b0, b1, 0);
        let cw = if MIN { pair_f16(b0, b1, 16) } else { _mm512_mul_ps(dw, offset) };
        for (j, acc) in acc.iter_mut().enumerate() {
            let isum = if split { _mm512_add_epi32(lo_sum[j], hi_sum[j]) } else { lo_sum[j] };
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d0.add(j * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
            *acc = _mm512_fmadd_ps(cw, _mm512_set1_ps(*s0.add(j * nb + b)), *acc);
        }
    }
    store_pair_rows(&acc, second, out, stride);
}

/// For each activation row `j < G`: the 16 rows' unsigned values `lo` (4 per row) times the row's 4 signed values at
/// `y + j * cols`, and `hi` times the 4 at 16 further, `vpdpbusd`'d into `lo_sum[j]` and `hi_sum[j]` (both into
/// `lo_sum[j]` unless `split`: with few rows, two shorter chains).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot_tokens<const G: usize>(
    lo: __m512i,
    hi: __m512i,
    y: *const i8,
    cols: usize,
    split: bool,
    lo_sum: &mut [__m512i; G],
    hi_sum: &mut [__m512i; G],
) {
    for j in 0..G {
        let yj = y.add(j * cols);
        let ylo = _mm512_set1_epi32((yj as *const i32).read_unaligned());
        let yhi = _mm512_set1_epi32((yj.add(16) as *const i32).read_unaligned());
        lo_sum[j] = _mm512_dpbusd_epi32(lo_sum[j], lo, ylo);
        if split {
            hi_sum[j] = _mm512_dpbusd_epi32(hi_sum[j], hi, yhi);
        } else {
            lo_sum[j] = _mm512_dpbusd_epi32(lo_sum[j], hi, yhi);
        }
    }
}

/// The interleaved Q4_K (or, `SIX`, Q6_K) kernel ([`crate::repack::interleave8`]) with VNNI. Only called after
/// `Isa::Avx512.available()`.
pub(crate) fn k_x8_kernel<const SIX: bool>() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx512f/bw/vl/vnni, fma and f16c; `k_x8` checks the shapes it
    // reads.
    |w, cols, a, t0, nt, o, stride| unsafe { k_x8::<SIX>(w, cols, a, t0, nt, o, stride) }
}

/// Q4_K (or, `SIX`, Q6_K) weights interleaved by 8 rows × `nt` activation rows (Q8_K).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn k_x8<const SIX: bool>(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    let nb = cols / 256;
    assert!(a.nb == nb && a.cols == cols);
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb && a.bsums.len() >= (t0 + nt) * nb * 16);
    let xb = if SIX { crate::repack::Q6_K_X8_BYTES } else { crate::repack::Q4_K_X8_BYTES };
    for_group_pairs(w, nb * xb, nt, out, stride, |grp, second, j, n, o| {
        if SIX {
            tile!(q6_k_x16_tokens, n, grp, second, a, t0 + j, o, stride)
        } else {
            tile!(q4_k_x16_tokens, n, grp, second, a, t0 + j, o, stride)
        }
    });
}

/// The 8 bytes at `b0 + off` and the 8 at `b1 + off` (two interleaved groups' per-row bytes) as 16 i32 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn pair_u8_epi32(b0: *const u8, b1: *const u8, off: usize) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64(b0.add(off) as *const __m128i),
        _mm_loadl_epi64(b1.add(off) as *const __m128i),
    ))
}

/// Two groups of 8 interleaved Q4_K rows (`grp` and `grp + second`; see [`for_group_pairs`]) × activation rows
/// `t..t+G`, written to `out[j * stride + 0..16]`.
///
/// Per sub-block: 8 registers of nibbles (4 values of each of the 16 rows), each `vpdpbusd`'d with the
/// activation's 4 values broadcast into the rows' i32 sub-block sums, which are multiplied by the rows' 6-bit
/// scales (`vpmulld`) and added up; the mins term is one `vpdpwssd` per sub-block of the rows' mins (in both i16
/// halves of a lane) with the activation's pair of 16-value sums. Per super-block `d_x·(d_w·Σ sc·dot −
/// dmin_w·Σ m·bsum)` in two FMAs. Two groups per 512-bit register: half the instructions per weight row of the
/// 256-bit kernel this replaced (session 58).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn q4_k_x16_tokens<const G: usize>(
    grp: *const u8,
    second: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    use crate::repack::{Q4_K_X8_BYTES, Q4_K_X8_MINS, Q4_K_X8_QS, Q4_K_X8_SCALES};
    let (nb, cols) = (a.nb, a.cols);
    let low4 = _mm512_set1_epi8(0x0F);
    let y0 = a.qs.as_ptr().add(t * cols);
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        let (b0, b1) = (grp.add(b * Q4_K_X8_BYTES), grp.add(second + b * Q4_K_X8_BYTES));
        let mut isum = [_mm512_setzero_si512(); G];
        for sb in 0..8 {
            let q = Q4_K_X8_QS + 256 * (sb / 2);
            if sb % 2 == 0 {
                prefetch_ahead(b0.add(q), 256);
                prefetch_ahead(b1.add(q), 256);
            }
            let mut sub = [_mm512_setzero_si512(); G];
            for i in 0..8 {
                let p = pair_reg(b0, b1, q + 32 * i);
                let v = if sb % 2 == 0 {
                    _mm512_and_si512(p, low4)
                } else {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(p), low4)
                };
                for (j, sub) in sub.iter_mut().enumerate() {
                    let y = y0.add(j * cols + 256 * b + 32 * sb + 4 * i);
                    *sub = _mm512_dpbusd_epi32(*sub, v, _mm512_set1_epi32((y as *const i32).read_unaligned()));
                }
            }
            let sc = pair_u8_epi32(b0, b1, Q4_K_X8_SCALES + 8 * sb);
            for (j, isum) in isum.iter_mut().enumerate() {
                *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(sub[j], sc));
            }
        }
        let mut msum = [_mm512_setzero_si512(); G];
        for sb in 0..8 {
            let m = pair_u8_epi32(b0, b1, Q4_K_X8_MINS + 8 * sb);
            let m = _mm512_or_si512(m, _mm512_slli_epi32::<16>(m));
            for (j, msum) in msum.iter_mut().enumerate() {
                let bs = a.bsums.as_ptr().add(((t + j) * nb + b) * 16 + 2 * sb);
                *msum = _mm512_dpwssd_epi32(*msum, m, _mm512_set1_epi32((bs as *const i32).read_unaligned()));
            }
        }
        let (dw, dmin) = (pair_f16(b0, b1, 0), pair_f16(b0, b1, 16));
        for (j, acc) in acc.iter_mut().enumerate() {
            let dy = _mm512_set1_ps(*a.d.get_unchecked((t + j) * nb + b));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dw, dy), *acc);
            *acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[j]), _mm512_mul_ps(dmin, dy), *acc);
        }
    }
    store_pair_rows(&acc, second, out, stride);
}

/// Two groups of 8 interleaved Q6_K rows (`grp` and `grp + second`; see [`for_group_pairs`]) × activation rows
/// `t..t+G`, written to `out[j * stride + 0..16]`.
///
/// Per sub-block (one unit of [`crate::repack::Q6_K_X8_QS`]): the two nibble registers and the register of high bit
/// pairs decode into four registers of 4 unsigned values (`q` in 0..64) × 16 rows, each `vpdpbusd`'d with the
/// activation's 4 values broadcast into the rows' i32 sub-block sums, which are multiplied by the rows' scales
/// (`vpmulld`) and added up. The offset term `32·Σ sc·bsum` is one `vpdpwssd` per pair of sub-blocks of the rows'
/// scale pairs with the activation's pair of 16-value sums. Per super-block `d_w·d_x·(isum − 32·msum)` in one FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn q6_k_x16_tokens<const G: usize>(
    grp: *const u8,
    second: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    use crate::repack::{Q6_K_X8_BYTES, Q6_K_X8_QS, Q6_K_X8_SCALES};
    let (nb, cols) = (a.nb, a.cols);
    let low4 = _mm512_set1_epi8(0x0F);
    let top2 = _mm512_set1_epi8(0x30);
    let y0 = a.qs.as_ptr().add(t * cols);
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        let (b0, b1) = (grp.add(b * Q6_K_X8_BYTES), grp.add(second + b * Q6_K_X8_BYTES));
        let mut isum = [_mm512_setzero_si512(); G];
        for s in 0..16 {
            let unit = Q6_K_X8_QS + 96 * s;
            if s % 2 == 0 {
                prefetch_ahead(b0.add(unit), 192);
                prefetch_ahead(b1.add(unit), 192);
            }
            let (n0, n1, h) = (pair_reg(b0, b1, unit), pair_reg(b0, b1, unit + 32), pair_reg(b0, b1, unit + 64));
            // 16-bit shifts: the bits a shift carries across a byte boundary land outside 0x30 and are masked off.
            let v = [
                _mm512_or_si512(_mm512_and_si512(n0, low4), _mm512_and_si512(_mm512_slli_epi16::<4>(h), top2)),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(n0), low4),
                    _mm512_and_si512(_mm512_slli_epi16::<2>(h), top2),
                ),
                _mm512_or_si512(_mm512_and_si512(n1, low4), _mm512_and_si512(h, top2)),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(n1), low4),
                    _mm512_and_si512(_mm512_srli_epi16::<2>(h), top2),
                ),
            ];
            let sc8 = _mm_unpacklo_epi64(
                _mm_loadl_epi64(b0.add(Q6_K_X8_SCALES + 8 * s) as *const __m128i),
                _mm_loadl_epi64(b1.add(Q6_K_X8_SCALES + 8 * s) as *const __m128i),
            );
            let sc = _mm512_cvtepi8_epi32(sc8);
            for (j, isum) in isum.iter_mut().enumerate() {
                let y = y0.add(j * cols + 256 * b + 16 * s);
                let mut sub = _mm512_setzero_si512();
                for (k, v) in v.iter().enumerate() {
                    sub =
                        _mm512_dpbusd_epi32(sub, *v, _mm512_set1_epi32((y.add(4 * k) as *const i32).read_unaligned()));
                }
                *isum = _mm512_add_epi32(*isum, _mm512_mullo_epi32(sub, sc));
            }
        }
        let mut msum = [_mm512_setzero_si512(); G];
        for k in 0..8 {
            // Row r's scales of sub-blocks 2k and 2k + 1 side by side, as i16, for both groups.
            let pairs = |p: *const u8| {
                let at = p.add(Q6_K_X8_SCALES + 16 * k);
                _mm_unpacklo_epi8(_mm_loadl_epi64(at as *const __m128i), _mm_loadl_epi64(at.add(8) as *const __m128i))
            };
            let scp = _mm512_cvtepi8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(pairs(b0)), pairs(b1)));
            for (j, msum) in msum.iter_mut().enumerate() {
                let bs = a.bsums.as_ptr().add(((t + j) * nb + b) * 16 + 2 * k);
                *msum = _mm512_dpwssd_epi32(*msum, scp, _mm512_set1_epi32((bs as *const i32).read_unaligned()));
            }
        }
        let dw = pair_f16(b0, b1, 0);
        for (j, acc) in acc.iter_mut().enumerate() {
            let total = _mm512_sub_epi32(isum[j], _mm512_slli_epi32::<5>(msum[j]));
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.get_unchecked((t + j) * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, *acc);
        }
    }
    store_pair_rows(&acc, second, out, stride);
}

/// The interleaved Q8_0 kernel ([`crate::repack::interleave8`]) with VNNI. Only called after
/// `Isa::Avx512.available()`.
pub(crate) fn q8_x8_kernel() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx512f/bw/vl/vnni, fma and f16c; `q8_x8` checks the shapes it
    // reads.
    |w, cols, a, t0, nt, o, stride| unsafe { q8_x8(w, cols, a, t0, nt, o, stride) }
}

/// Q8_0 weights interleaved by 8 rows × `nt` activation rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn q8_x8(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    let nb = cols / 32;
    assert!(a.nb == nb && a.cols == cols);
    assert!(a.qu.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb);
    let group_bytes = nb * crate::repack::Q8_0_X8_BYTES;
    for_group_pairs(w, group_bytes, nt, out, stride, |grp, second, j, n, o| {
        tile!(q8_x16_tokens, n, grp, second, a, t0 + j, o, stride)
    });
}

/// Two groups of 8 interleaved Q8_0 rows (`grp` and `grp + second`) × activation rows `t..t+G`, written to
/// `out[j * stride + 0..16]`.
///
/// Per block: the rows' sums start at their stored `-128 · Σq`; per register `i` (values `4i..4i+4` of the 16
/// rows) and activation row, one `vpdpbusd` of the row's 4 values as unsigned `y + 128` (broadcast) with the
/// signed weights; then `d_w·d_x·sum` in one FMA, as [`super::scalar::q8_x8`]'s integers and float operations.
/// With few activation rows the even and odd registers add into separate sums (shorter chains).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn q8_x16_tokens<const G: usize>(
    grp: *const u8,
    second: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    use crate::repack::{Q8_0_X8_BYTES, Q8_0_X8_OFFSETS, Q8_0_X8_QS};
    let (nb, cols) = (a.nb, a.cols);
    let split = G <= 4;
    let y0 = a.qu.as_ptr().add(t * cols);
    let d0 = a.d.as_ptr().add(t * nb);
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        let (b0, b1) = (grp.add(b * Q8_0_X8_BYTES), grp.add(second + b * Q8_0_X8_BYTES));
        prefetch_ahead(b0, Q8_0_X8_BYTES);
        prefetch_ahead(b1, Q8_0_X8_BYTES);
        let init = pair_reg(b0, b1, Q8_0_X8_OFFSETS);
        let mut even = [init; G];
        let mut odd = [_mm512_setzero_si512(); G];
        for i in 0..8 {
            let wv = pair_reg(b0, b1, Q8_0_X8_QS + 32 * i);
            for j in 0..G {
                let y = _mm512_set1_epi32((y0.add(j * cols + 32 * b + 4 * i) as *const i32).read_unaligned());
                if split && i % 2 == 1 {
                    odd[j] = _mm512_dpbusd_epi32(odd[j], y, wv);
                } else {
                    even[j] = _mm512_dpbusd_epi32(even[j], y, wv);
                }
            }
        }
        let dw = pair_f16(b0, b1, 0);
        for (j, acc) in acc.iter_mut().enumerate() {
            let sum = if split { _mm512_add_epi32(even[j], odd[j]) } else { even[j] };
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d0.add(j * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *acc);
        }
    }
    store_pair_rows(&acc, second, out, stride);
}

/// Value register `J` of the head screen's interleaved block, as [`super::avx2::screen_values`] on all 16 rows.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn screen_values<const J: usize>(nib: __m512i, high: __m512i) -> __m512i {
    let low = if J < 4 { nib } else { _mm512_srli_epi16::<4>(nib) };
    let h = match J % 4 {
        0 => _mm512_slli_epi16::<4>(high),
        1 => _mm512_slli_epi16::<2>(high),
        2 => high,
        _ => _mm512_srli_epi16::<2>(high),
    };
    _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(0x0F)), _mm512_and_si512(h, _mm512_set1_epi8(0x30)))
}

/// One group of the head screen's 16 interleaved rows ([`crate::screen`]) × activation rows `t..t+G` with VNNI,
/// written to `out[j * stride + 0..16]`: per block, each of the 8 value registers is unpacked once and
/// `vpdpbusd`'d (unsigned 6-bit values × the row's 4 signed values broadcast) into the rows' i32 sums, which
/// start at `Acts::zb`; then one conversion and one FMA with `d_w·d_x` per activation row — no horizontal sums.
/// With few activation rows the low and high value registers add into separate sums (shorter chains).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn screen6_tokens<const G: usize>(grp: *const u8, a: &Acts, t: usize, out: *mut f32, stride: usize) {
    use crate::screen::{BLOCK_BYTES, HIGH, NIBBLES};
    let (nb, cols) = (a.nb, a.cols);
    let split = G <= 4;
    let y0 = a.qs.as_ptr().add(t * cols);
    let (d0, z0) = (a.d.as_ptr().add(t * nb), a.zb.as_ptr().add(t * nb));
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..nb {
        let blk = grp.add(b * BLOCK_BYTES);
        prefetch_ahead(blk, BLOCK_BYTES);
        let h0 = _mm512_loadu_si512(blk.add(HIGH) as *const _);
        let h1 = _mm512_loadu_si512(blk.add(HIGH + 64) as *const _);
        let mut lo_sum = [_mm512_setzero_si512(); G];
        let mut hi_sum = [_mm512_setzero_si512(); G];
        for (j, s) in lo_sum.iter_mut().enumerate() {
            *s = _mm512_set1_epi32(*z0.add(j * nb + b));
        }
        macro_rules! step {
            ($i:literal) => {{
                let nib = _mm512_loadu_si512(blk.add(NIBBLES + 64 * $i) as *const _);
                let (lo, hi) = (screen_values::<$i>(nib, h0), screen_values::<{ 4 + $i }>(nib, h1));
                dot_tokens(lo, hi, y0.add(32 * b + 4 * $i), cols, split, &mut lo_sum, &mut hi_sum);
            }};
        }
        step!(0);
        step!(1);
        step!(2);
        step!(3);
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
        for (j, acc) in acc.iter_mut().enumerate() {
            let isum = if split { _mm512_add_epi32(lo_sum[j], hi_sum[j]) } else { lo_sum[j] };
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d0.add(j * nb + b)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *acc);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(j * stride), *acc);
    }
}

/// The VNNI head screen kernel ([`crate::screen`]) as a group kernel. Only called after
/// `Isa::Avx512.available()`.
pub(crate) fn screen6_kernel() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx512f/bw/vl/vnni, fma and f16c; `for_screen_groups` checks the
    // shapes.
    |w, cols, a, t0, nt, o, stride| unsafe {
        super::avx2::for_screen_groups(w, cols, a, t0, nt, o, stride, |grp, t, n, o| {
            tile!(screen6_tokens, n, grp, a, t, o, stride)
        })
    }
}

/// The head screen's survivor filter on one tile of `nt = floors.len()` activation rows × 16 weight rows
/// (`crate::screen::ShareFilter`): per activation row `j` (screened logits `buf[16j..16j + 16]`, bounds `c`,
/// `norms[j]`), `lanes[j] = max(a − c·norm, lanes[j])` lane by lane (`vmaxps` keeps `lanes` where the lower
/// bound is NaN, as the portable filter does); where some upper bound `a + c·norm` is not below `floors[j]` (NaN
/// included), `floors[j]` is raised to the lanes' maximum and `masks[j]` gets the rows whose upper bound is not
/// below it (0 elsewhere). Returns whether any mask is set. The same float operations as the portable filter.
///
/// # Safety
/// The CPU must have avx512f; `buf` holds `16 · nt` values and `norms`, `lanes`, `masks` at least `nt` entries.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn screen_filter_tile(
    buf: &[f32],
    c: &[f32; 16],
    norms: &[f32],
    lanes: &mut [[f32; 16]],
    floors: &mut [f32],
    masks: &mut [u16],
) -> bool {
    let nt = floors.len();
    assert!(buf.len() >= 16 * nt && norms.len() >= nt && lanes.len() >= nt && masks.len() >= nt);
    let c = _mm512_loadu_ps(c.as_ptr());
    let mut any = false;
    for j in 0..nt {
        let a = _mm512_loadu_ps(buf.as_ptr().add(16 * j));
        let cn = _mm512_mul_ps(c, _mm512_set1_ps(*norms.get_unchecked(j)));
        let lj = lanes.get_unchecked_mut(j).as_mut_ptr();
        let l = _mm512_max_ps(_mm512_sub_ps(a, cn), _mm512_loadu_ps(lj));
        _mm512_storeu_ps(lj, l);
        let high = _mm512_add_ps(a, cn);
        let floor = floors.get_unchecked_mut(j);
        let mut m = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(high, _mm512_set1_ps(*floor));
        if m != 0 {
            let top = _mm512_reduce_max_ps(l);
            *floor = if top > *floor { top } else { *floor };
            m = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(high, _mm512_set1_ps(*floor));
            any |= m != 0;
        }
        *masks.get_unchecked_mut(j) = m;
    }
    any
}
