//! AVX2 + FMA + F16C row kernels (no VNNI: `vpmaddubsw` u8 × i8 → i16 pairs, `vpmaddwd` → i32).
//!
//! Legacy quants, one 32-element block per register: weights are unpacked once per block to unsigned
//! bytes (Q4_x nibbles, Q5_x five-bit values) and dotted with every activation row of the tile; Q8_0 uses
//! ggml's sign trick (`|w|` × `sign(y, w)`). Each block sum is scaled by `d_w · d_x` in f32. The offset
//! terms (`-8·d·Σy` for Q4_0, `-16·d·Σy` for Q5_0, `m · s` for Q4_1/Q5_1) are added per row segment as
//! one vector dot of per-block weight coefficients with the activations' per-block `s`.
//!
//! K-quants (Q4_K, Q5_K, Q6_K): 32 unsigned values per register, `vpmaddubsw` then `vpmaddwd` with the
//! 16-bit sub-block scales accumulate a super-block in i32, scaled once in f32.
//! F32/F16/BF16 weights are widened to f32 and FMA'd. Q2_K/Q3_K use the scalar kernels.
//!
//! Matrices interleaved by 8 rows ([`crate::repack::interleave8`]: Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) have group
//! kernels: one 256-bit register holds 4 values of each of the 8 rows, so a block's 8 row sums come out in the 8
//! lanes with no horizontal sums, and the unpacking (nibbles, Q5_0's fifth bits, Q6_K's high bit pairs) is done
//! once for up to 4 activation rows.

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

/// The AVX2 row kernel for `ty`, if there is one. Only called after `Isa::Avx2.available()`.
pub(crate) fn kernel(ty: GgmlType) -> Option<RowKernel> {
    // SAFETY (all closures): handed out only when the CPU has avx2, fma and f16c
    // (`Isa::Avx2.available()`), and `matmul` passes consistent shapes.
    Some(match ty {
        GgmlType::Q4_0 => |w, rb, a, t0, nt, o| unsafe { tile!(pairs::<Q4_0>, nt, w, rb, a, t0, o) },
        GgmlType::Q4_1 => |w, rb, a, t0, nt, o| unsafe { tile!(pairs::<Q4_1>, nt, w, rb, a, t0, o) },
        GgmlType::Q5_0 => |w, rb, a, t0, nt, o| unsafe { tile!(pairs::<Q5_0>, nt, w, rb, a, t0, o) },
        GgmlType::Q5_1 => |w, rb, a, t0, nt, o| unsafe { tile!(pairs::<Q5_1>, nt, w, rb, a, t0, o) },
        GgmlType::Q8_0 => |w, rb, a, t0, nt, o| unsafe { tile!(q8_0, nt, w, rb, a, t0, o) },
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

/// Blocks per segment for the per-block offset term.
const SEG: usize = 64;

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `out[j] = hsum(acc[j])` for every `j < N`, bit-identical to [`hsum`] (the same association
/// `((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7))`); for a full tile of 8 the sums are formed in a transposed
/// tree (21 vector operations and one store instead of eight separate reductions).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn hsums<const N: usize>(acc: &[__m256; N], out: &mut [f32]) {
    if N != 8 {
        for j in 0..N {
            out[j] = hsum(acc[j]);
        }
        return;
    }
    // [x0+x4, x1+x5, x2+x6, x3+x7 | y0+y4, ...] for the pairs (x, y) = (acc[2i], acc[2i+1]).
    let fold = |x: __m256, y: __m256| {
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(x, y), _mm256_permute2f128_ps::<0x31>(x, y))
    };
    let (t01, t23, t45, t67) = (fold(acc[0], acc[1]), fold(acc[2], acc[3]), fold(acc[4], acc[5]), fold(acc[6], acc[7]));
    // [s0+s2, s1+s3] per accumulator: p = [A0, A1, C0, C1 | B0, B1, D0, D1], q likewise for E..H.
    let p = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(t01, t23), _mm256_shuffle_ps::<0b11_10_11_10>(t01, t23));
    let q = _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(t45, t67), _mm256_shuffle_ps::<0b11_10_11_10>(t45, t67));
    // [A, C, E, G | B, D, F, H] = (s0+s2) + (s1+s3), then back to token order.
    let r = _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(p, q), _mm256_shuffle_ps::<0b11_01_11_01>(p, q));
    let r = _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    assert!(out.len() >= 8);
    _mm256_storeu_ps(out.as_mut_ptr(), r);
}

/// 32 bytes, 0xFF where the corresponding bit of `bits` is set (ggml's `bytes_from_bits_32`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bytes_from_bits(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let bit_mask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
    let v = _mm256_or_si256(v, bit_mask);
    _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1))
}

/// Blocks per offset segment of the two-block kernels (the per-block offset coefficients of one segment
/// live on the stack).
const SEGB: usize = 128;

/// Adds the offset terms of one segment to the accumulators: `acc[j] += coef[..len] · s_j[..len]` (8 lanes
/// at a time, the last partial vector masked), where `s_j = s + j * nb` is token `j`'s per-block `s`. The
/// lane assignment depends only on `len`, never on `N`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_offsets<const N: usize>(acc: &mut [__m256; N], coef: &[f32; SEGB], len: usize, s: *const f32, nb: usize) {
    let mut i = 0;
    while i + 8 <= len {
        let c = _mm256_loadu_ps(coef.as_ptr().add(i));
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(c, _mm256_loadu_ps(s.add(j * nb + i)), *acc);
        }
        i += 8;
    }
    if i < len {
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((len - i) as i32), lanes);
        let c = _mm256_maskload_ps(coef.as_ptr().add(i), mask);
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_fmadd_ps(c, _mm256_maskload_ps(s.add(j * nb + i), mask), *acc);
        }
    }
}

