//! Exact greedy argmax over a Q8_0 output head without reading all of it: a **head screen**.
//!
//! Greedy decoding needs only the argmax of the logits, and the head is the largest matrix of a small model
//! (Gemma 3 270M: 262,144 × 640 Q8_0 = 178 MB per token, ~65% of a decode step). [`HeadScreen`] keeps a
//! 6-bit copy of the head (26 bytes per 32 weights against Q8_0's 34) and, per row `r`, a bound `c_r ≥
//! ‖w_r − ŵ_r‖` plus a margin for float rounding. With the activation quantized to Q8_0 exactly as the full
//! product does (`x̂`), the exact logit `w_r·x̂` and the screened one `ŵ_r·x̂` differ by at most `c_r·‖x̂‖`
//! (Cauchy–Schwarz). So every row whose upper bound `ŵ_r·x̂ + c_r‖x̂‖` reaches the best lower bound
//! `max_s ŵ_s·x̂ − c_s‖x̂‖` may be the argmax; only those **survivors** (a few dozen rows on the default
//! models) get the exact Q8_0 product, with the same kernel as the full head, and the first maximum among
//! them is the full head's argmax — the same token, ties included, not an approximation.
//!
//! Why 6 bits (measured in session 16 by simulating symmetric b-bit copies of the real heads over the llama.cpp
//! reference sequences, with the same Cauchy–Schwarz bound): survivors per token, mean (median), were SmolLM2
//! 73 (15) at 6 bits, 5,043 (2,463) at 5 and 45,981 of 49,152 at 4; Gemma 67 (29), 2,428 (974) and 154,082 of
//! 262,144. The bound grows with the step size, and the top of the logit distribution is dense enough that one
//! bit fewer multiplies the survivors by ~50. Handling the 32 columns where `‖x‖²` concentrates (they hold ~55% of
//! it on both models) outside the bound brings 5 bits back to 65 (SmolLM2) / 79 (Gemma) survivors, but with
//! those columns' corrections stored the rows shrink by only ~10%: not pursued.
//!
//! Layout: pairs of 32-weight blocks A and B (64 weights, 52 bytes): f16 scales `dA`, `dB`; 32 bytes of low
//! nibbles (byte `m < 16`: `A[m] | A[16+m] << 4`, byte `16 + m`: the same for B) — so masking and shifting give
//! `[A0..16, B0..16]` and `[A16..32, B16..32]`, the order of the activations' pair layout (`Acts::qp`); 16 bytes
//! of high bit pairs (byte `m`: bits 0–1 of `A[m]`, 2–3 of `B[m]`, 4–5 of `A[16+m]`, 6–7 of `B[16+m]`). Values
//! are stored as `q + 32` with `q ∈ [−32, 31]` (the weight is `d·q`); the kernels take the `+ 32` off with the
//! activations' precomputed sums (`Acts::zp`). Rows need a whole number of pairs (`cols % 64 == 0`).

use crate::blocks::{f16_to_f32, f32_to_f16, Q8_0_BYTES, QK};
use crate::kernel::{row_kernel, Isa, Kernel};
use crate::matmul::{product, RawRows};
use crate::pool::{split_range, ThreadPool};
use crate::quantize::ActKind;
use crate::{KernelError, Layout, MatmulScratch, QMatrix};
use gguf::GgmlType;

/// Bytes per pair of 32-weight blocks of the screen.
pub(crate) const PAIR_BYTES: usize = 52;

/// Survivors per token above which their exact products are split across the pool.
const PARALLEL_SURVIVORS: usize = 64;

/// The 64 stored values (`q + 32`, 0..=63) of one pair: block A's 32, then block B's.
pub(crate) fn unpack(b: &[u8]) -> [u8; 64] {
    let mut q = [0u8; 64];
    for m in 0..16 {
        let (la, lb, h) = (b[4 + m], b[20 + m], b[36 + m]);
        q[m] = (la & 0x0F) | (h & 3) << 4;
        q[32 + m] = (lb & 0x0F) | (h >> 2 & 3) << 4;
        q[16 + m] = (la >> 4) | (h >> 4 & 3) << 4;
        q[48 + m] = (lb >> 4) | (h >> 6) << 4;
    }
    q
}

