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
    /// Q8_0/Q8_1, blocks taken in pairs (A, B) = (2k, 2k+1): per pair 64 bytes
    /// `[A y0..16, B y0..16, A y16..32, B y16..32]` (one nibble-unpacked register of two Q4 blocks),
    /// **interleaved across the token rows**: pair `k` of token `t` starts at `(k * stride + t) * 64`, so the
    /// rows of a tile sit next to each other (one pointer, constant offsets). An odd last block keeps the
    /// plain layout, at `npairs * stride * 64 + t * 32`.
    pub qp: &'a [i8],
    /// Q8_0: the pairs widened to i16 for `vpmaddwd`, interleaved as `qp`: pair `k` of token `t` at
    /// `(k * stride + t) * 64`, as four 16-lane groups `[A e0..8, B e0..8]`, `[A e8..16, B e8..16]`,
    /// `[A e16..24, B e16..24]`, `[A e24..32, B e24..32]` (an odd last block uses `qp`).
    pub qw: &'a [i16],
    /// Q8_0/Q8_1: per pair 8 floats `[dA x4, dB x4]`, interleaved as `qp`: at `(k * stride + t) * 8`.
    pub dp4: &'a [f32],
    /// Q8_0: per token and block, `−32·Σy` at `t * nb + b` — where the head screen's block sums start, taking
    /// off the `+ 32` its unsigned 6-bit values carry ([`crate::screen`]).
    pub zb: &'a [i32],
    pub bsums: &'a [i16],
    pub f: &'a [f32],
    pub cols: usize,
    pub nb: usize,
    /// Token rows the interleaved buffers (`qp`, `dp4`) were laid out for.
    pub stride: usize,
}

/// Growable buffers behind [`Acts`].
#[derive(Default)]
pub(crate) struct ActBuffers {
    pub qs: Vec<i8>,
    pub qu: Vec<u8>,
    pub d: Vec<f32>,
    pub dexp: Vec<f32>,
    pub s: Vec<f32>,
    pub qp: Vec<i8>,
    pub qw: Vec<i16>,
    pub dp4: Vec<f32>,
    pub zb: Vec<i32>,
    pub bsums: Vec<i16>,
    pub f: Vec<f32>,
    /// Token rows of the current layout (set by `reserve`).
    pub stride: usize,
}

/// Raw pointers into the [`ActBuffers`] (taken once, so threads never form references to the vectors
/// themselves), shared by the threads of a parallel quantization, each writing disjoint token rows.
#[derive(Clone, Copy)]
pub(crate) struct ActPtr {
    qs: (*mut i8, usize),
    qu: (*mut u8, usize),
    d: (*mut f32, usize),
    dexp: (*mut f32, usize),
    s: (*mut f32, usize),
    qp: (*mut i8, usize),
    qw: (*mut i16, usize),
    dp4: (*mut f32, usize),
    zb: (*mut i32, usize),
    bsums: (*mut i16, usize),
    f: (*mut f32, usize),
}

fn raw<T>(v: &mut [T]) -> (*mut T, usize) {
    (v.as_mut_ptr(), v.len())
}

impl ActPtr {
    fn new(b: &mut ActBuffers) -> ActPtr {
        ActPtr {
            qs: raw(&mut b.qs),
            qu: raw(&mut b.qu),
            d: raw(&mut b.d),
            dexp: raw(&mut b.dexp),
            s: raw(&mut b.s),
            qp: raw(&mut b.qp),
            qw: raw(&mut b.qw),
            dp4: raw(&mut b.dp4),
            zb: raw(&mut b.zb),
            bsums: raw(&mut b.bsums),
            f: raw(&mut b.f),
        }
    }
}

/// `len` elements of the buffer `(ptr, total)` from `at` (bounds-checked).
///
/// # Safety
/// The buffer must be live and the range not accessed by anyone else during the borrow.
unsafe fn part<'a, T>(buf: (*mut T, usize), at: usize, len: usize) -> &'a mut [T] {
    assert!(at + len <= buf.1, "activation buffer not reserved");
    std::slice::from_raw_parts_mut(buf.0.add(at), len)
}
// SAFETY: used only by `ActBuffers::quantize_tokens_parallel`, where each thread quantizes a disjoint
// range of token rows (disjoint elements of every buffer) and the buffers are not resized meanwhile.
unsafe impl Send for ActPtr {}
unsafe impl Sync for ActPtr {}

fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