/// Q4_0/Q4_1/Q5_0/Q5_1 rows × `N` activation rows, two blocks per step.
///
/// The 16 packed bytes of blocks A and B fill one register; masking gives `[A e0..16, B e0..16]` (low
/// nibbles) and shifting `[A e16..32, B e16..32]`, matched by the activations' pair layout (`Acts::qp`,
/// interleaved across tokens so the tile's rows are at constant offsets from one pointer).
/// Per token: two `vpmaddubsw` summed in i16 (at most 2·2·31·127 < 2^15), one `vpmaddwd` giving
/// `[A x4 | B x4]` partial sums, one conversion and one FMA with `[dA·dyA x4 | dB·dyB x4]`; the
/// accumulators stay in registers. The offset terms (`-8·d·s`, `-16·d·s`, `m·s`) are collected per row
/// segment (one coefficient per block) and added as a vector dot with the activations' per-block `s`. An
/// odd last block goes through 128-bit registers.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pairs<const K: u8, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let bytes = block_bytes(K);
    let (nb, stride) = (a.nb, a.stride);
    let has_min = K == Q4_1 || K == Q5_1;
    let five = K == Q5_0 || K == Q5_1;
    let qs_at = match K {
        Q4_0 => 2,
        Q4_1 => 4,
        Q5_0 => 6,
        _ => 8,
    };
    let qh_at = if K == Q5_0 { 2 } else { 4 };
    let npairs = nb / 2;
    assert!(t0 + N <= stride && a.qp.len() >= stride * a.cols && a.dp4.len() >= npairs * stride * 8);
    assert!(a.s.len() >= stride * nb);
    let ones = _mm256_set1_epi16(1);
    let low4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let offset_scale = _mm_set1_ps(match K {
        Q4_0 => -8.0f32,
        Q5_0 => -16.0,
        _ => 1.0,
    });
    let idx =
        if has_min { _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2) } else { _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) };
    // Tile row j of pair k: qp at (k * stride + t0 + j) * 64, dp4 at (k * stride + t0 + j) * 8.
    let ybase = a.qp.as_ptr().add(t0 * 64);
    let dbase = a.dp4.as_ptr().add(t0 * 8);
    let sbase = a.s.as_ptr().add(t0 * nb);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let row = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); N];
        let mut coef = [0.0f32; SEGB];
        let mut seg_start = 0;
        while seg_start < npairs {
            let seg_end = (seg_start + SEGB / 2).min(npairs);
            for k in seg_start..seg_end {
                let pa = row.add(2 * k * bytes);
                let pb = pa.add(bytes);
                // [dA, (mA,) dB, (mB)] in f32.
                let dm = if has_min {
                    let v = _mm_unpacklo_epi32(
                        _mm_cvtsi32_si128((pa as *const u32).read_unaligned() as i32),
                        _mm_cvtsi32_si128((pb as *const u32).read_unaligned() as i32),
                    );
                    _mm_cvtph_ps(v)
                } else {
                    let v = (pa as *const u16).read_unaligned() as u32
                        | (((pb as *const u16).read_unaligned() as u32) << 16);
                    _mm_cvtph_ps(_mm_cvtsi32_si128(v as i32))
                };
                // Offset coefficients of A and B: [mA, mB] or [-8 dA, -8 dB] (-16 for Q5_0; exact).
                let cab = if has_min { _mm_shuffle_ps::<0b11_01_11_01>(dm, dm) } else { _mm_mul_ps(dm, offset_scale) };
                _mm_storel_epi64(coef.as_mut_ptr().add(2 * (k - seg_start)) as *mut __m128i, _mm_castps_si128(cab));
                let dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), idx);
                let q = _mm256_loadu2_m128i(pb.add(qs_at) as *const __m128i, pa.add(qs_at) as *const __m128i);
                let mut lo = _mm256_and_si256(q, low4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low4);
                if five {
                    let ha = (pa.add(qh_at) as *const u32).read_unaligned();
                    let hb = (pb.add(qh_at) as *const u32).read_unaligned();
                    let bits_lo = (ha & 0xFFFF) | (hb << 16);
                    let bits_hi = (ha >> 16) | (hb & 0xFFFF_0000);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(bytes_from_bits(bits_lo), bit4));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(bytes_from_bits(bits_hi), bit4));
                }
                let y = ybase.add(k * stride * 64);
                let dy = dbase.add(k * stride * 8);
                for (j, acc) in acc.iter_mut().enumerate() {
                    let yj = y.add(64 * j);
                    let p16 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256(yj as *const __m256i)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256(yj.add(32) as *const __m256i)),
                    );
                    let dp = _mm256_madd_epi16(p16, ones);
                    let scale = _mm256_mul_ps(dw, _mm256_loadu_ps(dy.add(8 * j)));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), scale, *acc);
                }
            }
            add_offsets(&mut acc, &coef, 2 * (seg_end - seg_start), sbase.add(2 * seg_start), nb);
            seg_start = seg_end;
        }
        let mut tail = [0.0f32; N];
        if nb % 2 == 1 {
            // The odd last block in 128-bit registers.
            let b = nb - 1;
            let p = row.add(b * bytes);
            let dm = if has_min {
                _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32))
            } else {
                _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32))
            };
            let d = _mm_cvtss_f32(dm);
            let m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
            let q = _mm_loadu_si128(p.add(qs_at) as *const __m128i);
            let l4 = _mm_set1_epi8(0x0F);
            let mut lo = _mm_and_si128(q, l4);
            let mut hi = _mm_and_si128(_mm_srli_epi16::<4>(q), l4);
            if five {
                let bits = (p.add(qh_at) as *const u32).read_unaligned();
                let m16 = _mm256_and_si256(bytes_from_bits(bits), bit4);
                lo = _mm_or_si128(lo, _mm256_castsi256_si128(m16));
                hi = _mm_or_si128(hi, _mm256_extracti128_si256::<1>(m16));
            }
            let cm = if has_min { m } else { d * _mm_cvtss_f32(offset_scale) };
            let ytail = a.qp.as_ptr().add(npairs * stride * 64 + t0 * 32);
            for (j, tl) in tail.iter_mut().enumerate() {
                let t = t0 + j;
                let y = ytail.add(32 * j);
                let p16 = _mm_add_epi16(
                    _mm_maddubs_epi16(lo, _mm_loadu_si128(y as *const __m128i)),
                    _mm_maddubs_epi16(hi, _mm_loadu_si128(y.add(16) as *const __m128i)),
                );
                let v = _mm_madd_epi16(p16, _mm_set1_epi16(1));
                let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
                let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
                let isum = _mm_cvtsi128_si32(v) as f32;
                let (dy, sy) = (a.d[t * nb + b], a.s[t * nb + b]);
                *tl = isum * (d * dy) + cm * sy;
            }
        }
        let o = &mut out[r * N..(r + 1) * N];
        hsums(&acc, o);
        if nb % 2 == 1 {
            for (o, t) in o.iter_mut().zip(tail) {
                *o += t;
            }
        }
    }
}

/// `[dA x4 | dB x4]` from two f16 scales packed as `dA | dB << 16`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scales_x4(dd: u32) -> __m256 {
    let idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(dd as i32))), idx)
}