/// One pair from the scales' f16 bits and 64 stored values (`q + 32`, each < 64; A's 32 then B's).
fn pack(da: u16, db: u16, q: &[u8; 64]) -> [u8; PAIR_BYTES] {
    let mut b = [0u8; PAIR_BYTES];
    b[..2].copy_from_slice(&da.to_le_bytes());
    b[2..4].copy_from_slice(&db.to_le_bytes());
    for m in 0..16 {
        let (a0, a1, b0, b1) = (q[m], q[16 + m], q[32 + m], q[48 + m]);
        b[4 + m] = (a0 & 0x0F) | (a1 & 0x0F) << 4;
        b[20 + m] = (b0 & 0x0F) | (b1 & 0x0F) << 4;
        b[36 + m] = (a0 >> 4 & 3) | (b0 >> 4 & 3) << 2 | (a1 >> 4 & 3) << 4 | (b1 >> 4 & 3) << 6;
    }
    b
}

/// A 6-bit screen of a Q8_0 head with per-row error bounds (see the module docs).
pub struct HeadScreen {
    data: Vec<u8>,
    rows: usize,
    cols: usize,
    /// Per row: `‖w_r − ŵ_r‖` plus the float-rounding margin of both products.
    bound: Vec<f32>,
}

impl HeadScreen {
    /// Builds the screen of `w` (Q8_0, row-major), on up to `threads` threads.
    pub fn new(w: &QMatrix, threads: usize) -> Result<HeadScreen, KernelError> {
        if w.ty != GgmlType::Q8_0 || w.layout != Layout::Rows {
            return Err(KernelError::UnsupportedType(w.ty.name()));
        }
        let (rows, cols) = (w.rows, w.cols);
        if cols % (2 * QK) != 0 {
            let data_len = w.data.len();
            let reason = "the head screen needs rows of whole 64-weight pairs";
            return Err(KernelError::BadShape { ty: w.ty.name(), rows, cols, data_len, reason });
        }
        let nb = cols / QK;
        let rb = cols / 64 * PAIR_BYTES;
        let mut data = vec![0u8; rows * rb];
        let mut bound = vec![0.0f32; rows];
        // Both products sum nb block terms in f32 (plus a horizontal sum): a relative rounding error below
        // (nb + 64)·2⁻²² of the sum of the terms' magnitudes, which Cauchy–Schwarz bounds by norms.
        let margin = (nb + 64) as f64 / (1u64 << 22) as f64;
        let threads = threads.clamp(1, rows.max(1));
        let per = rows.div_ceil(threads);
        std::thread::scope(|s| {
            for (i, (data, bound)) in data.chunks_mut(per * rb).zip(bound.chunks_mut(per)).enumerate() {
                s.spawn(move || {
                    for (k, (dst, c)) in data.chunks_exact_mut(rb).zip(bound.iter_mut()).enumerate() {
                        *c = screen_row(w.row(i * per + k), dst, margin);
                    }
                });
            }
        });
        Ok(HeadScreen { data, rows, cols, bound })
    }