impl ActBuffers {
    /// Makes room for `n_tokens` rows of `cols` elements in format `kind` (never shrinks) and lays the
    /// interleaved buffers out for `n_tokens` rows.
    pub fn reserve(&mut self, kind: ActKind, n_tokens: usize, cols: usize) {
        self.stride = n_tokens;
        match kind {
            ActKind::F32 => {}
            ActKind::F16 | ActKind::BF16 => grow(&mut self.f, n_tokens * cols),
            ActKind::Q8_0 | ActKind::Q8_1 => {
                grow(&mut self.qs, n_tokens * cols);
                grow(&mut self.qu, n_tokens * cols);
                grow(&mut self.d, n_tokens * cols / QK);
                grow(&mut self.dexp, n_tokens * cols / QK * 8);
                grow(&mut self.s, n_tokens * cols / QK);
                grow(&mut self.qp, n_tokens * cols);
                if kind == ActKind::Q8_0 {
                    grow(&mut self.qw, n_tokens * cols);
                    grow(&mut self.zb, n_tokens * cols / QK);
                }
                grow(&mut self.dp4, n_tokens * cols / QK * 4);
            }
            ActKind::Q8K => {
                grow(&mut self.qs, n_tokens * cols);
                grow(&mut self.d, n_tokens * cols / QK_K);
                grow(&mut self.bsums, n_tokens * cols / 16);
            }
        }
    }

    /// Quantizes token rows `tokens` of `x` (each `cols` long) into the buffers. `reserve` must have
    /// been called for at least `tokens.end` rows (and the layout is the one `reserve` chose).
    pub fn quantize_tokens(&mut self, kind: ActKind, x: &[f32], cols: usize, tokens: std::ops::Range<usize>) {
        assert!(tokens.end <= self.stride || tokens.is_empty(), "activation buffer reserved for fewer rows");
        let (me, stride) = (ActPtr::new(self), self.stride);
        for t in tokens {
            // SAFETY: `me` points into `self`, borrowed mutably for this call; one row at a time.
            unsafe { quantize_token(me, kind, x, cols, t, stride) };
        }
    }

    /// [`quantize_tokens`](Self::quantize_tokens) of rows `0..n_tokens`, split across the pool's
    /// threads when there are enough rows to pay for the hand-off. Same results.
    pub fn quantize_tokens_parallel(
        &mut self,
        pool: &crate::ThreadPool,
        kind: ActKind,
        x: &[f32],
        cols: usize,
        n_tokens: usize,
    ) {
        // Roughly 1 µs per 1k elements on one thread: split only when each thread gets several µs.
        if pool.n_threads() == 1 || n_tokens < 2 || n_tokens * cols < 8 * 1024 || kind == ActKind::F32 {
            self.quantize_tokens(kind, x, cols, 0..n_tokens);
            return;
        }
        assert!(n_tokens <= self.stride, "activation buffer reserved for fewer rows");
        let (me, stride) = (ActPtr::new(self), self.stride);
        crate::pool::parallel_for(pool, n_tokens, |range| {
            for t in range {
                // SAFETY: every token row is quantized by exactly one thread and writes only that
                // row's elements; `self` is exclusively borrowed for the duration of this call.
                unsafe { quantize_token(me, kind, x, cols, t, stride) };
            }
        });
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
        Acts {
            qs: &self.qs,
            qu: &self.qu,
            d: &self.d,
            dexp: &self.dexp,
            s: &self.s,
            qp: &self.qp,
            qw: &self.qw,
            dp4: &self.dp4,
            zb: &self.zb,
            bsums: &self.bsums,
            f,
            cols,
            nb,
            stride: self.stride,
        }
    }
}