/// Q8_0 rows × `N` activation rows, two blocks per step, on i16 lanes: per tile the weight blocks A and B
/// are widened once into four registers `[A e0..8 | B e0..8]` … `[A e24..32 | B e24..32]`; per token four
/// `vpmaddwd` against the activations' matching i16 groups (`Acts::qw`, memory operands) and three adds
/// give `[A x4 | B x4]` (exact integer block sums, as the sign trick gave), then one conversion and one
/// FMA with `[dA·dyA x4 | dB·dyB x4]`: 10 instructions per token and pair instead of 14.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let (nb, stride) = (a.nb, a.stride);
    let npairs = nb / 2;
    assert!(t0 + N <= stride && a.qp.len() >= stride * a.cols && a.dp4.len() >= npairs * stride * 8);
    assert!(a.qw.len() >= npairs * stride * 64);
    let ones = _mm256_set1_epi16(1);
    let ybase = a.qw.as_ptr().add(t0 * 64);
    let dbase = a.dp4.as_ptr().add(t0 * 8);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let row = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); N];
        for k in 0..npairs {
            let pa = row.add(2 * k * 34);
            let pb = pa.add(34);
            let dd = (pa as *const u16).read_unaligned() as u32 | (((pb as *const u16).read_unaligned() as u32) << 16);
            let dw = scales_x4(dd);
            let a0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(pa.add(2) as *const __m128i));
            let a1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(pa.add(18) as *const __m128i));
            let b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(pb.add(2) as *const __m128i));
            let b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(pb.add(18) as *const __m128i));
            let w0 = _mm256_permute2x128_si256::<0x20>(a0, b0);
            let w1 = _mm256_permute2x128_si256::<0x31>(a0, b0);
            let w2 = _mm256_permute2x128_si256::<0x20>(a1, b1);
            let w3 = _mm256_permute2x128_si256::<0x31>(a1, b1);
            let y = ybase.add(k * stride * 64);
            let dy = dbase.add(k * stride * 8);
            for (j, acc) in acc.iter_mut().enumerate() {
                let yj = y.add(64 * j) as *const __m256i;
                let s01 = _mm256_add_epi32(
                    _mm256_madd_epi16(w0, _mm256_loadu_si256(yj)),
                    _mm256_madd_epi16(w1, _mm256_loadu_si256(yj.add(1))),
                );
                let s23 = _mm256_add_epi32(
                    _mm256_madd_epi16(w2, _mm256_loadu_si256(yj.add(2))),
                    _mm256_madd_epi16(w3, _mm256_loadu_si256(yj.add(3))),
                );
                let scale = _mm256_mul_ps(dw, _mm256_loadu_ps(dy.add(8 * j)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s01, s23)), scale, *acc);
            }
        }
        if nb % 2 == 1 {
            let b = nb - 1;
            let p = row.add(b * 34);
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32)));
            let dx = _mm256_set1_ps(d);
            let wv = _mm256_loadu_si256(p.add(2) as *const __m256i);
            let wu = _mm256_sign_epi8(wv, wv);
            let ytail = a.qp.as_ptr().add(npairs * stride * 64 + t0 * 32);
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = _mm256_sign_epi8(_mm256_loadu_si256(ytail.add(32 * j) as *const __m256i), wv);
                let dp = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, y), ones);
                let dy = _mm256_set1_ps(a.d[t * nb + b]);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(dx, dy), *acc);
            }
        }
        hsums(&acc, &mut out[r * N..(r + 1) * N]);
    }
}

/// Walks the head screen's groups of 16 interleaved rows ([`crate::screen`], `nb` blocks each): `f(grp, t, n,
/// out)` for each group and tile of `n ≤ TILE` activation rows from row `t` (from `t0` on), `out` pointing at the
/// group's first result for that tile's first row. Checks the activations and `out` against the shapes.
#[inline(always)]
pub(super) unsafe fn for_screen_groups(
    w: &[u8],
    cols: usize,
    a: &Acts,
    t0: usize,
    nt: usize,
    out: &mut [f32],
    stride: usize,
    mut f: impl FnMut(*const u8, usize, usize, *mut f32),
) {
    use crate::screen::{BLOCK_BYTES, GROUP};
    let nb = cols / 32;
    let gb = nb * BLOCK_BYTES;
    let groups = w.len() / gb;
    assert!(a.nb == nb && a.cols == cols && nb * 32 == cols && w.len() % gb == 0 && nt >= 1);
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb && a.zb.len() >= (t0 + nt) * nb);
    assert!(out.len() >= (nt - 1) * stride + GROUP * groups);
    for g in 0..groups {
        let grp = w.as_ptr().add(g * gb);
        let mut j = 0;
        while j < nt {
            let n = (nt - j).min(super::TILE);
            f(grp, t0 + j, n, out.as_mut_ptr().add(j * stride + GROUP * g));
            j += n;
        }
    }
}

/// Value register `j` of the head screen's interleaved block (values `4j..4j+4` of each row, unsigned 6-bit):
/// the low (`j < 4`) or high nibble of `nib` (nibble register `j % 4`) with field `j % 4` of `high` (high-bit
/// register `j / 4`) moved to bits 4–5 — 16-bit shifts, whose spill into the neighbouring byte the mask drops.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn screen_values<const J: usize>(nib: __m256i, high: __m256i) -> __m256i {
    let low = if J < 4 { nib } else { _mm256_srli_epi16::<4>(nib) };
    let h = match J % 4 {
        0 => _mm256_slli_epi16::<4>(high),
        1 => _mm256_slli_epi16::<2>(high),
        2 => high,
        _ => _mm256_srli_epi16::<2>(high),
    };
    _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0F)), _mm256_and_si256(h, _mm256_set1_epi8(0x30)))
}

/// One group of the head screen's 16 interleaved rows ([`crate::screen`]) × activation rows `t..t+G`, written
/// to `out[j * stride + 0..16]`, 8 rows (one 256-bit half of each register) at a time. Per block, value
/// registers `i` and `4 + i` are `vpmaddubsw`'d with the row's 4 values at `4i` and `16 + 4i` broadcast (each
/// i16 at most 2·63·127, their sum below 2¹⁵), one `vpmaddwd` widens, and the sum starts at `Acts::zb`; then
/// one conversion and one FMA with `d_w·d_x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn screen6_tokens<const G: usize>(grp: *const u8, a: &Acts, t: usize, out: *mut f32, stride: usize) {
    use crate::screen::{BLOCK_BYTES, HIGH, NIBBLES};
    let (nb, cols) = (a.nb, a.cols);
    let ones = _mm256_set1_epi16(1);
    let y0 = a.qs.as_ptr().add(t * cols);
    let (d0, z0) = (a.d.as_ptr().add(t * nb), a.zb.as_ptr().add(t * nb));
    for half in 0..2 {
        let mut acc = [_mm256_setzero_ps(); G];
        for b in 0..nb {
            let blk = grp.add(b * BLOCK_BYTES);
            if half == 0 {
                prefetch_ahead(blk, BLOCK_BYTES);
            }
            // (Macros, not closures: closures do not inherit the target features.)
            macro_rules! reg {
                ($off:expr) => {
                    _mm256_loadu_si256(blk.add($off + 32 * half) as *const __m256i)
                };
            }
            let (h0, h1) = (reg!(HIGH), reg!(HIGH + 64));
            let mut isum = [_mm256_setzero_si256(); G];
            for (j, isum) in isum.iter_mut().enumerate() {
                *isum = _mm256_set1_epi32(*z0.add(j * nb + b));
            }
            macro_rules! step {
                ($i:literal) => {{
                    let nib = reg!(NIBBLES + 64 * $i);
                    let (lo, hi) = (screen_values::<$i>(nib, h0), screen_values::<{ 4 + $i }>(nib, h1));
                    for (j, isum) in isum.iter_mut().enumerate() {
                        let y = y0.add(j * cols + 32 * b + 4 * $i);
                        let ylo = _mm256_set1_epi32((y as *const i32).read_unaligned());
                        let yhi = _mm256_set1_epi32((y.add(16) as *const i32).read_unaligned());
                        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
                        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(p, ones));
                    }
                }};
            }
            step!(0);
            step!(1);
            step!(2);
            step!(3);
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * half) as *const __m128i));
            for (j, acc) in acc.iter_mut().enumerate() {
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d0.add(j * nb + b)));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), scale, *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(j * stride + 8 * half), *acc);
        }
    }
}