    /// Bytes the screen reads per token (its 6-bit rows).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// The argmax row of `w · x_t` for each of the `n_tokens` activation rows of `x` into `out[t]` (the first
    /// maximum, as a plain argmax over the full product's logits), where `w` is the head this screen was
    /// built from. Returns how many rows needed the exact product (summed over the tokens).
    ///
    /// # Panics
    /// If `w` does not have the screen's shape, or `x`/`out` are too short.
    pub fn argmax(
        &self,
        pool: &ThreadPool,
        w: &QMatrix,
        x: &[f32],
        n_tokens: usize,
        out: &mut [u32],
        scratch: &mut MatmulScratch,
    ) -> usize {
        self.argmax_isa(Isa::current(), pool, w, x, n_tokens, out, scratch)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn argmax_isa(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        w: &QMatrix,
        x: &[f32],
        n_tokens: usize,
        out: &mut [u32],
        scratch: &mut MatmulScratch,
    ) -> usize {
        let (rows, cols) = (self.rows, self.cols);
        assert!(
            w.ty == GgmlType::Q8_0 && w.layout == Layout::Rows && w.rows == rows && w.cols == cols,
            "HeadScreen::argmax: the head is not the one the screen was built from"
        );
        assert!(x.len() >= n_tokens * cols && out.len() >= n_tokens, "HeadScreen::argmax: short x or out");
        if n_tokens == 0 {
            return 0;
        }
        let screen_kernel = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if Isa::Avx512.available() => crate::kernel::avx512::screen6_kernel(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 if Isa::Avx2.available() => crate::kernel::avx2::screen6_kernel(),
            _ => crate::kernel::scalar::screen6,
        };
        let exact = row_kernel(isa, GgmlType::Q8_0).expect("Q8_0 has a row kernel");
        let mut approx = std::mem::take(&mut scratch.screen);
        if approx.len() < n_tokens * rows {
            approx.resize(n_tokens * rows, 0.0);
        }
        let raw = RawRows { data: &self.data, rows, row_bytes: cols / 64 * PAIR_BYTES };
        product(pool, Kernel::Rows(screen_kernel), ActKind::Q8_0, raw, x, cols, n_tokens, &mut approx, scratch);
        let acts = scratch.acts.view(ActKind::Q8_0, x, cols);
        let nb = cols / QK;
        let rb = w.row_bytes();
        let mut survivors = std::mem::take(&mut scratch.survivors);
        let mut values = std::mem::take(&mut scratch.survivor_logits);
        let mut total = 0;
        for t in 0..n_tokens {
            // ‖x̂‖ of the quantized activation row both products see.
            let xq = &acts.qs[t * cols..(t + 1) * cols];
            let norm2: f64 = acts.d[t * nb..(t + 1) * nb]
                .iter()
                .zip(xq.chunks_exact(QK))
                .map(|(&d, q)| (d as f64).powi(2) * q.iter().map(|&v| (v as i32 * v as i32) as f64).sum::<f64>())
                .sum();
            let norm = (norm2.sqrt() * (1.0 + 1e-6)) as f32;
            let a = &approx[t * rows..(t + 1) * rows];
            survivors.clear();
            collect_survivors(a, &self.bound, norm, &mut survivors);
            values.clear();
            values.resize(survivors.len(), 0.0);
            let work = |range: std::ops::Range<usize>, vals: SendPtr| {
                for i in range {
                    let r = survivors[i] as usize;
                    let mut one = [0.0f32];
                    exact(&w.data[r * rb..(r + 1) * rb], rb, &acts, t, 1, &mut one);
                    // SAFETY: i < values.len(); callers hand disjoint ranges to each thread.
                    unsafe { *vals.0.add(i) = one[0] };
                }
            };
            let vals = SendPtr(values.as_mut_ptr());
            if survivors.len() < PARALLEL_SURVIVORS || pool.n_threads() == 1 {
                work(0..survivors.len(), vals);
            } else {
                pool.run(&|i, n| work(split_range(survivors.len(), i, n), vals));
            }
            out[t] = survivors.get(first_max(&values)).copied().unwrap_or(0);
            total += survivors.len();
        }
        scratch.screen = approx;
        scratch.survivors = survivors;
        scratch.survivor_logits = values;
        total
    }
}

/// Lanes of [`collect_survivors`]' passes (the compiler vectorises them).
const SCAN_LANES: usize = 16;

/// Appends to `out` every row `r` whose upper bound `a[r] + c[r]·norm` is not below the best lower bound
/// `max_s a[s] − c[s]·norm`, in order; a NaN (non-finite weights) survives and is decided exactly. Both passes
/// run in [`SCAN_LANES`] lanes, so that they vectorise: a plain `f32::max` fold is a serial chain of ~4 cycles per
/// row, ~65 µs per token over SmolLM2's 49,152 rows, all of it on one thread. The maximum is the same whatever
/// the order (NaN lower bounds are skipped, as `f32::max` skips them).
fn collect_survivors(a: &[f32], c: &[f32], norm: f32, out: &mut Vec<u32>) {
    let n = a.len().min(c.len());
    let (a, c) = (&a[..n], &c[..n]);
    let mut lanes = [f32::NEG_INFINITY; SCAN_LANES];
    let (ac, cc) = (a.chunks_exact(SCAN_LANES), c.chunks_exact(SCAN_LANES));
    let (at, ct) = (ac.remainder(), cc.remainder());
    for (ab, cb) in ac.zip(cc) {
        for l in 0..SCAN_LANES {
            let low = ab[l] - cb[l] * norm;
            lanes[l] = if low > lanes[l] { low } else { lanes[l] };
        }
    }
    let floor = at
        .iter()
        .zip(ct)
        .fold(lanes.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)), |m, (&a, &c)| m.max(a - c * norm));
    // `!(high < floor)`: not below the floor, NaN included (a `partial_cmp` here would not vectorise).
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let keep = |a: f32, c: f32| !(a + c * norm < floor);
    for (k, (ab, cb)) in a.chunks_exact(SCAN_LANES).zip(c.chunks_exact(SCAN_LANES)).enumerate() {
        let any = (0..SCAN_LANES).fold(false, |any, l| any | keep(ab[l], cb[l]));
        if any {
            out.extend((0..SCAN_LANES).filter(|&l| keep(ab[l], cb[l])).map(|l| (k * SCAN_LANES + l) as u32));
        }
    }
    let tail = n - at.len();
    out.extend(at.iter().zip(ct).enumerate().filter(|(_, (&a, &c))| keep(a, c)).map(|(i, _)| (tail + i) as u32));
}