/// Quantizes token row `t` of `x` into the buffers behind `me` (see [`ActBuffers::quantize_tokens`]), the
/// interleaved buffers laid out for `stride` rows.
///
/// # Safety
/// `me` must point at live buffers reserved for `stride > t` rows, and no other thread may access
/// row `t`'s elements (or resize the buffers) during the call.
unsafe fn quantize_token(me: ActPtr, kind: ActKind, x: &[f32], cols: usize, t: usize, stride: usize) {
    let b = me;
    let xr = &x[t * cols..(t + 1) * cols];
    match kind {
        ActKind::F32 => {}
        ActKind::F16 => {
            let f = part(b.f, t * cols, cols);
            for (o, &v) in f.iter_mut().zip(xr) {
                *o = f16_to_f32(f32_to_f16(v));
            }
        }
        ActKind::BF16 => {
            let f = part(b.f, t * cols, cols);
            for (o, &v) in f.iter_mut().zip(xr) {
                *o = bf16_to_f32(f32_to_bf16(v));
            }
        }
        ActKind::Q8_0 | ActKind::Q8_1 => {
            let nb = cols / QK;
            let qs = part(b.qs, t * cols, cols);
            let d = part(b.d, t * nb, nb);
            let s = part(b.s, t * nb, nb);
            quantize_q8_row(xr, qs, d, s, kind == ActKind::Q8_1);
            let qu = part(b.qu, t * cols, cols);
            for (u, &q) in qu.iter_mut().zip(qs.iter()) {
                *u = (q as u8) ^ 0x80;
            }
            if kind == ActKind::Q8_0 {
                for (z, q) in part(b.zb, t * nb, nb).iter_mut().zip(qs.chunks_exact(QK)) {
                    *z = -32 * q.iter().map(|&v| v as i32).sum::<i32>();
                }
            }
            let dexp = part(b.dexp, t * nb * 8, nb * 8);
            for (e, &dv) in dexp.chunks_exact_mut(8).zip(d.iter()) {
                e.fill(dv);
            }
            let npairs = nb / 2;
            for k in 0..npairs {
                let (ya, yb) = (&qs[64 * k..64 * k + 32], &qs[64 * k + 32..64 * k + 64]);
                let o = part(b.qp, (k * stride + t) * 64, 64);
                o[..16].copy_from_slice(&ya[..16]);
                o[16..32].copy_from_slice(&yb[..16]);
                o[32..48].copy_from_slice(&ya[16..]);
                o[48..].copy_from_slice(&yb[16..]);
                let (da, db) = (d[2 * k], d[2 * k + 1]);
                part(b.dp4, (k * stride + t) * 8, 8).copy_from_slice(&[da, da, da, da, db, db, db, db]);
                if kind == ActKind::Q8_0 {
                    let o = part(b.qw, (k * stride + t) * 64, 64);
                    for g in 0..4 {
                        for e in 0..8 {
                            o[16 * g + e] = ya[8 * g + e] as i16;
                            o[16 * g + 8 + e] = yb[8 * g + e] as i16;
                        }
                    }
                }
            }
            if nb % 2 == 1 {
                part(b.qp, npairs * stride * 64 + t * 32, 32).copy_from_slice(&qs[cols - 32..]);
            }
        }
        ActKind::Q8K => {
            let nb = cols / QK_K;
            let qs = part(b.qs, t * cols, cols);
            let d = part(b.d, t * nb, nb);
            let bsums = part(b.bsums, t * nb * 16, nb * 16);
            quantize_q8k_row(xr, qs, d, bsums);
        }
    }
}

/// Q8_0 / Q8_1 quantization of one row as ggml's x86 `quantize_row_q8_0/1`: `d = amax / 127` stored as
/// f16, `q = round_half_even(x * (127 / amax))`; for Q8_1 `s = f16(d * sum(q))` with the unrounded `d`.
/// For Q8_0 `s` receives `f16(d) * sum(q)` (our kernels use it; ggml's Q8_0 has no `s`).
pub(crate) fn quantize_q8_row(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32], q8_1: bool) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::Isa::Avx2.available() {
        // SAFETY: the CPU has AVX2/FMA/F16C.
        unsafe { quantize_q8_row_avx2(x, qs, d_out, s_out, q8_1) };
        return;
    }
    quantize_q8_row_scalar(x, qs, d_out, s_out, q8_1)
}

/// [`quantize_q8_row`] with AVX2, as ggml's x86 build: the same max, `d`, `id`, products rounded to
/// nearest-even (`vroundps`) and integer sums, so the results are bit-identical to the scalar version.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_row_avx2(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32], q8_1: bool) {
    use std::arch::x86_64::*;
    let nb = x.len() / QK;
    assert!(qs.len() >= nb * QK && d_out.len() >= nb && s_out.len() >= nb);
    let sign_bit = _mm256_set1_ps(-0.0);
    for b in 0..nb {
        let p = x.as_ptr().add(b * QK);
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let mut m = _mm256_andnot_ps(sign_bit, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign_bit, *vi));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        let amax = _mm_cvtss_f32(m4);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let r: [__m256i; 4] = std::array::from_fn(|i| {
            _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                v[i], idv,
            )))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
        let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01_00_11_10>(s4));
        let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b10_11_00_01>(s4));
        let isum = _mm_cvtsi128_si32(s4);
        // Pack to bytes in order (packs work per 128-bit lane, then fix the lane order).
        let w01 = _mm256_packs_epi32(r[0], r[1]);
        let w23 = _mm256_packs_epi32(r[2], r[3]);
        let bytes = _mm256_packs_epi16(w01, w23);
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK) as *mut __m256i, bytes);
        let d16 = f16_to_f32(f32_to_f16(d));
        d_out[b] = d16;
        s_out[b] = if q8_1 { f16_to_f32(f32_to_f16(d * isum as f32)) } else { d16 * isum as f32 };
    }
}