/// The AVX2 head screen kernel ([`crate::screen`]) as a group kernel. Only called after `Isa::Avx2.available()`.
pub(crate) fn screen6_kernel() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx2, fma and f16c; `for_screen_groups` checks the shapes.
    |w, cols, a, t0, nt, o, stride| unsafe {
        for_screen_groups(w, cols, a, t0, nt, o, stride, |grp, t, n, o| tile!(screen6_tokens, n, grp, a, t, o, stride))
    }
}

/// Legacy quant rows × `N` activation rows, one block per step (the previous kernel, kept for
/// comparison in tests).
#[allow(dead_code)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const K: u8, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let bytes = block_bytes(K);
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.dexp.len() >= (t0 + N) * nb * 8);
    let ones = _mm256_set1_epi16(1);
    let low4 = _mm_set1_epi8(0x0F);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let row = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); N];
        let mut coef = [0.0f32; SEG];
        let mut seg_start = 0;
        for b in 0..nb {
            let p = row.add(b * bytes);
            // d (and m for Q4_1/Q5_1) through one F16C conversion.
            let dm = if K == Q4_1 || K == Q5_1 {
                _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32))
            } else {
                _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32))
            };
            let d = _mm_cvtss_f32(dm);
            let dx = _mm256_broadcastss_ps(dm);
            let wv = if K == Q8_0 {
                _mm256_loadu_si256(p.add(2) as *const __m256i)
            } else {
                let qs_at = match K {
                    Q4_0 => 2,
                    Q4_1 => 4,
                    Q5_0 => 6,
                    _ => 8,
                };
                let q = _mm_loadu_si128(p.add(qs_at) as *const __m128i);
                let lo = _mm_and_si128(q, low4);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), low4);
                let v = _mm256_set_m128i(hi, lo);
                if K == Q5_0 || K == Q5_1 {
                    let qh_at = if K == Q5_0 { 2 } else { 4 };
                    let bits = (p.add(qh_at) as *const u32).read_unaligned();
                    _mm256_or_si256(v, _mm256_and_si256(bytes_from_bits(bits), _mm256_set1_epi8(0x10)))
                } else {
                    v
                }
            };
            match K {
                Q4_0 => coef[b - seg_start] = -8.0 * d,
                Q5_0 => coef[b - seg_start] = -16.0 * d,
                Q4_1 | Q5_1 => coef[b - seg_start] = _mm_cvtss_f32(_mm_movehdup_ps(dm)),
                _ => {}
            }
            // Q8_0: |w| as the unsigned operand; the activation takes w's sign.
            let wu = if K == Q8_0 { _mm256_sign_epi8(wv, wv) } else { wv };
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = _mm256_loadu_si256(a.qs.as_ptr().add(t * cols + b * 32) as *const __m256i);
                let y = if K == Q8_0 { _mm256_sign_epi8(y, wv) } else { y };
                let dp = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, y), ones);
                let dy = _mm256_loadu_ps(a.dexp.as_ptr().add((t * nb + b) * 8));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(dx, dy), *acc);
            }
            let b_end = b + 1;
            if K != Q8_0 && (b_end - seg_start == SEG || b_end == nb) {
                let len = b_end - seg_start;
                let mut i = 0;
                while i < len {
                    if len - i >= 8 {
                        let cv = _mm256_loadu_ps(coef.as_ptr().add(i));
                        for (j, acc) in acc.iter_mut().enumerate() {
                            let s = _mm256_loadu_ps(a.s.as_ptr().add((t0 + j) * nb + seg_start + i));
                            *acc = _mm256_fmadd_ps(cv, s, *acc);
                        }
                        i += 8;
                    } else {
                        // Remaining < 8 blocks: scalar, added into lane 0.
                        for (j, acc) in acc.iter_mut().enumerate() {
                            let s = &a.s[(t0 + j) * nb + seg_start..];
                            let mut extra = 0.0f32;
                            for k in i..len {
                                extra += coef[k] * s[k];
                            }
                            *acc = _mm256_add_ps(*acc, _mm256_setr_ps(extra, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0));
                        }
                        i = len;
                    }
                }
                seg_start = b_end;
            }
        }
        hsums(&acc, &mut out[r * N..(r + 1) * N]);
    }
}

/// Q4_K (or Q5_K when `FIVE`) rows × `N` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const FIVE: bool, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let bytes = if FIVE { 176 } else { 144 };
    let qs_at = if FIVE { 48 } else { 16 };
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.bsums.len() >= (t0 + N) * nb * 16);
    let low4 = _mm256_set1_epi8(0x0F);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let mut acc = [_mm256_setzero_ps(); N];
        for ib in 0..nb {
            let blk = &row[ib * bytes..(ib + 1) * bytes];
            let p = blk.as_ptr();
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const u32).read_unaligned() as i32));
            let d = _mm_cvtss_f32(dm);
            let dmin = _mm_cvtss_f32(_mm_shuffle_ps::<0b01>(dm, dm));
            let (sc, mn) = k4_scales_mins(&blk[4..16]);
            let sc_bytes = sc.to_le_bytes();
            // Mins per 16-element group (group g belongs to sub-block g / 2).
            let mn16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(
                _mm_cvtsi64_si128(mn as i64),
                _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
            ));
            let qh = if FIVE { _mm256_loadu_si256(p.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
            // 8 sub-blocks of 32 values: sub-block 2k = low nibbles of qs[32k..], 2k+1 = high nibbles.
            let mut wq = [_mm256_setzero_si256(); 8];
            let mut scv = [_mm256_setzero_si256(); 8];
            for k in 0..4 {
                let q = _mm256_loadu_si256(p.add(qs_at + 32 * k) as *const __m256i);
                let mut lo = _mm256_and_si256(q, low4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), low4);
                if FIVE {
                    let sixteen = _mm256_set1_epi8(16);
                    let bl = _mm256_set1_epi8(1 << (2 * k));
                    let bh = _mm256_set1_epi8((2 << (2 * k)) as u8 as i8);
                    lo =
                        _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), sixteen));
                    hi =
                        _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), sixteen));
                }
                wq[2 * k] = lo;
                wq[2 * k + 1] = hi;
                scv[2 * k] = _mm256_set1_epi16(sc_bytes[2 * k] as i16);
                scv[2 * k + 1] = _mm256_set1_epi16(sc_bytes[2 * k + 1] as i16);
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = a.qs.as_ptr().add(t * cols + ib * 256);
                let mut isum = _mm256_setzero_si256();
                for s in 0..8 {
                    let ys = _mm256_loadu_si256(y.add(32 * s) as *const __m256i);
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[s], ys), scv[s]));
                }
                let bs = _mm256_loadu_si256(a.bsums.as_ptr().add((t * nb + ib) * 16) as *const __m256i);
                let msum = _mm256_madd_epi16(mn16, bs);
                let dy = *a.d.get_unchecked(t * nb + ib);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dy * d), *acc);
                *acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dy * dmin), *acc);
            }
        }
        hsums(&acc, &mut out[r * N..(r + 1) * N]);
    }
}

