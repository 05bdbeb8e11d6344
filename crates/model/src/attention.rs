//! Attention of a batch of rows over one layer's KV cache (keys and values stored as f16): the per-layer work
//! that grows with the context, and with every extra row of a speculative tree.
//!
//! Per (row, head) task:
//! 1. the positions the row sees — every cached slot (subject to the sliding window), then the batch's own rows
//!    allowed by the causal or tree mask — are listed in slot order;
//! 2. their scores `q·k · scale` (eight keys at a time);
//! 3. an exact softmax: the maximum first, then `exp(score − max)` ([`exp_nonpositive`], a polynomial that the
//!    vector code evaluates with the same operations), summed in eight lanes;
//! 4. `Σ w·v` in f32, in two partial sums, scaled by `1 / Σ w`.
//!
//! Every lane and partial sum is chosen by a position's **rank** among the visible ones, never by its cache slot,
//! so a row's result depends only on the ordered (key, value) pairs it sees: a draft-tree node whose ancestors sit
//! at scattered slots computes bit for bit what dense decoding computes for the same token at the same position,
//! and a token's result does not depend on the batch it is computed in. The AVX2 kernels equal the portable ones
//! bit for bit (same lanes, same order; FMA exactly where the portable code calls `mul_add`).
//!
//! Until session 15 this followed llama.cpp's CPU flash attention (online softmax, V accumulated in f16, one
//! dependent rounding per position): ~56 cycles per head and position on the 2-core machine, 16% of decoding and
//! the largest per-row cost of a tree verification. The f32 accumulation is more exact than llama.cpp's, and the
//! reference tests (`tests/reference.rs`) bound how far our logits may drift from its own.

use crate::blocks::{dot_f16, f16_to_f32};
use crate::model::{Mask, SharedMut};

/// The attention of a batch over one layer's KV cache: one task per (row, head).
pub(crate) struct Attention<'a> {
    /// Queries, `n × qd` (rounded to f16 values).
    pub q: &'a [f32],
    /// Cached keys (f16 bits), `total × kvd`.
    pub kc: &'a [u16],
    /// Cached values (f16 bits), `total × vd`.
    pub vc: &'a [u16],
    /// Position of every cached slot.
    pub pc: &'a [u32],
    /// Position of every row of the batch.
    pub positions: &'a [u32],
    pub mask: Mask<'a>,
    pub window: Option<usize>,
    /// Slots cached before this batch (the batch's rows follow them).
    pub base: usize,
    /// `base + n`.
    pub total: usize,
    /// Rows in the batch.
    pub n: usize,
    pub qd: usize,
    pub kvd: usize,
    pub vd: usize,
    pub hd: usize,
    pub hdv: usize,
    /// Width of an output row.
    pub att_d: usize,
    pub n_head: usize,
    /// Query heads per KV head.
    pub group: usize,
    pub scale: f32,
    /// Output rows, `n × att_d`; each task writes its own head's `hdv` values.
    pub att: SharedMut,
}

/// Floats of scratch one work item needs per slot of the layer (cached and new): the scores and the visible slots.
pub(crate) const SCRATCH_PER_SLOT: usize = 2;