/// [`quantize_q8_row`] without SIMD (the reference).
pub(crate) fn quantize_q8_row_scalar(x: &[f32], qs: &mut [i8], d_out: &mut [f32], s_out: &mut [f32], q8_1: bool) {
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
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::Isa::Avx2.available() {
        // SAFETY: the CPU has AVX2/FMA/F16C.
        unsafe { quantize_q8k_row_avx2(x, qs, d_out, bsums) };
        return;
    }
    quantize_q8k_row_scalar(x, qs, d_out, bsums)
}

/// [`quantize_q8k_row`] with AVX2, bit-identical to the scalar version: the same `max` (the first element
/// of largest magnitude), the same `iscale`, products rounded to nearest-even by `vroundps` as
/// `nearest_int` does, the same clamp (saturating packs; the products never leave [-127.5, 127.5]) and
/// integer group sums. (Without this the scalar loop calls libm's `rintf` per element: 6% of a Gemma
/// 8-row forward in perf.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8k_row_avx2(x: &[f32], qs: &mut [i8], d_out: &mut [f32], bsums: &mut [i16]) {
    use std::arch::x86_64::*;
    let nb = x.len() / QK_K;
    assert!(qs.len() >= nb * QK_K && d_out.len() >= nb && bsums.len() >= nb * 16);
    let sign_bit = _mm256_set1_ps(-0.0);
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for b in 0..nb {
        let p = x.as_ptr().add(b * QK_K);
        // max(|v|, m): a NaN element leaves m unchanged, as the scalar `>` comparison does.
        let mut m = _mm256_setzero_ps();
        for i in 0..QK_K / 8 {
            m = _mm256_max_ps(_mm256_andnot_ps(sign_bit, _mm256_loadu_ps(p.add(8 * i))), m);
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        let xb = &x[b * QK_K..(b + 1) * QK_K];
        if amax == 0.0 {
            d_out[b] = 0.0;
            qs[b * QK_K..(b + 1) * QK_K].fill(0);
            bsums[b * 16..(b + 1) * 16].fill(0);
            continue;
        }
        let max = *xb.iter().find(|v| v.abs() == amax).unwrap_or(&amax);
        let iscale = -127.0 / max;
        let iv = _mm256_set1_ps(iscale);
        for g in 0..QK_K / 32 {
            let r: [__m256i; 4] = std::array::from_fn(|i| {
                let v = _mm256_mul_ps(iv, _mm256_loadu_ps(p.add(32 * g + 8 * i)));
                _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
            });
            let w01 = _mm256_packs_epi32(r[0], r[1]);
            let w23 = _mm256_packs_epi32(r[2], r[3]);
            let bytes = _mm256_packs_epi16(w01, w23);
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // Saturating packs clamp at 127 like `.min(127)`; the low side never goes below -127.
            _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK_K + 32 * g) as *mut __m256i, bytes);
            // Sums of the two groups of 16: byte pairs, then quads, then within each 128-bit half.
            let quads = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, bytes), ones16);
            let h = _mm256_hadd_epi32(quads, quads);
            let h = _mm256_hadd_epi32(h, h);
            bsums[b * 16 + 2 * g] = _mm256_cvtsi256_si32(h) as i16;
            bsums[b * 16 + 2 * g + 1] = _mm_cvtsi128_si32(_mm256_extracti128_si256::<1>(h)) as i16;
        }
        d_out[b] = 1.0 / iscale;
    }
}