/// Q6_K rows × `N` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let (nb, cols) = (a.nb, a.cols);
    debug_assert!(a.qs.len() >= (t0 + N) * cols && a.bsums.len() >= (t0 + N) * nb * 16);
    let low4 = _mm256_set1_epi8(0x0F);
    let low2 = _mm256_set1_epi8(0x03);
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let mut acc = [_mm256_setzero_ps(); N];
        for ib in 0..nb {
            let p = row[ib * 210..(ib + 1) * 210].as_ptr();
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((p.add(208) as *const u16).read_unaligned() as i32)));
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(192) as *const __m128i));
            let sc_bytes = std::slice::from_raw_parts(p.add(192) as *const i8, 16);
            // 8 quarters of 32 values (quarter 4n + k), each with two 16-element scales.
            let mut wq = [_mm256_setzero_si256(); 8];
            let mut scv = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let ql0 = _mm256_loadu_si256(p.add(64 * n) as *const __m256i);
                let ql1 = _mm256_loadu_si256(p.add(64 * n + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
                // High bit pairs k = 0..3 moved to bits 4..5.
                let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, low2));
                let h1 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), low2));
                let h2 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), low2));
                let h3 = _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), low2));
                wq[4 * n] = _mm256_or_si256(_mm256_and_si256(ql0, low4), h0);
                wq[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), h1);
                wq[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4), h2);
                wq[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4), h3);
                for k in 0..4 {
                    let g = 8 * n + 2 * k;
                    scv[4 * n + k] =
                        _mm256_set_m128i(_mm_set1_epi16(sc_bytes[g + 1] as i16), _mm_set1_epi16(sc_bytes[g] as i16));
                }
            }
            for (j, acc) in acc.iter_mut().enumerate() {
                let t = t0 + j;
                let y = a.qs.as_ptr().add(t * cols + ib * 256);
                let mut isum = _mm256_setzero_si256();
                for q in 0..8 {
                    let yq = _mm256_loadu_si256(y.add(32 * q) as *const __m256i);
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[q], yq), scv[q]));
                }
                // The stored values are q + 32: subtract 32 · Σ scale · (sum of 16 activations).
                let bs = _mm256_loadu_si256(a.bsums.as_ptr().add((t * nb + ib) * 16) as *const __m256i);
                isum = _mm256_sub_epi32(isum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bs)));
                let dy = *a.d.get_unchecked(t * nb + ib);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dy * d), *acc);
            }
        }
        hsums(&acc, &mut out[r * N..(r + 1) * N]);
    }
}

/// F32 (`K = 0`), F16 (`K = 1`) or BF16 (`K = 2`) rows × `N` activation rows (f32 FMA).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float<const K: u8, const N: usize>(w: &[u8], rb: usize, a: &Acts, t0: usize, out: &mut [f32]) {
    let cols = a.cols;
    debug_assert!(a.f.len() >= (t0 + N) * cols);
    let elem = if K == 0 { 4 } else { 2 };
    for (r, row) in w.chunks_exact(rb).enumerate() {
        prefetch_ahead(row.as_ptr(), rb);
        let p = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); N];
        let main = cols / 8 * 8;
        let mut c = 0;
        while c < main {
            let wv = match K {
                0 => _mm256_loadu_ps(p.add(c * 4) as *const f32),
                1 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(c * 2) as *const __m128i)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                    p.add(c * 2) as *const __m128i
                )))),
            };
            for (j, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(a.f.as_ptr().add((t0 + j) * cols + c));
                *acc = _mm256_fmadd_ps(wv, x, *acc);
            }
            c += 8;
        }
        for j in 0..N {
            let mut tail = 0.0f32;
            for c in main..cols {
                let wb = std::slice::from_raw_parts(p.add(c * elem), elem);
                let wf = match K {
                    0 => f32::from_le_bytes([wb[0], wb[1], wb[2], wb[3]]),
                    1 => crate::blocks::f16_to_f32(u16::from_le_bytes([wb[0], wb[1]])),
                    _ => crate::blocks::bf16_to_f32(u16::from_le_bytes([wb[0], wb[1]])),
                };
                tail += wf * a.f[(t0 + j) * cols + c];
            }
            out[r * N + j] = hsum(acc[j]) + tail;
        }
    }
}

/// The interleaved Q4_0 (`MIN = false`), Q4_1 or Q5_0 (`FIVE`) kernel ([`crate::repack::interleave8`]). Only
/// called after `Isa::Avx2.available()`.
pub(crate) fn q4_x8_kernel<const MIN: bool, const FIVE: bool>() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx2, fma and f16c; `q4_x8` checks the shapes it reads.
    |w, cols, a, t0, nt, o, stride| unsafe { q4_x8::<MIN, FIVE>(w, cols, a, t0, nt, o, stride) }
}

/// Q4_0/Q4_1 (or Q5_0 when `FIVE`) weights interleaved by 8 rows × `nt` activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let (xb, regs) = crate::repack::x8_nibble_layout(MIN, FIVE);
    let group_bytes = nb * xb;
    if FIVE && nt > RUN && nb <= UNPACKED_BLOCKS {
        // Q5_0 with more than one run of activation rows: each group's values are unpacked once, not once per run
        // (spreading the fifth bits is 5 operations a register). Session 62, 2-vCPU Zen 3, `kbench 2 Q5_0` (2048 ×
        // 640, three alternating runs): 8 rows 103–111 vs 121–138 µs, 16 rows 203–222 vs 240–266 µs. For Q4_0/Q4_1
        // (a load and 3 operations a register) it measured no faster (SmolLM2's 1536 × 576 Q4_1: the same to 1.4×
        // slower at 8 and 16 rows), so they unpack per run.
        let groups = w.len() / group_bytes;
        assert!(w.len() % group_bytes == 0 && out.len() >= (nt - 1) * stride + 8 * groups);
        // Written before it is read (block by block, below); not zeroed: a call may take only two groups.
        let mut buf = std::mem::MaybeUninit::<[__m256i; 8 * UNPACKED_BLOCKS]>::uninit();
        let values = buf.as_mut_ptr() as *mut __m256i;
        for g in 0..groups {
            let grp = w.as_ptr().add(g * group_bytes);
            for b in 0..nb {
                let blk = grp.add(b * xb);
                prefetch_ahead(blk, xb);
                for i in 0..4 {
                    let (lo, hi) = q4_x8_values::<FIVE>(blk, regs, i);
                    values.add(8 * b + i).write(lo);
                    values.add(8 * b + 4 + i).write(hi);
                }
            }
            let v = values as *const __m256i;
            let mut j = 0;
            while j < nt {
                let o = out.as_mut_ptr().add(j * stride + 8 * g);
                match (nt - j).min(RUN) {
                    1 => q4_x8_tokens::<MIN, FIVE, true, 1>(grp, v, a, t0 + j, o, stride),
                    2 => q4_x8_tokens::<MIN, FIVE, true, 2>(grp, v, a, t0 + j, o, stride),
                    3 => q4_x8_tokens::<MIN, FIVE, true, 3>(grp, v, a, t0 + j, o, stride),
                    _ => q4_x8_tokens::<MIN, FIVE, true, 4>(grp, v, a, t0 + j, o, stride),
                }
                j += RUN;
            }
        }
        return;
    }
    let none = std::ptr::null();
    for_groups(w, group_bytes, nt, RUN, out, stride, |grp, j, n, o| match n {
        1 => q4_x8_tokens::<MIN, FIVE, false, 1>(grp, none, a, t0 + j, o, stride),
        2 => q4_x8_tokens::<MIN, FIVE, false, 2>(grp, none, a, t0 + j, o, stride),
        3 => q4_x8_tokens::<MIN, FIVE, false, 3>(grp, none, a, t0 + j, o, stride),
        _ => q4_x8_tokens::<MIN, FIVE, false, 4>(grp, none, a, t0 + j, o, stride),
    });
}