/// Index of the first maximum of `v` (as a plain argmax over logits picks it; 0 when empty or all NaN).
pub fn first_max(v: &[f32]) -> usize {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0
}

/// A pointer the pool's threads write disjoint elements through.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used in `HeadScreen::argmax`, where each thread writes its own range of indices.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// Quantizes one Q8_0 row into screen pairs (`dst`) and returns its bound: `‖w − ŵ‖` plus `margin` times
/// the magnitudes both products sum (`‖w‖ + ‖ŵ‖ + 32·‖d‖`, the last for the `+ 32` offset), rounded up.
fn screen_row(src: &[u8], dst: &mut [u8], margin: f64) -> f32 {
    let (mut err2, mut w2, mut h2, mut d2) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (pair, o) in src.chunks_exact(2 * Q8_0_BYTES).zip(dst.chunks_exact_mut(PAIR_BYTES)) {
        let mut q = [0u8; 64];
        let mut dbits = [0u16; 2];
        for (h, b) in pair.chunks_exact(Q8_0_BYTES).enumerate() {
            let (bits, sums) = screen_block(b, (&mut q[32 * h..32 * h + 32]).try_into().expect("32 values"));
            dbits[h] = bits;
            let [e, ww, hh, dd] = sums;
            (err2, w2, h2, d2) = (err2 + e, w2 + ww, h2 + hh, d2 + dd);
        }
        o.copy_from_slice(&pack(dbits[0], dbits[1], &q));
    }
    let c = err2.sqrt() + margin * (w2.sqrt() + h2.sqrt() + 32.0 * d2.sqrt());
    // A row with non-finite weights gets no bound: it always takes the exact product.
    if c.is_finite() {
        (c * (1.0 + 1e-4)) as f32
    } else {
        f32::INFINITY
    }
}