/// [`quantize_q8k_row`] without SIMD (the reference).
pub(crate) fn quantize_q8k_row_scalar(x: &[f32], qs: &mut [i8], d_out: &mut [f32], bsums: &mut [i16]) {
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
    fn q8_simd_quantization_is_bit_identical_to_scalar() {
        let mut rng = Rng(99);
        for n in [32usize, 64, 96, 576] {
            for scale in [1e-6f32, 1.0, 300.0] {
                let mut x: Vec<f32> = (0..n).map(|_| rng.f32() * scale).collect();
                // Exact halves after scaling, zeros, a block of zeros.
                x[1] = 0.0;
                x[5] = -x[7];
                if n >= 64 {
                    x[32..64].fill(0.0);
                }
                for q8_1 in [false, true] {
                    let nb = n / 32;
                    let (mut qa, mut da, mut sa) = (vec![0i8; n], vec![0.0; nb], vec![0.0; nb]);
                    let (mut qb, mut db, mut sb) = (vec![0i8; n], vec![0.0; nb], vec![0.0; nb]);
                    quantize_q8_row(&x, &mut qa, &mut da, &mut sa, q8_1);
                    quantize_q8_row_scalar(&x, &mut qb, &mut db, &mut sb, q8_1);
                    assert_eq!(qa, qb);
                    assert_eq!(
                        da.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        db.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                    assert_eq!(
                        sa.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        sb.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                }
            }
        }
        // Ties: values that land exactly on .5 after scaling round to even in both.
        let mut x = vec![0.0f32; 32];
        x[0] = 127.0;
        for (i, v) in x.iter_mut().enumerate().skip(1) {
            *v = i as f32 + 0.5;
        }
        let (mut qa, mut da, mut sa) = (vec![0i8; 32], vec![0.0; 1], vec![0.0; 1]);
        let (mut qb, mut db, mut sb) = (vec![0i8; 32], vec![0.0; 1], vec![0.0; 1]);
        quantize_q8_row(&x, &mut qa, &mut da, &mut sa, true);
        quantize_q8_row_scalar(&x, &mut qb, &mut db, &mut sb, true);
        assert_eq!((qa, da, sa), (qb, db, sb));
    }

    #[test]
    fn q8_k_simd_quantization_is_bit_identical_to_scalar() {
        let mut rng = Rng(1234);
        for scale in [1e-6f32, 1.0, 300.0] {
            let mut x: Vec<f32> = (0..1024).map(|_| rng.f32() * scale).collect();
            x[256..512].fill(0.0);
            // Ties of the largest magnitude with both signs: the first one decides.
            x[600] = -4.0 * scale;
            x[700] = 4.0 * scale;
            x[800] = 2.5 * scale;
            x[900] = -2.5 * scale;
            let (mut qa, mut da, mut ba) = (vec![0i8; 1024], vec![0.0; 4], vec![0i16; 64]);
            let (mut qb, mut db, mut bb) = (vec![0i8; 1024], vec![0.0; 4], vec![0i16; 64]);
            quantize_q8k_row(&x, &mut qa, &mut da, &mut ba);
            quantize_q8k_row_scalar(&x, &mut qb, &mut db, &mut bb);
            assert_eq!(qa, qb);
            assert_eq!(ba, bb);
            assert_eq!(
                da.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                db.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
        // Exact halves after scaling round to even in both.
        let mut x = vec![0.0f32; 256];
        x[0] = -127.0;
        for (i, v) in x.iter_mut().enumerate().skip(1) {
            *v = (i % 120) as f32 + 0.5;
        }
        let (mut qa, mut da, mut ba) = (vec![0i8; 256], vec![0.0; 1], vec![0i16; 16]);
        let (mut qb, mut db, mut bb) = (vec![0i8; 256], vec![0.0; 1], vec![0i16; 16]);
        quantize_q8k_row(&x, &mut qa, &mut da, &mut ba);
        quantize_q8k_row_scalar(&x, &mut qb, &mut db, &mut bb);
        assert_eq!((qa, da, ba), (qb, db, bb));
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

/// Quantizes f32 weights to Q8_0 blocks as ggml's reference quantizer does (`d = max|x| / 127` stored as f16,
/// `q = round(x / d)`), for weights made at run time (e.g. a draft head read from safetensors).
///
/// # Panics
/// If `x.len()` is not a multiple of 32.
pub fn quantize_q8_0_weights(x: &[f32]) -> Vec<u8> {
    assert!(x.len() % QK == 0, "quantize_q8_0_weights: {} values is not a multiple of {QK}", x.len());
    let mut out = Vec::with_capacity(x.len() / QK * (QK + 2));
    for block in x.chunks_exact(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}