/// Activation rows one pass of the interleaved Q4/Q5 kernel takes (its register budget: per row an i16 and an
/// i32 block sum and an f32 accumulator).
const RUN: usize = 4;

/// Most blocks per row (`cols / 32`) whose unpacked Q5_0 values [`q4_x8`] keeps for a group (8 registers a block,
/// 16 KB on the stack); longer rows are unpacked once per run of activation rows.
const UNPACKED_BLOCKS: usize = 64;

/// Register `i` of an interleaved Q4_0/Q4_1/Q5_0 block (`regs`: where its nibble registers start) unpacked into
/// the unsigned values the kernel multiplies: values `4i..4i+4` (low nibbles) and `16+4i..` (high) of the 8 rows,
/// for Q5_0 (`FIVE`) with the fifth bits of [`fifth_bits`] or'ed in as 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_x8_values<const FIVE: bool>(blk: *const u8, regs: usize, i: usize) -> (__m256i, __m256i) {
    let low4 = _mm256_set1_epi8(0x0F);
    let p = _mm256_loadu_si256(blk.add(regs + 32 * i) as *const __m256i);
    let lo = _mm256_and_si256(p, low4);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(p), low4);
    if FIVE {
        let qh = blk.add(crate::repack::Q5_0_X8_QH + 8 * i);
        (_mm256_or_si256(lo, fifth_bits(qh)), _mm256_or_si256(hi, fifth_bits(qh.add(4))))
    } else {
        (lo, hi)
    }
}

/// Walks the groups of 8 interleaved rows (`group_bytes` each) of `w` and, per group, the activation rows in
/// runs of up to `run` (the register budget of a group kernel: per activation row an integer block sum and an
/// f32 accumulator): calls `f(group, first row j, run length, &out[j * stride + 8 * group])`.
///
/// # Safety
/// `f` gets a pointer into `out` with room for its run's rows at `stride` and 8 lanes each (checked here).
#[inline(always)]
pub(super) unsafe fn for_groups(
    w: &[u8],
    group_bytes: usize,
    nt: usize,
    run: usize,
    out: &mut [f32],
    stride: usize,
    mut f: impl FnMut(*const u8, usize, usize, *mut f32),
) {
    let groups = w.len() / group_bytes;
    assert!(w.len() % group_bytes == 0 && nt >= 1 && out.len() >= (nt - 1) * stride + 8 * groups);
    for g in 0..groups {
        let grp = w.as_ptr().add(g * group_bytes);
        let mut j = 0;
        while j < nt {
            f(grp, j, (nt - j).min(run), out.as_mut_ptr().add(j * stride + 8 * g));
            j += run;
        }
    }
}

/// One group of 8 interleaved Q4_0/Q4_1/Q5_0 rows × activation rows `t..t+G`, written to `out[j * stride + 0..8]`.
///
/// Per block and register `i` (values `4i..4i+4` and `16+4i..` of the 8 rows): the nibbles are unpacked once (for
/// Q5_0 with the fifth bits of [`fifth_bits`] or'ed in as 16) and `vpmaddubsw`'d with the activation row's 4
/// values broadcast to every lane; the products add up in i16 (Q4: all 8 of a block, at most 8·2·15·127 < 2^15;
/// Q5_0: two registers' worth, at most 4·2·31·127 < 2^15), `vpmaddwd` gives the 8 rows' block sums, and two FMAs
/// add `d_w·d_x·sum + c_w·s_x` with `c_w = m_w` (Q4_1), `-8·d_w` (Q4_0) or `-16·d_w` (Q5_0) and `s_x = d_x·Σx`.
/// The integer sums are exact, so a row's result does not depend on the other activation rows of the call.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_x8_tokens<const MIN: bool, const FIVE: bool, const UNPACKED: bool, const G: usize>(
    grp: *const u8,
    values: *const __m256i,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
) {
    let (nb, cols) = (a.nb, a.cols);
    let (xb, regs) = crate::repack::x8_nibble_layout(MIN, FIVE);
    let ones = _mm256_set1_epi16(1);
    let y0 = a.qs.as_ptr().add(t * cols);
    let d0 = a.d.as_ptr().add(t * nb);
    let s0 = a.s.as_ptr().add(t * nb);
    let mut acc = [_mm256_setzero_ps(); G];
    // Block `b`'s integer sums wait in `prev` until block `b + 1`'s products are issued (software pipelining): the
    // scale step's conversion and two dependent FMAs then overlap the next block's integer work; the f32 sums are
    // formed in the same order. Session 65, 2-vCPU Zen 3, `kbench 2 Q4_1_1536` / `kbench 2 Q5_0`, alternating: Q4_1
    // 2–16 rows 3–6% faster, Q5_0 one row 9% (26.0 → 23.7 µs), 2 rows 2–4% slower. The unpacked Q5_0 path (more
    // than one run of rows) measured 4% slower at 8 and 16 rows this way and keeps the plain order.
    let mut prev = [_mm256_setzero_si256(); G];
    for b in 0..nb {
        let blk = grp.add(b * xb);
        if !UNPACKED {
            prefetch_ahead(blk, xb);
        }
        let mut s16 = [_mm256_setzero_si256(); G];
        let mut isum = [_mm256_setzero_si256(); G];
        for i in 0..4 {
            let (lo, hi) = if UNPACKED {
                (*values.add(8 * b + i), *values.add(8 * b + 4 + i))
            } else {
                q4_x8_values::<FIVE>(blk, regs, i)
            };
            for (j, s16) in s16.iter_mut().enumerate() {
                let y = y0.add(j * cols + 32 * b + 4 * i);
                let ylo = _mm256_set1_epi32((y as *const i32).read_unaligned());
                let yhi = _mm256_set1_epi32((y.add(16) as *const i32).read_unaligned());
                let p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
                *s16 = _mm256_add_epi16(*s16, p16);
            }
            if FIVE && i % 2 == 1 {
                for (isum, s16) in isum.iter_mut().zip(s16.iter_mut()) {
                    *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(*s16, ones));
                    *s16 = _mm256_setzero_si256();
                }
            }
        }
        if !FIVE {
            isum = core::array::from_fn(|j| _mm256_madd_epi16(s16[j], ones));
        }
        if UNPACKED {
            q4_x8_scale::<MIN, FIVE, G>(blk, &isum, d0.add(b), s0.add(b), nb, &mut acc);
        } else {
            if b > 0 {
                q4_x8_scale::<MIN, FIVE, G>(grp.add((b - 1) * xb), &prev, d0.add(b - 1), s0.add(b - 1), nb, &mut acc);
            }
            prev = isum;
        }
    }
    if !UNPACKED {
        q4_x8_scale::<MIN, FIVE, G>(grp.add((nb - 1) * xb), &prev, d0.add(nb - 1), s0.add(nb - 1), nb, &mut acc);
    }
    store_rows(&acc, out, stride);
}