impl Attention<'_> {
    /// Runs `tasks` (task = row * n_head + head), using `sc` (`SCRATCH_PER_SLOT * total` floats) as scratch.
    pub(crate) fn run(&self, tasks: std::ops::Range<usize>, sc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: the CPU has the features enabled for `run_avx2`.
                return unsafe { self.run_avx2(tasks, sc) };
            }
        }
        self.run_generic(tasks, sc, dot_f16, |q, ks| ks.map(|k| dot_f16(q, k)), exp_sum, weigh)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, tasks: std::ops::Range<usize>, sc: &mut [f32]) {
        // SAFETY (every closure): this function is only entered when avx2, fma and f16c are available.
        self.run_generic(
            tasks,
            sc,
            |a, b| unsafe { avx2::dot(a, b) },
            |q, ks| unsafe { avx2::dot8(q, ks) },
            |w, m| unsafe { avx2::exp_sum(w, m) },
            |w, rows, out, inv| unsafe { avx2::weigh(w, rows, out, inv) },
        )
    }

    /// The tasks, with `dot` a query's dot product with one f16 key, `dot8` the same with eight keys (each
    /// bit-identical to `dot`), `exp_sum` [`exp_sum`] and `weigh` [`weigh`] or their vector versions.
    #[inline(always)]
    fn run_generic(
        &self,
        tasks: std::ops::Range<usize>,
        sc: &mut [f32],
        dot: impl Fn(&[f32], &[u16]) -> f32,
        dot8: impl Fn(&[f32], [&[u16]; 8]) -> [f32; 8],
        exp_sum: impl Fn(&mut [f32], f32) -> f32,
        weigh: impl Fn(&[f32], &ValueRows, &mut [f32], f32),
    ) {
        let Attention { q, kc, vc, pc, positions, mask, window, base, total, n, qd, kvd, vd, hd, hdv, .. } = *self;
        let (scores, rest) = sc.split_at_mut(total);
        // SAFETY: `rest` holds `total` floats; u32 has the size and alignment of f32 and any bits are valid.
        let slots = unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr() as *mut u32, total) };
        let mut listed_row = usize::MAX;
        let mut nv = 0;
        for task in tasks {
            let (j, h) = (task / self.n_head, task % self.n_head);
            let kvh = h / self.group;
            // 1. The visible slots in order (shared by the row's heads).
            if j != listed_row {
                listed_row = j;
                nv = 0;
                let pj = positions[j] as i64;
                let in_window = |s: usize| window.is_none_or(|w| pj - (pc[s] as i64) < w as i64);
                for s in 0..total {
                    let seen = s < base
                        || match mask {
                            Mask::Causal => s - base <= j,
                            Mask::Allowed(a) => a[j * n + s - base],
                        };
                    if seen && in_window(s) {
                        slots[nv] = s as u32;
                        nv += 1;
                    }
                }
            }
            let slots = &slots[..nv];
            let scores = &mut scores[..nv];
            // 2. Scores, eight keys at a time.
            let qv = &q[j * qd + h * hd..j * qd + (h + 1) * hd];
            let key = |s: u32| &kc[s as usize * kvd + kvh * hd..s as usize * kvd + (kvh + 1) * hd];
            let mut r = 0;
            while r + 8 <= nv {
                let d = dot8(qv, std::array::from_fn(|i| key(slots[r + i])));
                for i in 0..8 {
                    scores[r + i] = d[i] * self.scale;
                }
                r += 8;
            }
            for r in r..nv {
                scores[r] = dot(qv, key(slots[r])) * self.scale;
            }
            // 3. Softmax weights.
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let sum = exp_sum(scores, max);
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            // 4. The weighted values.
            // SAFETY: each task writes only its own (row, head) range of the output.
            let out = unsafe { std::slice::from_raw_parts_mut(self.att.get().add(j * self.att_d + h * hdv), hdv) };
            let rows = ValueRows { vc, slots, stride: vd, offset: kvh * hdv };
            weigh(scores, &rows, out, inv);
        }
    }
}

/// The value rows a task weighs: row `r` is `vc[slots[r] * stride + offset..][..out.len()]`.
pub(crate) struct ValueRows<'a> {
    vc: &'a [u16],
    slots: &'a [u32],
    stride: usize,
    offset: usize,
}

impl ValueRows<'_> {
    fn row(&self, r: usize, len: usize) -> &[u16] {
        let start = self.slots[r] as usize * self.stride + self.offset;
        &self.vc[start..start + len]
    }
}