/// One Q8_0 block's screen values (`q + 32` into `q`) and scale bits, with the block's sums of squares: error,
/// weights, screened weights, and `32·d²` (each as f64). Written in 8 f32 lanes so the loops vectorize; f32 sums
/// of 4 terms per lane are within 2⁻²⁰ relative, which the bound's final rounding up covers.
fn screen_block(b: &[u8], q: &mut [u8; 32]) -> (u16, [f64; 4]) {
    let d8 = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let q8: &[u8; 32] = b[2..34].try_into().expect("a Q8_0 block");
    let qmax = q8.iter().fold(0u8, |m, &v| m.max((v as i8).unsigned_abs()));
    let bits = f32_to_f16(d8.abs() * qmax as f32 / 31.0);
    let d = f16_to_f32(bits);
    // v = round(w / d) = round(q8 · d8 / d), clamped to [−32, 31]; a zero or non-finite scale stores zeros.
    let ratio = if d > 0.0 && d.is_finite() && d8.is_finite() { d8 / d } else { 0.0 };
    let (mut e, mut ww, mut hh) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    for c in 0..4 {
        for l in 0..8 {
            let x = (q8[8 * c + l] as i8) as f32;
            let t = (x * ratio + 32.5).clamp(0.0, 63.0);
            // SAFETY: t is finite and within [0, 63].
            let v = unsafe { t.to_int_unchecked::<i32>() };
            q[8 * c + l] = v as u8;
            let (wv, hv) = (d8 * x, d * (v - 32) as f32);
            e[l] += (wv - hv) * (wv - hv);
            ww[l] += wv * wv;
            hh[l] += hv * hv;
        }
    }
    let sum = |a: [f32; 8]| a.iter().map(|&v| v as f64).sum::<f64>();
    (bits, [sum(e), sum(ww), sum(hh), 32.0 * (d as f64).powi(2)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul_isa;
    use crate::quantize_q8_0_weights;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    #[test]
    fn pairs_round_trip() {
        let mut next = rng(3);
        let q: [u8; 64] = std::array::from_fn(|_| ((next() + 1.0) * 32.0) as u8 & 63);
        let b = pack(0x3c00, 0x4000, &q);
        assert_eq!(unpack(&b), q);
        assert_eq!((&b[..4]), &[0x00, 0x3c, 0x00, 0x40]);
    }

    /// The lane-wise survivor scan keeps exactly the rows the plain two-pass filter keeps (`f32::max` fold,
    /// then `partial_cmp != Less`), with NaN and infinite values, ties at the floor and lengths that are not a
    /// multiple of the lane count.
    #[test]
    fn survivor_scan_equals_the_plain_filter() {
        let mut next = rng(11);
        for n in [0, 1, 15, 16, 17, 100, 1000] {
            for round in 0..20 {
                let mut a: Vec<f32> = (0..n).map(|_| next() * 4.0).collect();
                let mut c: Vec<f32> = (0..n).map(|_| (next() + 1.0) * 0.5).collect();
                if n > 3 && round % 4 == 1 {
                    a[n / 2] = f32::NAN;
                    c[n / 3] = f32::INFINITY;
                }
                if n > 3 && round % 4 == 2 {
                    // A tie exactly at the floor.
                    (a[1], c[1], a[n - 1], c[n - 1]) = (2.0, 0.5, 1.0, 0.5);
                }
                if round % 4 == 3 {
                    a.iter_mut().for_each(|v| *v = f32::NAN);
                }
                let norm = 1.0 + round as f32 * 0.1;
                let floor = a.iter().zip(&c).fold(f32::NEG_INFINITY, |m, (&a, &c)| m.max(a - c * norm));
                let want: Vec<u32> = (0..n)
                    .filter(|&r| (a[r] + c[r] * norm).partial_cmp(&floor) != Some(std::cmp::Ordering::Less))
                    .map(|r| r as u32)
                    .collect();
                let mut got = vec![7];
                collect_survivors(&a, &c, norm, &mut got);
                assert_eq!(got[1..], want[..], "n {n}, round {round}");
            }
        }
    }

    /// A head whose rows are close to each other (a shared direction plus small noise), with exact
    /// duplicates and a row that differs from another in one weight only: the screen cannot separate
    /// them, so the survivors and their exact products must decide — and must match a plain argmax over the
    /// full product on every token, on every instruction-set level.
    #[test]
    fn screened_argmax_equals_the_full_products_argmax() {
        let (rows, cols, n_tokens) = (1000, 128, 19);
        let mut next = rng(11);
        let base: Vec<f32> = (0..cols).map(|_| next()).collect();
        let mut f: Vec<f32> = (0..rows * cols).map(|i| base[i % cols] + 0.5 * next()).collect();
        f.copy_within(17 * cols..18 * cols, 600 * cols); // row 600 duplicates row 17: an exact tie
        f.copy_within(40 * cols..41 * cols, 41 * cols);
        f[41 * cols + 5] += 1e-3; // row 41 = row 40 but for one weight
        let bytes = quantize_q8_0_weights(&f);
        let w = QMatrix::new(GgmlType::Q8_0, &bytes, rows, cols).unwrap();
        let screen = HeadScreen::new(&w, 3).unwrap();
        assert_eq!(screen.bytes(), rows * cols / 64 * PAIR_BYTES);
        // Activations along the shared direction (every logit close), one aimed at the duplicates.
        let mut x: Vec<f32> = (0..n_tokens * cols).map(|i| base[i % cols] + 0.2 * next()).collect();
        for c in 0..cols {
            x[c] = f[17 * cols + c] * 10.0;
            x[cols + c] = f[41 * cols + c] * 10.0;
            x[2 * cols + c] = 0.0; // every logit 0: every row survives (the parallel exact path), row 0 wins
        }
        for isa in [Isa::Scalar, Isa::Avx2] {
            if !isa.available() {
                continue;
            }
            for threads in [1, 3] {
                let pool = ThreadPool::new(threads);
                let mut scratch = MatmulScratch::default();
                let mut logits = vec![0.0f32; n_tokens * rows];
                matmul_isa(isa, &pool, &w, &x, n_tokens, &mut logits, &mut scratch);
                let mut got = vec![0u32; n_tokens];
                let exact = screen.argmax_isa(isa, &pool, &w, &x, n_tokens, &mut got, &mut scratch);
                let want: Vec<u32> = logits.chunks_exact(rows).map(|r| first_max(r) as u32).collect();
                assert_eq!(got, want, "{isa:?}, {threads} threads");
                assert!(exact >= rows + n_tokens - 1 && exact < n_tokens * rows / 2, "{exact} exact rows");
                assert_eq!((got[0], got[2]), (17, 0), "the first of tied rows");
            }
        }
    }

    /// A row with an infinite block scale (a damaged file) has no bound and always gets the exact product: its
    /// +∞ logit wins as in the full product.
    #[test]
    fn rows_with_non_finite_weights_are_decided_exactly() {
        let (rows, cols) = (64, 128);
        let mut next = rng(9);
        let f: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
        let mut bytes = quantize_q8_0_weights(&f);
        let rb = cols / QK * Q8_0_BYTES;
        let block = &mut bytes[5 * rb..5 * rb + Q8_0_BYTES];
        block[..2].copy_from_slice(&0x7c00u16.to_le_bytes()); // +inf
        block[2..].fill(1);
        let w = QMatrix::new(GgmlType::Q8_0, &bytes, rows, cols).unwrap();
        let screen = HeadScreen::new(&w, 1).unwrap();
        assert_eq!(screen.bound[5], f32::INFINITY);
        let x: Vec<f32> = (0..cols).map(|_| next().abs() + 0.1).collect();
        let (pool, mut scratch) = (ThreadPool::new(1), MatmulScratch::default());
        let mut logits = vec![0.0f32; rows];
        crate::matmul(&pool, &w, &x, 1, &mut logits, &mut scratch);
        assert_eq!(logits[5], f32::INFINITY);
        let mut got = [0u32];
        screen.argmax(&pool, &w, &x, 1, &mut got, &mut scratch);
        assert_eq!(got[0], 5);
    }

    /// The screened logits are within each row's bound of the exact ones (the property the argmax rests on),
    /// and the AVX2 screen kernel agrees with the scalar one.
    #[test]
    fn screened_logits_are_within_the_bound() {
        let (rows, cols, n_tokens) = (64, 640, 3);
        let mut next = rng(5);
        let f: Vec<f32> = (0..rows * cols).map(|_| next() * next()).collect();
        let bytes = quantize_q8_0_weights(&f);
        let w = QMatrix::new(GgmlType::Q8_0, &bytes, rows, cols).unwrap();
        let screen = HeadScreen::new(&w, 2).unwrap();
        let mut x: Vec<f32> = (0..n_tokens * cols).map(|_| 3.0 * next()).collect();
        // The last token points along row 0's quantization error, where the bound is nearly reached (random
        // directions stay far below it): a bound too small by half fails below.
        let w0 = &bytes[..cols / QK * Q8_0_BYTES];
        let mut exact0 = vec![0.0f32; cols];
        crate::dequantize_row(GgmlType::Q8_0, w0, &mut exact0);
        for (c, copy) in screen_values(w0).into_iter().enumerate() {
            x[(n_tokens - 1) * cols + c] = 100.0 * (exact0[c] - copy);
        }
        let pool = ThreadPool::new(1);
        let mut scratch = MatmulScratch::default();
        let mut exact = vec![0.0f32; n_tokens * rows];
        matmul_isa(Isa::Scalar, &pool, &w, &x, n_tokens, &mut exact, &mut scratch);
        let raw = RawRows { data: &screen.data, rows, row_bytes: cols / 64 * PAIR_BYTES };
        let mut levels = vec![(Isa::Scalar, Kernel::Rows(crate::kernel::scalar::screen6))];
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.available() {
            levels.push((Isa::Avx2, Kernel::Rows(crate::kernel::avx2::screen6_kernel())));
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.available() {
            levels.push((Isa::Avx512, Kernel::Rows(crate::kernel::avx512::screen6_kernel())));
        }
        let mut first: Option<Vec<f32>> = None;
        for (isa, kernel) in levels {
            let mut approx = vec![0.0f32; n_tokens * rows];
            product(&pool, kernel, ActKind::Q8_0, raw, &x, cols, n_tokens, &mut approx, &mut scratch);
            let acts = scratch.acts.view(ActKind::Q8_0, &x, cols);
            for t in 0..n_tokens {
                let norm = x_norm(&acts, t);
                for r in 0..rows {
                    let (a, e) = (approx[t * rows + r], exact[t * rows + r]);
                    assert!((a - e).abs() <= screen.bound[r] * norm, "{isa:?} row {r}: {a} vs {e}");
                    // The bound is not vacuous: a 6-bit copy is within a few percent of the row's norm.
                    let wn = f[r * cols..(r + 1) * cols].iter().map(|v| v * v).sum::<f32>().sqrt();
                    assert!(screen.bound[r] < 0.05 * wn, "row {r}: bound {} for norm {wn}", screen.bound[r]);
                }
            }
            let (a, e) = (approx[(n_tokens - 1) * rows], exact[(n_tokens - 1) * rows]);
            let reach = (a - e).abs() / (screen.bound[0] * x_norm(&acts, n_tokens - 1));
            assert!(reach > 0.6, "{isa:?}: the error reaches only {reach} of the bound");
            match &first {
                None => first = Some(approx),
                Some(s) => {
                    for (a, b) in approx.iter().zip(s) {
                        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{isa:?}: {a} vs scalar {b}");
                    }
                }
            }
        }
    }

    /// ‖x̂‖ of quantized activation row `t`.
    fn x_norm(acts: &crate::quantize::Acts, t: usize) -> f32 {
        let xq = &acts.qs[t * acts.cols..(t + 1) * acts.cols];
        xq.iter().enumerate().map(|(i, &q)| (acts.d[t * acts.nb + i / QK] * q as f32).powi(2)).sum::<f32>().sqrt()
    }

    /// The screen's copy of one Q8_0 row, dequantized.
    fn screen_values(src: &[u8]) -> Vec<f32> {
        let mut dst = vec![0u8; src.len() / (2 * Q8_0_BYTES) * PAIR_BYTES];
        screen_row(src, &mut dst, 0.0);
        dst.chunks_exact(PAIR_BYTES)
            .flat_map(|p| {
                let q = unpack(p);
                let d = [0, 2].map(|o| f16_to_f32(u16::from_le_bytes([p[o], p[o + 1]])));
                (0..64).map(move |i| d[i / 32] * (q[i] as i32 - 32) as f32)
            })
            .collect()
    }
}