/// The 32 fifth bits at `qh` (an interleaved Q5_0 mask, [`crate::repack::Q5_0_X8_BYTES`]: bit `k` belongs to byte
/// `k` of the nibble register) as bytes of 16 or 0: byte `k` gets byte `k / 8` of the mask (`vpshufb`), keeps bit
/// `k % 8`, and a compare turns it into a full byte.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fifth_bits(qh: *const u8) -> __m256i {
    let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let v = _mm256_shuffle_epi8(_mm256_set1_epi32((qh as *const i32).read_unaligned()), shuf);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// Adds one block column of 8 interleaved Q4_0/Q4_1/Q5_0 rows to the f32 sums `acc` of `G` activation rows, from
/// their integer block sums `isum`: `d_w·d_x·isum + c_w·s_x` with `c_w = m_w` (Q4_1), `-8·d_w` (Q4_0) or `-16·d_w`
/// (Q5_0, `FIVE`); `d` and `s` point at the first row's `d_x` and `s_x` of this block (the rows `nb` apart).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_x8_scale<const MIN: bool, const FIVE: bool, const G: usize>(
    blk: *const u8,
    isum: &[__m256i; G],
    d: *const f32,
    s: *const f32,
    nb: usize,
    acc: &mut [__m256; G],
) {
    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
    let cw = if MIN {
        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
    } else {
        _mm256_mul_ps(dw, _mm256_set1_ps(if FIVE { -16.0 } else { -8.0 }))
    };
    for (j, acc) in acc.iter_mut().enumerate() {
        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(j * nb)));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), scale, *acc);
        *acc = _mm256_fmadd_ps(cw, _mm256_set1_ps(*s.add(j * nb)), *acc);
    }
}

/// Stores the 8-lane sums of `G` activation rows at `out + j * stride`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn store_rows<const G: usize>(acc: &[__m256; G], out: *mut f32, stride: usize) {
    for (j, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(j * stride), *acc);
    }
}

/// The interleaved Q4_K (or, `SIX`, Q6_K) kernel ([`crate::repack::interleave8`]). Only called after
/// `Isa::Avx2.available()`.
pub(crate) fn k_x8_kernel<const SIX: bool>() -> super::GroupKernel {
    // SAFETY: handed out only when the CPU has avx2, fma and f16c; `k_x8` checks the shapes it reads.
    |w, cols, a, t0, nt, o, stride| unsafe { k_x8::<SIX>(w, cols, a, t0, nt, o, stride) }
}

/// Q4_K (or, `SIX`, Q6_K) weights interleaved by 8 rows × `nt` activation rows (Q8_K), in runs of up to 4.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_x8<const SIX: bool>(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    let nb = cols / 256;
    assert!(a.nb == nb && a.cols == cols);
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb && a.bsums.len() >= (t0 + nt) * nb * 16);
    let xb = if SIX { crate::repack::Q6_K_X8_BYTES } else { crate::repack::Q4_K_X8_BYTES };
    for_groups(w, nb * xb, nt, RUN, out, stride, |grp, j, n, o| match (SIX, n) {
        (false, 1) => q4_k_x8_tokens::<1>(grp, a, t0 + j, o, stride),
        (false, 2) => q4_k_x8_tokens::<2>(grp, a, t0 + j, o, stride),
        (false, 3) => q4_k_x8_tokens::<3>(grp, a, t0 + j, o, stride),
        (false, _) => q4_k_x8_tokens::<4>(grp, a, t0 + j, o, stride),
        (true, 1) => q6_k_x8_tokens::<1>(grp, a, t0 + j, o, stride),
        (true, 2) => q6_k_x8_tokens::<2>(grp, a, t0 + j, o, stride),
        (true, 3) => q6_k_x8_tokens::<3>(grp, a, t0 + j, o, stride),
        (true, _) => q6_k_x8_tokens::<4>(grp, a, t0 + j, o, stride),
    });
}

/// 8 bytes (one per weight row) widened so that both i16 lanes of each row's 32-bit lane hold its byte: the
/// multiplier of a `vpmaddwd` against per-row pairs of i16 sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn dup16(p: *const u8) -> __m256i {
    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
    _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
}

/// One group of 8 interleaved Q4_K rows × activation rows `t..t+G`, written to `out[j * stride + 0..8]`.
///
/// Per sub-block: 8 registers of nibbles (4 values of each row) `vpmaddubsw`'d with the activation's 4 values
/// broadcast, added in i16 (at most 8·2·15·127 < 2^15), then one `vpmaddwd` with the rows' 6-bit scales; the
/// mins term is one `vpmaddwd` per sub-block of the rows' mins with the activation's pair of 16-value sums.
/// Per super-block: `d_x·(d_w·Σ sc·dot − dmin_w·Σ m·bsum)` in two FMAs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_k_x8_tokens<const G: usize>(grp: *const u8, a: &Acts, t: usize, out: *mut f32, stride: usize) {
    use crate::repack::{Q4_K_X8_BYTES, Q4_K_X8_MINS, Q4_K_X8_QS, Q4_K_X8_SCALES};
    let (nb, cols) = (a.nb, a.cols);
    let low4 = _mm256_set1_epi8(0x0F);
    let y0 = a.qs.as_ptr().add(t * cols);
    let mut acc = [_mm256_setzero_ps(); G];
    for b in 0..nb {
        let blk = grp.add(b * Q4_K_X8_BYTES);
        prefetch_ahead(blk, Q4_K_X8_BYTES);
        let mut isum = [_mm256_setzero_si256(); G];
        for sb in 0..8 {
            let q = blk.add(Q4_K_X8_QS + 256 * (sb / 2));
            let mut s16 = [_mm256_setzero_si256(); G];
            for i in 0..8 {
                let p = _mm256_loadu_si256(q.add(32 * i) as *const __m256i);
                let v = if sb % 2 == 0 {
                    _mm256_and_si256(p, low4)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(p), low4)
                };
                for (j, s16) in s16.iter_mut().enumerate() {
                    let y = y0.add(j * cols + 256 * b + 32 * sb + 4 * i);
                    let yv = _mm256_set1_epi32((y as *const i32).read_unaligned());
                    *s16 = _mm256_add_epi16(*s16, _mm256_maddubs_epi16(v, yv));
                }
            }
            let sc = dup16(blk.add(Q4_K_X8_SCALES + 8 * sb));
            for (j, isum) in isum.iter_mut().enumerate() {
                *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(s16[j], sc));
            }
        }
        let mut msum = [_mm256_setzero_si256(); G];
        for sb in 0..8 {
            let m = dup16(blk.add(Q4_K_X8_MINS + 8 * sb));
            for (j, msum) in msum.iter_mut().enumerate() {
                let bs = a.bsums.as_ptr().add(((t + j) * nb + b) * 16 + 2 * sb);
                let pair = _mm256_set1_epi32((bs as *const i32).read_unaligned());
                *msum = _mm256_add_epi32(*msum, _mm256_madd_epi16(m, pair));
            }
        }
        q4_k_x8_scale::<G>(blk, &isum, &msum, a.d.as_ptr().add(t * nb + b), nb, &mut acc);
    }
    store_rows(&acc, out, stride);
}