const EXP_MIN: f32 = -87.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial on `[-ln 2 / 2, ln 2 / 2]`, highest degree first.
const EXP_POLY: [f32; 6] = [1.987_569_1e-4, 1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `e^x` for `x ≤ 0` (relative error ~1e-7; arguments below −87 give `e^−87`, still a normal float): `x = n ln 2
/// + r`, a degree-7 polynomial in `r`, times `2^n` built in the exponent bits. The AVX2 version performs the
/// same operations.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Replaces every score `s` by `e^(s − max)` and returns their sum, accumulated in eight lanes by index and the
/// lanes added in order.
fn exp_sum(w: &mut [f32], max: f32) -> f32 {
    let mut lanes = [0f32; 8];
    for (r, v) in w.iter_mut().enumerate() {
        *v = exp_nonpositive(*v - max);
        lanes[r % 8] += *v;
    }
    lanes[1..].iter().fold(lanes[0], |s, &l| s + l)
}

/// `out = inv · Σ_r w[r] · rows[r]`, each element summed in two partial sums (even and odd `r`, fused
/// multiply-adds) that are then added.
fn weigh(w: &[f32], rows: &ValueRows, out: &mut [f32], inv: f32) {
    let len = out.len();
    out.fill(0.0);
    let mut odd = [0f32; 64];
    for c0 in (0..len).step_by(64) {
        let c1 = (c0 + 64).min(len);
        let odd = &mut odd[..c1 - c0];
        odd.fill(0.0);
        for (r, &wr) in w.iter().enumerate() {
            let v = &rows.row(r, len)[c0..c1];
            let acc = if r % 2 == 0 { &mut out[c0..c1] } else { &mut odd[..] };
            acc.iter_mut().zip(v).for_each(|(a, &x)| *a = wr.mul_add(f16_to_f32(x), *a));
        }
        out[c0..c1].iter_mut().zip(odd.iter()).for_each(|(o, &b)| *o = (*o + b) * inv);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C versions of the attention's kernels, each bit-identical to the portable one.

    use super::{ValueRows, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO};
    use crate::blocks::f16_to_f32;
    use std::arch::x86_64::*;

    /// Eight f16 values (bits at `p`) as f32 (exact).
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    unsafe fn load_f16x8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// [`crate::blocks::dot_f16`] with explicit vectors: the same eight lane accumulators (multiply, then add; no
    /// FMA) and the same final summation order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dot(a: &[f32], b: &[u16]) -> f32 {
        let len = a.len().min(b.len());
        let chunks = a.len() / 8;
        assert!(chunks * 8 <= len);
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            acc = _mm256_add_ps(
                acc,
                _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr().add(c * 8)), load_f16x8(b.as_ptr().add(c * 8))),
            );
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut sum: f32 = lanes.iter().sum();
        for i in chunks * 8..a.len() {
            sum += a[i] * f16_to_f32(b[i]);
        }
        sum
    }

    /// [`dot`] of one query `q` with eight keys, bit-identical to eight calls: the same lane accumulators, then
    /// the eight reductions at once (an 8 × 8 transpose, lanes added in the same order), then the same scalar
    /// tail. Eight independent accumulation chains instead of one keep the adder busy.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dot8(q: &[f32], ks: [&[u16]; 8]) -> [f32; 8] {
        let len = ks.iter().fold(q.len(), |m, k| m.min(k.len()));
        let chunks = q.len() / 8;
        assert!(chunks * 8 <= len);
        let mut acc = [_mm256_setzero_ps(); 8];
        for c in 0..chunks {
            let x = _mm256_loadu_ps(q.as_ptr().add(c * 8));
            for (acc, k) in acc.iter_mut().zip(&ks) {
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, load_f16x8(k.as_ptr().add(c * 8))));
            }
        }
        // Transpose: t[l] holds lane l of the eight accumulators.
        let (u0, u1) = (_mm256_unpacklo_ps(acc[0], acc[1]), _mm256_unpackhi_ps(acc[0], acc[1]));
        let (u2, u3) = (_mm256_unpacklo_ps(acc[2], acc[3]), _mm256_unpackhi_ps(acc[2], acc[3]));
        let (u4, u5) = (_mm256_unpacklo_ps(acc[4], acc[5]), _mm256_unpackhi_ps(acc[4], acc[5]));
        let (u6, u7) = (_mm256_unpacklo_ps(acc[6], acc[7]), _mm256_unpackhi_ps(acc[6], acc[7]));
        let (v0, v1) = (_mm256_shuffle_ps::<0x44>(u0, u2), _mm256_shuffle_ps::<0xEE>(u0, u2));
        let (v2, v3) = (_mm256_shuffle_ps::<0x44>(u1, u3), _mm256_shuffle_ps::<0xEE>(u1, u3));
        let (v4, v5) = (_mm256_shuffle_ps::<0x44>(u4, u6), _mm256_shuffle_ps::<0xEE>(u4, u6));
        let (v6, v7) = (_mm256_shuffle_ps::<0x44>(u5, u7), _mm256_shuffle_ps::<0xEE>(u5, u7));
        let t = [
            _mm256_permute2f128_ps::<0x20>(v0, v4),
            _mm256_permute2f128_ps::<0x20>(v1, v5),
            _mm256_permute2f128_ps::<0x20>(v2, v6),
            _mm256_permute2f128_ps::<0x20>(v3, v7),
            _mm256_permute2f128_ps::<0x31>(v0, v4),
            _mm256_permute2f128_ps::<0x31>(v1, v5),
            _mm256_permute2f128_ps::<0x31>(v2, v6),
            _mm256_permute2f128_ps::<0x31>(v3, v7),
        ];
        let sum = t[1..].iter().fold(t[0], |s, &l| _mm256_add_ps(s, l));
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), sum);
        for (o, k) in out.iter_mut().zip(&ks) {
            for i in chunks * 8..q.len() {
                *o += q[i] * f16_to_f32(k[i]);
            }
        }
        out
    }

    /// [`super::exp_nonpositive`] of eight values.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    }

    /// [`super::exp_sum`]: the same eight lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn exp_sum(w: &mut [f32], max: f32) -> f32 {
        let chunks = w.len() / 8;
        let (m, mut acc) = (_mm256_set1_ps(max), _mm256_setzero_ps());
        for c in 0..chunks {
            let p = w.as_mut_ptr().add(c * 8);
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
            _mm256_storeu_ps(p, e);
            acc = _mm256_add_ps(acc, e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for (r, v) in w.iter_mut().enumerate().skip(chunks * 8) {
            *v = super::exp_nonpositive(*v - max);
            lanes[r % 8] += *v;
        }
        lanes[1..].iter().fold(lanes[0], |s, &l| s + l)
    }

    /// [`super::weigh`]: per element the same two partial sums of fused multiply-adds. Blocks of 32 elements
    /// (four vectors × two partial sums in registers across all rows), then single vectors, then scalars.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn weigh(w: &[f32], rows: &ValueRows, out: &mut [f32], inv: f32) {
        let len = out.len();
        let (nr, mut c0) = (w.len(), 0);
        // Every row checked once, then read without bounds checks in the loops below.
        assert!(w.len() <= rows.slots.len());
        assert!(rows.slots[..w.len()].iter().all(|&s| s as usize * rows.stride + rows.offset + len <= rows.vc.len()));
        let (vp, slots) = (rows.vc.as_ptr().add(rows.offset), rows.slots.as_ptr());
        let base = |r: usize| vp.add(*slots.add(r) as usize * rows.stride);
        let inv_v = _mm256_set1_ps(inv);
        macro_rules! block {
            ($nv:literal) => {{
                let mut even = [_mm256_setzero_ps(); $nv];
                let mut odd = [_mm256_setzero_ps(); $nv];
                let mut r = 0;
                while r + 2 <= nr {
                    let (p0, p1) = (base(r).add(c0), base(r + 1).add(c0));
                    let (w0, w1) = (_mm256_set1_ps(w[r]), _mm256_set1_ps(w[r + 1]));
                    for i in 0..$nv {
                        even[i] = _mm256_fmadd_ps(w0, load_f16x8(p0.add(8 * i)), even[i]);
                        odd[i] = _mm256_fmadd_ps(w1, load_f16x8(p1.add(8 * i)), odd[i]);
                    }
                    r += 2;
                }
                if r < nr {
                    let (p0, w0) = (base(r).add(c0), _mm256_set1_ps(w[r]));
                    for i in 0..$nv {
                        even[i] = _mm256_fmadd_ps(w0, load_f16x8(p0.add(8 * i)), even[i]);
                    }
                }
                for i in 0..$nv {
                    _mm256_storeu_ps(
                        out.as_mut_ptr().add(c0 + 8 * i),
                        _mm256_mul_ps(_mm256_add_ps(even[i], odd[i]), inv_v),
                    );
                }
                c0 += 8 * $nv;
            }};
        }
        while c0 + 32 <= len {
            block!(4);
        }
        while c0 + 8 <= len {
            block!(1);
        }
        for c in c0..len {
            let (mut even, mut odd) = (0f32, 0f32);
            for (r, &wr) in w.iter().enumerate() {
                let acc = if r % 2 == 0 { &mut even } else { &mut odd };
                *acc = wr.mul_add(f16_to_f32(rows.row(r, len)[c]), *acc);
            }
            out[c] = (even + odd) * inv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(mut state: u64) -> impl FnMut() -> f32 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 22) as f32 - 2.0
        }
    }

    #[test]
    fn exp_is_accurate_for_nonpositive_arguments() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -(i as f32) * 4.3e-4;
            let want = (x as f64).exp();
            worst = worst.max(((exp_nonpositive(x) as f64 - want) / want).abs());
        }
        assert!(worst < 3e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1e30) > 0.0 && exp_nonpositive(-1e30).is_normal());
    }

    /// The attention's vector kernels equal the portable ones bit for bit: dot products (eight at once and one
    /// at a time), the exponentials and their sum, and the weighted values (with and without scalar tails).
    #[test]
    fn attention_vector_kernels_are_bit_identical() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            let mut next = xorshift(0x2545_f491_4f6c_dd1d);
            let f16 = |v: f32| half::f16::from_f32(v).to_bits();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for len in [64, 72, 29, 8, 256, 40] {
                let q: Vec<f32> = (0..len).map(|_| next()).collect();
                let keys: Vec<Vec<u16>> = (0..8).map(|_| (0..len).map(|_| f16(next() * 1e3)).collect()).collect();
                // SAFETY: the CPU has avx2, fma and f16c (checked above).
                let got = unsafe { avx2::dot8(&q, std::array::from_fn(|i| &keys[i][..])) };
                for (g, k) in got.iter().zip(&keys) {
                    let one = unsafe { avx2::dot(&q, k) };
                    assert_eq!(g.to_bits(), one.to_bits(), "len {len}: {g} vs {one}");
                    assert_eq!(g.to_bits(), dot_f16(&q, k).to_bits(), "len {len}");
                }
                for nr in [1, 2, 7, 8, 9, 33, 100] {
                    let scores: Vec<f32> = (0..nr).map(|_| next() * 20.0).collect();
                    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                    let (mut w, mut got) = (scores.clone(), scores);
                    let sum = exp_sum(&mut w, max);
                    // SAFETY: as above.
                    let sum_v = unsafe { avx2::exp_sum(&mut got, max) };
                    assert_eq!(bits(&got), bits(&w), "len {len} rows {nr}");
                    assert_eq!(sum.to_bits(), sum_v.to_bits(), "len {len} rows {nr}");
                    // Value rows at scattered slots of a cache 3 heads wide.
                    let stride = 3 * len;
                    let vc: Vec<u16> = (0..(nr + 5) * stride).map(|_| f16(next())).collect();
                    let slots: Vec<u32> = (0..nr as u32).map(|r| (r * 7 + 3) % (nr as u32 + 5)).collect();
                    let rows = ValueRows { vc: &vc, slots: &slots, stride, offset: len };
                    let (mut want, mut got) = (vec![0f32; len], vec![1f32; len]);
                    weigh(&w, &rows, &mut want, 1.0 / sum);
                    // SAFETY: as above.
                    unsafe { avx2::weigh(&w, &rows, &mut got, 1.0 / sum) };
                    assert_eq!(bits(&got), bits(&want), "len {len} rows {nr}");
                }
            }
        }
    }
}