/// Adds one super-block column of 8 interleaved Q4_K rows to the f32 sums `acc` of `G` activation rows, from
/// their integer sums `isum` (`Σ sc·dot`) and `msum` (`Σ m·bsum`): `d_x·(d_w·isum − dmin_w·msum)`; `d` points at
/// the first row's `d_x` of this super-block (the rows `nb` apart).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q4_k_x8_scale<const G: usize>(
    blk: *const u8,
    isum: &[__m256i; G],
    msum: &[__m256i; G],
    d: *const f32,
    nb: usize,
    acc: &mut [__m256; G],
) {
    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
    for (j, acc) in acc.iter_mut().enumerate() {
        let dy = _mm256_set1_ps(*d.add(j * nb));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(dw, dy), *acc);
        *acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[j]), _mm256_mul_ps(dmin, dy), *acc);
    }
}

/// 8 signed bytes (one per weight row) widened so that both i16 lanes of each row's 32-bit lane hold its byte: the
/// multiplier of a `vpmaddwd` against per-row pairs of i16 sums (the signed [`dup16`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dup16_signed(p: *const u8) -> __m256i {
    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i));
    _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32::<16>(v))
}

/// One group of 8 interleaved Q6_K rows × activation rows `t..t+G`, written to `out[j * stride + 0..8]`.
///
/// Per sub-block (one unit of [`crate::repack::Q6_K_X8_QS`]): the two nibble registers and the register of high
/// bit pairs decode into four registers of 4 unsigned values (`q` in 0..64) × 8 rows, each `vpmaddubsw`'d with the
/// activation's 4 values broadcast; two of them add up in i16 (at most 2·2·63·127 < 2^15) and one `vpmaddwd` with
/// the rows' scales (in both i16 halves of a lane) adds them to the rows' i32 sums. The offset term `32·Σ sc·bsum`
/// is one `vpmaddwd` per pair of sub-blocks of the rows' scale pairs with the activation's pair of 16-value sums.
/// Per super-block `d_w·d_x·(isum − 32·msum)` in one FMA, as the AVX-512 kernel (exact integer sums, so a row's
/// result does not depend on the other activation rows of the call).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k_x8_tokens<const G: usize>(grp: *const u8, a: &Acts, t: usize, out: *mut f32, stride: usize) {
    use crate::repack::{Q6_K_X8_BYTES, Q6_K_X8_QS, Q6_K_X8_SCALES};
    let (nb, cols) = (a.nb, a.cols);
    let low4 = _mm256_set1_epi8(0x0F);
    let top2 = _mm256_set1_epi8(0x30);
    let y0 = a.qs.as_ptr().add(t * cols);
    let bcast = |p: *const i8| _mm256_set1_epi32((p as *const i32).read_unaligned());
    let mut acc = [_mm256_setzero_ps(); G];
    for b in 0..nb {
        let blk = grp.add(b * Q6_K_X8_BYTES);
        let mut isum = [_mm256_setzero_si256(); G];
        for s in 0..16 {
            let unit = blk.add(Q6_K_X8_QS + 96 * s);
            if s % 2 == 0 {
                prefetch_ahead(unit, 192);
            }
            let n0 = _mm256_loadu_si256(unit as *const __m256i);
            let n1 = _mm256_loadu_si256(unit.add(32) as *const __m256i);
            let h = _mm256_loadu_si256(unit.add(64) as *const __m256i);
            // 16-bit shifts: the bits a shift carries across a byte boundary land outside 0x30 and are masked off.
            let v = [
                _mm256_or_si256(_mm256_and_si256(n0, low4), _mm256_and_si256(_mm256_slli_epi16::<4>(h), top2)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(n0), low4),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(h), top2),
                ),
                _mm256_or_si256(_mm256_and_si256(n1, low4), _mm256_and_si256(h, top2)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(n1), low4),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(h), top2),
                ),
            ];
            let sc = dup16_signed(blk.add(Q6_K_X8_SCALES + 8 * s));
            for (j, isum) in isum.iter_mut().enumerate() {
                let y = y0.add(j * cols + 256 * b + 16 * s);
                let p01 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(v[0], bcast(y)), _mm256_maddubs_epi16(v[1], bcast(y.add(4))));
                let p23 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(v[2], bcast(y.add(8))),
                    _mm256_maddubs_epi16(v[3], bcast(y.add(12))),
                );
                let part = _mm256_add_epi32(_mm256_madd_epi16(p01, sc), _mm256_madd_epi16(p23, sc));
                *isum = _mm256_add_epi32(*isum, part);
            }
        }
        let mut msum = [_mm256_setzero_si256(); G];
        for k in 0..8 {
            // Row r's scales of sub-blocks 2k and 2k + 1 side by side, as i16.
            let at = blk.add(Q6_K_X8_SCALES + 16 * k);
            let pairs =
                _mm_unpacklo_epi8(_mm_loadl_epi64(at as *const __m128i), _mm_loadl_epi64(at.add(8) as *const __m128i));
            let scp = _mm256_cvtepi8_epi16(pairs);
            for (j, msum) in msum.iter_mut().enumerate() {
                let bs = a.bsums.as_ptr().add(((t + j) * nb + b) * 16 + 2 * k);
                let pair = _mm256_set1_epi32((bs as *const i32).read_unaligned());
                *msum = _mm256_add_epi32(*msum, _mm256_madd_epi16(scp, pair));
            }
        }
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        for (j, acc) in acc.iter_mut().enumerate() {
            let total = _mm256_sub_epi32(isum[j], _mm256_slli_epi32::<5>(msum[j]));
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked((t + j) * nb + b)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, *acc);
        }
    }
    store_rows(&acc, out, stride);
}
