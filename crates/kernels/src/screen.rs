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
//! The screened logits are never stored: the product hands each tile (16 rows × up to 16 activation rows) to a
//! per-thread filter ([`ShareFilter`]) that keeps the rows whose upper bound reaches the best lower bound seen so
//! far, a superset of the survivors that is cut to them once the product is done (the same rows, in row order,
//! as a scan of stored logits: tested). Until session 61 a 16-row step wrote 16.8 MB of screened logits (Gemma),
//! copied them out of the kernels' tiles and read them twice. Session 61, Gemma 3 270M, 2 threads, the stored
//! scan's binary against the fused filter's, alternating: `batchbench MODEL 2 32 1,4,16` ms a 16-row step 39.6 /
//! 28.4 / 23.6 / 33.2 → 24.5 / 26.5 / 21.7 / 29.9 (every pair faster, median −9%; the filter's AVX-512 tile test
//! and the floor raised only where a tile has a row to keep brought its profile share from 4.6% to 2.8%, the
//! stored scan and its copies had 5.8%); 1 and 4 rows within the VM's noise (1 row 9.0 / 8.7 / 9.6 / 9.5 →
//! 8.3 / 9.2 / 6.4 / 8.4 ms).
//!
//! Why 6 bits (measured in session 16 by simulating symmetric b-bit copies of the real heads over the llama.cpp
//! reference sequences, with the same Cauchy–Schwarz bound): survivors per token, mean (median), were SmolLM2
//! 73 (15) at 6 bits, 5,043 (2,463) at 5 and 45,981 of 49,152 at 4; Gemma 67 (29), 2,428 (974) and 154,082 of
//! 262,144. The bound grows with the step size, and the top of the logit distribution is dense enough that one
//! bit fewer multiplies the survivors by ~50. Handling the 32 columns where `‖x‖²` concentrates (they hold ~55% of
//! it on both models) outside the bound brings 5 bits back to 65 (SmolLM2) / 79 (Gemma) survivors, but with
//! those columns' corrections stored the rows shrink by only ~10%: not pursued.
//!
//! Layout ([`GROUP`] = 16 rows interleaved block by block, like the matmuls' interleaved matrices, so that one
//! 512-bit register holds 4 consecutive values of each of 16 rows and a product needs no horizontal sums):
//! per group and 32-column block, [`BLOCK_BYTES`] = 416 bytes — the 16 rows' f16 scales (32 bytes); 4 registers
//! of nibbles (64 bytes each, byte `4r + k` of register `i`: values `4i + k` (low nibble) and `16 + 4i + k` (high
//! nibble) of row `r`); 2 registers of high bit pairs (byte `4r + k` of register `h`, bits `2m..2m+2`: value
//! `4(4h + m) + k`'s bits 4–5). So value register `j` (values `4j..4j+4` of every row) is the low (`j < 4`) or
//! high nibble of nibble register `j % 4` plus field `j % 4` of high register `j / 4`, shifted to bits 4–5.
//! Values are stored as `q + 32` with `q ∈ [−32, 31]` (the weight is `d·q`): unsigned, so that they are the
//! unsigned operand of `vpdpbusd`/`vpmaddubsw` against the signed Q8_0 activations; each block sum starts at the
//! activations' `−32·Σy` ([`crate::quantize::Acts::zb`]), exactly in integers. Rows are padded with zero rows to
//! a whole group (their screened logits are never read); columns need whole 32-weight blocks.
//!
//! With AMX (`kernel/amx.rs`) products of ≥ 10 activation rows go through tiles, bit-identical to the VNNI kernel:
//! a tile block's fixed cost is below 16 rows' `vpdpbusd`, so the batched greedy steps of a server (and large
//! draft trees) screen faster. Session 60, Gemma 3 270M, 2 threads, `SPECEE_AMX=0` vs default alternating:
//! `batchbench MODEL 2 32 12,16` ms a step (forward + screened argmax of 16 rows) 28.5 / 29.1 → 25.3 / 27.5
//! (a third pair 43.1 → 28.0 in a noisy phase), 12 rows 22.5 / 22.0 → 22.6 / 20.2.
//!
//! Why interleaved (session 20): the previous layout kept each row's pairs of blocks together, and its kernel
//! took one horizontal sum per row and token and ~9 µops per 64 weights per token, so the screen ran at ~26 GB/s
//! for one token where the interleaved Q4 matmuls reach ~33, and each further token cost ~0.2 ms on SmolLM2.

use crate::blocks::{f16_to_f32, f32_to_f16, Q8_0_BYTES, QK};
use crate::kernel::{row_kernel, GroupKernel, Isa, Kernel};
use crate::matmul::{product_quantized, Out, RawRows};
use crate::pool::{split_range, ThreadPool};
use crate::quantize::ActKind;
use crate::{KernelError, Layout, MatmulScratch, QMatrix};
use gguf::GgmlType;

/// Rows per interleaved group of the screen.
pub(crate) const GROUP: usize = 16;
/// Bytes per group and 32-column block: 16 f16 scales, 4 nibble registers, 2 high-bit registers.
pub(crate) const BLOCK_BYTES: usize = 2 * GROUP + 4 * 64 + 2 * 64;
/// Where a block's nibble registers start.
pub(crate) const NIBBLES: usize = 2 * GROUP;
/// Where a block's high-bit registers start.
pub(crate) const HIGH: usize = NIBBLES + 4 * 64;

/// Survivors per token above which their exact products are split across the pool.
const PARALLEL_SURVIVORS: usize = 64;

/// Writes row `r`'s 32 stored values (`q + 32`, each < 64) and scale bits into one group's `block` (its own
/// 4-byte slot of every register: each row is written once, as a whole).
fn put(block: &mut [u8], r: usize, dbits: u16, q: &[u8; 32]) {
    block[2 * r..2 * r + 2].copy_from_slice(&dbits.to_le_bytes());
    for i in 0..4 {
        let nib: [u8; 4] = std::array::from_fn(|k| (q[4 * i + k] & 0x0F) | (q[16 + 4 * i + k] & 0x0F) << 4);
        block[NIBBLES + 64 * i + 4 * r..][..4].copy_from_slice(&nib);
    }
    for h in 0..2 {
        let high: [u8; 4] =
            std::array::from_fn(|k| (0..4).fold(0u8, |b, m| b | (q[4 * (4 * h + m) + k] >> 4 & 3) << (2 * m)));
        block[HIGH + 64 * h + 4 * r..][..4].copy_from_slice(&high);
    }
}

/// Row `r`'s stored value `e` (`q + 32`, `e < 32`) in one group's `block` (see the module docs).
pub(crate) fn value(block: &[u8], r: usize, e: usize) -> u8 {
    let (j, k) = (e / 4, e % 4);
    let low = block[NIBBLES + 64 * (j % 4) + 4 * r + k] >> (4 * (j / 4)) & 0x0F;
    let high = block[HIGH + 64 * (j / 4) + 4 * r + k] >> (2 * (j % 4)) & 3;
    low | high << 4
}

/// Row `r`'s scale in one group's `block`.
pub(crate) fn scale(block: &[u8], r: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([block[2 * r], block[2 * r + 1]]))
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
        if cols % QK != 0 || cols == 0 {
            let data_len = w.data.len();
            let reason = "the head screen needs rows of whole 32-weight blocks";
            return Err(KernelError::BadShape { ty: w.ty.name(), rows, cols, data_len, reason });
        }
        let nb = cols / QK;
        let gb = nb * BLOCK_BYTES;
        let groups = rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * gb];
        let mut bound = vec![0.0f32; groups * GROUP];
        // Both products sum nb block terms in f32 (the exact one plus a horizontal sum): a relative rounding
        // error below (nb + 64)·2⁻²² of the sum of the terms' magnitudes, which Cauchy–Schwarz bounds by norms.
        let margin = (nb + 64) as f64 / (1u64 << 22) as f64;
        let per = groups.div_ceil(threads.clamp(1, groups.max(1))).max(1);
        std::thread::scope(|s| {
            for (i, (data, bound)) in data.chunks_mut(per * gb).zip(bound.chunks_mut(per * GROUP)).enumerate() {
                s.spawn(move || {
                    for (k, (dst, c)) in data.chunks_exact_mut(gb).zip(bound.chunks_exact_mut(GROUP)).enumerate() {
                        let first = (i * per + k) * GROUP;
                        for (r, c) in c.iter_mut().enumerate().take(rows.saturating_sub(first)) {
                            *c = screen_row(w.row(first + r), dst, r, margin);
                        }
                    }
                });
            }
        });
        bound.truncate(rows);
        Ok(HeadScreen { data, rows, cols, bound })
    }

    /// Bytes the screen reads per token (its 6-bit rows, padded to whole groups).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Rows of the screen's layout: the head's, padded to whole groups.
    fn padded_rows(&self) -> usize {
        self.rows.div_ceil(GROUP) * GROUP
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
        let exact = row_kernel(isa, GgmlType::Q8_0).expect("Q8_0 has a row kernel");
        scratch.acts.reserve(ActKind::Q8_0, n_tokens, cols);
        scratch.acts.quantize_tokens_parallel(pool, ActKind::Q8_0, x, cols, n_tokens);
        let acts = scratch.acts.view(ActKind::Q8_0, x, cols);
        let rb = w.row_bytes();
        let norms: Vec<f32> = (0..n_tokens).map(|t| quantized_norm(&acts, t)).collect();
        // The screened logits are filtered tile by tile as the product makes them, never stored (see
        // `ShareFilter`); each share keeps a superset of its rows' survivors.
        let filters = &mut scratch.screen;
        // One filter per share the product can have (`ThreadPool::run_shares`: at most one per thread).
        filters.resize_with(pool.n_threads().clamp(1, crate::pool::MAX_SHARES), ShareFilter::default);
        filters.iter_mut().for_each(|f| f.reset(n_tokens));
        let shares = FilterPtr(filters.as_mut_ptr(), filters.len());
        #[cfg(target_arch = "x86_64")]
        let avx512 = isa == Isa::Avx512 && Isa::Avx512.available();
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        if avx512 {
            self.filtered_product::<true>(isa, pool, &acts, n_tokens, &norms, shares);
        } else {
            self.filtered_product::<false>(isa, pool, &acts, n_tokens, &norms, shares);
        }
        let bound = &self.bound[..];
        let filters = &scratch.screen;
        // One token's survivors (the rows whose upper bound reaches the best lower bound of all, in row order),
        // their exact products split across the pool where there are many (inside a pool item, the pool runs that
        // nested call on the calling thread), and its argmax and survivor count.
        let one = |t: usize, survivors: &mut Vec<u32>, values: &mut Vec<f32>| {
            let norm = norms[t];
            let floor = filters.iter().fold(f32::NEG_INFINITY, |m, f| m.max(f.best_floor(t)));
            // `!(high < floor)`: not below the floor, NaN included.
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            let keep = |r: u32, a: f32| !(a + bound[r as usize] * norm < floor);
            survivors.clear();
            survivors.extend(filters.iter().flat_map(|f| &f.kept[t]).filter(|&&(r, a)| keep(r, a)).map(|&(r, _)| r));
            survivors.sort_unstable();
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
            (survivors.get(first_max(values)).copied().unwrap_or(0), survivors.len())
        };
        let mut survivors = std::mem::take(&mut scratch.survivors);
        let mut values = std::mem::take(&mut scratch.survivor_logits);
        let mut total = 0;
        if n_tokens == 1 || pool.n_threads() == 1 || n_tokens > crate::pool::MAX_ITEMS {
            for (t, out) in out.iter_mut().enumerate().take(n_tokens) {
                let (best, n) = one(t, &mut survivors, &mut values);
                (*out, total) = (best, total + n);
            }
        } else {
            // Several rows (a draft tree, a server's batch): one token per pool item, so that their exact products
            // run on every thread, not on the calling one while the others wait. Each token's result is the same
            // either way.
            let found: Vec<std::sync::Mutex<(u32, usize)>> = (0..n_tokens).map(|_| Default::default()).collect();
            pool.run_items(n_tokens, &|t| {
                let r = one(t, &mut Vec::new(), &mut Vec::new());
                *found[t].lock().unwrap_or_else(|p| p.into_inner()) = r;
            });
            for (out, f) in out.iter_mut().zip(found) {
                let (best, n) = f.into_inner().unwrap_or_else(|p| p.into_inner());
                (*out, total) = (best, total + n);
            }
        }
        scratch.screen.iter_mut().for_each(ShareFilter::trim);
        scratch.survivors = survivors;
        scratch.survivor_logits = values;
        total
    }

    /// The screen's product of the quantized activations `acts`, each tile filtered by its share's filter in
    /// `shares` (see [`ShareFilter`]; `AVX512`: its AVX-512 test).
    fn filtered_product<const AVX512: bool>(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        acts: &crate::quantize::Acts,
        n_tokens: usize,
        norms: &[f32],
        shares: FilterPtr,
    ) {
        let (bound, rows) = (&self.bound[..], self.rows);
        let sink = |share: usize, t0: usize, r0: usize, nr: usize, buf: &[f32]| {
            assert!(share < shares.1, "a share beyond the pool's threads");
            // SAFETY: `share` indexes the filters (checked), and no two calls of one share run at once (`Sink`).
            let f = unsafe { shares.get(share) };
            // Padded rows (a last group's zero rows) are not the head's.
            let valid = nr.min(rows.saturating_sub(r0));
            f.filter::<AVX512>(buf, t0, r0, nr, &bound[r0..r0 + valid], norms);
        };
        let raw =
            RawRows { data: &self.data, rows: self.padded_rows(), row_bytes: self.cols / QK * BLOCK_BYTES / GROUP };
        product_quantized(pool, screen_kernels(isa), raw, acts, n_tokens, Out::Sink(&sink));
    }

    /// The screened logits of the `n_tokens` rows of `x` into `approx[t * padded_rows + r]` (quantizing `x` into
    /// `scratch`'s Q8_0 activations): what [`HeadScreen::argmax`] filters without storing, for the tests.
    #[cfg(test)]
    fn screen_product(
        &self,
        isa: Isa,
        pool: &ThreadPool,
        x: &[f32],
        n_tokens: usize,
        approx: &mut [f32],
        scratch: &mut MatmulScratch,
    ) {
        let raw =
            RawRows { data: &self.data, rows: self.padded_rows(), row_bytes: self.cols / QK * BLOCK_BYTES / GROUP };
        crate::matmul::product(pool, screen_kernels(isa), ActKind::Q8_0, raw, x, self.cols, n_tokens, approx, scratch);
    }
}

/// The screen's kernel on level `isa`: with AMX, the tile kernel for products of many activation rows beside the
/// VNNI one (bit-identical results, see `kernel/amx.rs`).
fn screen_kernels(isa: Isa) -> Kernel {
    let groups = screen_kernel(isa);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && crate::kernel::amx::screen_available() {
        return Kernel::Tiles { groups, tiles: crate::kernel::amx::screen_kernel() };
    }
    Kernel::Groups(groups)
}

/// The screen's group kernel on level `isa`.
fn screen_kernel(isa: Isa) -> GroupKernel {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if Isa::Avx512.available() => crate::kernel::avx512::screen6_kernel(),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if Isa::Avx2.available() => crate::kernel::avx2::screen6_kernel(),
        _ => crate::kernel::scalar::screen6,
    }
}

/// Most activation rows of a tile the AVX-512 filter takes at once (every kernel's tile has at most 16).
const MAX_TILE_ROWS: usize = 16;

/// Lanes of the survivor filters' passes (the compiler vectorises them).
const SCAN_LANES: usize = 16;

/// The survivors of one activation row's stored screened logits `a` (the reference the fused filter of
/// [`HeadScreen::argmax`] is tested against): appends to `out` every row `r` whose upper bound `a[r] + c[r]·norm`
/// is not below the best lower bound `max_s a[s] − c[s]·norm`, in order; a NaN (non-finite weights) survives and
/// is decided exactly. Both passes run in [`SCAN_LANES`] lanes, so that they vectorise: a plain `f32::max` fold is
/// a serial chain of ~4 cycles per row, ~65 µs per token over SmolLM2's 49,152 rows. The maximum is the same
/// whatever the order (NaN lower bounds are skipped, as `f32::max` skips them).
#[cfg(test)]
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

/// ‖x̂‖ of quantized (Q8_0) activation row `t`, as both products see it, rounded up.
fn quantized_norm(acts: &crate::quantize::Acts, t: usize) -> f32 {
    let (cols, nb) = (acts.cols, acts.nb);
    let xq = &acts.qs[t * cols..(t + 1) * cols];
    let norm2: f64 = acts.d[t * nb..(t + 1) * nb]
        .iter()
        .zip(xq.chunks_exact(QK))
        .map(|(&d, q)| (d as f64).powi(2) * q.iter().map(|&v| (v as i32 * v as i32) as f64).sum::<f64>())
        .sum();
    (norm2.sqrt() * (1.0 + 1e-6)) as f32
}

/// One share's survivor filter while the screen's product runs ([`HeadScreen::argmax_isa`]). The product hands
/// each tile of screened logits (16 rows × up to 16 activation rows) to its share's filter, which raises, per
/// activation row, the greatest lower bound `a − c·‖x̂‖` it has seen (lane by lane, [`SCAN_LANES`] wide) and keeps
/// the rows whose upper bound `a + c·‖x̂‖` is not below `floor`, a lower bound already reached (so every row kept
/// in the end, whose upper bound reaches the best lower bound of all, is kept here: a superset, filtered once the
/// product is done). `floor` is raised from the lanes only when a tile has a row to keep, so most tiles cost a
/// few vector operations. Against writing the screened logits out and scanning them twice (session 60: the
/// 16.8 MB of a 16-row step written, copied and read twice), nothing leaves the cache.
#[derive(Default)]
pub(crate) struct ShareFilter {
    lanes: Vec<[f32; SCAN_LANES]>,
    floor: Vec<f32>,
    kept: Vec<Vec<(u32, f32)>>,
}

impl ShareFilter {
    /// Ready for a product of `n_tokens` activation rows.
    fn reset(&mut self, n_tokens: usize) {
        self.lanes.clear();
        self.lanes.resize(n_tokens, [f32::NEG_INFINITY; SCAN_LANES]);
        self.floor.clear();
        self.floor.resize(n_tokens, f32::NEG_INFINITY);
        if self.kept.len() < n_tokens {
            self.kept.resize_with(n_tokens, Vec::new);
        }
        self.kept.iter_mut().for_each(Vec::clear);
    }

    /// Filters the tile `buf` (activation rows `t0..`, `nr` weight rows from `r0`, token-major; bounds `c` of the
    /// `c.len() ≤ nr` rows that are the head's, `norms[t] = ‖x̂_t‖`); `AVX512`: whole tiles with the AVX-512 filter
    /// (only where the CPU has it).
    #[inline]
    fn filter<const AVX512: bool>(&mut self, buf: &[f32], t0: usize, r0: usize, nr: usize, c: &[f32], norms: &[f32]) {
        let nt = buf.len() / nr;
        #[cfg(target_arch = "x86_64")]
        if AVX512 && nr == SCAN_LANES && c.len() == SCAN_LANES && nt <= MAX_TILE_ROWS {
            let mut masks = [0u16; MAX_TILE_ROWS];
            let c16: &[f32; SCAN_LANES] = c.try_into().expect("16 bounds");
            let (lanes, floors) = (&mut self.lanes[t0..t0 + nt], &mut self.floor[t0..t0 + nt]);
            // SAFETY: `AVX512` only where the CPU has avx512f (`HeadScreen::argmax_isa`); the slices hold `nt`
            // rows (checked).
            if unsafe { crate::kernel::avx512::screen_filter_tile(buf, c16, &norms[t0..], lanes, floors, &mut masks) } {
                for (j, &m) in masks[..nt].iter().enumerate().filter(|(_, &m)| m != 0) {
                    let a = &buf[j * nr..(j + 1) * nr];
                    let rows = (0..SCAN_LANES).filter(|&i| m >> i & 1 == 1);
                    self.kept[t0 + j].extend(rows.map(|i| ((r0 + i) as u32, a[i])));
                }
            }
            return;
        }
        for (j, a) in buf.chunks_exact(nr).enumerate() {
            self.filter_row(t0 + j, &a[..c.len()], c, norms[t0 + j], r0);
        }
    }

    /// The portable filter of activation row `t`'s screened logits `a` of rows `r0..` (bounds `c`, `‖x̂‖ = norm`).
    #[inline]
    fn filter_row(&mut self, t: usize, a: &[f32], c: &[f32], norm: f32, r0: usize) {
        let lanes = &mut self.lanes[t];
        if let (Ok(a), Ok(c)) = (<&[f32; SCAN_LANES]>::try_from(a), <&[f32; SCAN_LANES]>::try_from(c)) {
            // A whole tile: lane-wise maxima and the test against the floor, both vectorised.
            let floor = self.floor[t];
            let mut any = false;
            for l in 0..SCAN_LANES {
                let low = a[l] - c[l] * norm;
                lanes[l] = if low > lanes[l] { low } else { lanes[l] };
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                let keep = !(a[l] + c[l] * norm < floor);
                any |= keep;
            }
            if !any {
                return;
            }
        }
        for (i, (&a, &c)) in a.iter().zip(c).enumerate() {
            let low = a - c * norm;
            let l = &mut lanes[i % SCAN_LANES];
            *l = if low > *l { low } else { *l };
        }
        let floor = lanes.iter().fold(self.floor[t], |m, &l| if l > m { l } else { m });
        self.floor[t] = floor;
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let kept = a.iter().zip(c).enumerate().filter(|(_, (&a, &c))| !(a + c * norm < floor));
        self.kept[t].extend(kept.map(|(i, (&a, _))| ((r0 + i) as u32, a)));
    }

    /// The greatest lower bound this share saw for activation row `t` (−∞ if none; NaN never counts).
    fn best_floor(&self, t: usize) -> f32 {
        self.lanes[t].iter().fold(self.floor[t], |m, &l| m.max(l))
    }

    /// Gives back what a degenerate product (every row kept) left in the lists.
    fn trim(&mut self) {
        for k in &mut self.kept {
            k.shrink_to(1 << 12);
        }
    }
}

/// The share filters of one product (pointer, count), reached from its threads (each share by one thread at a time).
#[derive(Clone, Copy)]
struct FilterPtr(*mut ShareFilter, usize);
// SAFETY: only used in `HeadScreen::argmax_isa`, where each share's filter is used by one thread at a time.
unsafe impl Send for FilterPtr {}
unsafe impl Sync for FilterPtr {}

impl FilterPtr {
    /// # Safety
    /// `share` must index the filters, and no other thread may use that share's filter meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, share: usize) -> &mut ShareFilter {
        &mut *self.0.add(share)
    }
}

/// Quantizes one Q8_0 row into row `r` of a screen group (`dst`, the group's blocks) and returns its bound:
/// `‖w − ŵ‖` plus `margin` times the magnitudes both products sum (`‖w‖ + ‖ŵ‖`, and `32·‖d‖` for the `+ 32`
/// offset, which the kernels take off in integers: kept as slack), rounded up.
fn screen_row(src: &[u8], dst: &mut [u8], r: usize, margin: f64) -> f32 {
    let (mut err2, mut w2, mut h2, mut d2) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (b, o) in src.chunks_exact(Q8_0_BYTES).zip(dst.chunks_exact_mut(BLOCK_BYTES)) {
        let mut q = [0u8; 32];
        let (bits, [e, ww, hh, dd]) = screen_block(b, &mut q);
        put(o, r, bits, &q);
        (err2, w2, h2, d2) = (err2 + e, w2 + ww, h2 + hh, d2 + dd);
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

    /// Every row's 32 values and scale come back from a group's interleaved block, whatever the other rows hold.
    #[test]
    fn groups_round_trip() {
        let mut next = rng(3);
        let q: Vec<[u8; 32]> =
            (0..GROUP).map(|_| std::array::from_fn(|_| ((next() + 1.0) * 32.0) as u8 & 63)).collect();
        let mut block = [0u8; BLOCK_BYTES];
        for (r, q) in q.iter().enumerate() {
            put(&mut block, r, 0x3c00 + r as u16, q);
        }
        for (r, q) in q.iter().enumerate() {
            assert_eq!(std::array::from_fn::<u8, 32, _>(|e| value(&block, r, e)), *q, "row {r}");
            assert_eq!(scale(&block, r), f16_to_f32(0x3c00 + r as u16));
        }
        // Value register j of row r sits at byte 4r + k: the low nibble of register 1 holds values 4..8.
        assert_eq!(block[NIBBLES + 64 + 4 * 3 + 2] & 0x0F, q[3][6] & 0x0F);
        assert_eq!(block[HIGH + 64 + 4 * 5 + 1] >> 6, q[5][4 * 7 + 1] >> 4);
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
        // 1,000 rows in 63 groups, the last one padded.
        assert_eq!(screen.bytes(), 63 * cols / QK * BLOCK_BYTES);
        // Activations along the shared direction (every logit close), one aimed at the duplicates.
        let mut x: Vec<f32> = (0..n_tokens * cols).map(|i| base[i % cols] + 0.2 * next()).collect();
        for c in 0..cols {
            x[c] = f[17 * cols + c] * 10.0;
            x[cols + c] = f[41 * cols + c] * 10.0;
            x[2 * cols + c] = 0.0; // every logit 0: every row survives (the parallel exact path), row 0 wins
        }
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
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
                // One token at a time (several tokens go one per pool item; a lone one splits its survivors'
                // exact products across the pool, as token 2's thousand do here).
                for t in 0..3 {
                    let mut one = [u32::MAX];
                    screen.argmax_isa(isa, &pool, &w, &x[t * cols..(t + 1) * cols], 1, &mut one, &mut scratch);
                    assert_eq!(one[0], want[t], "{isa:?}, {threads} threads, token {t} alone");
                }
            }
        }
    }

    /// The filter fused into the screen's product keeps exactly the rows the two-pass scan of the stored screened
    /// logits keeps (the same count, so the same survivors: the fused ones are a subset of the scan's by
    /// construction), for 1 to 40 activation rows (tiles of VNNI and, with AMX, of the tile kernel), one and three
    /// threads, a padded last group, rows of near-equal logits, a row without a bound and an all-zero activation.
    #[test]
    fn fused_filter_keeps_the_two_pass_scans_survivors() {
        let (rows, cols) = (1000, 128);
        let mut next = rng(21);
        let base: Vec<f32> = (0..cols).map(|_| next()).collect();
        let f: Vec<f32> = (0..rows * cols).map(|i| base[i % cols] + 0.5 * next()).collect();
        let mut bytes = quantize_q8_0_weights(&f);
        let rb = cols / QK * Q8_0_BYTES;
        bytes[77 * rb..77 * rb + 2].copy_from_slice(&0x7c00u16.to_le_bytes()); // row 77: +inf scale, no bound
        let w = QMatrix::new(GgmlType::Q8_0, &bytes, rows, cols).unwrap();
        let screen = HeadScreen::new(&w, 2).unwrap();
        assert_eq!(screen.bound[77], f32::INFINITY);
        let n_max = 40;
        let mut x: Vec<f32> = (0..n_max * cols).map(|i| base[i % cols] * (1.0 + (i / cols) as f32) + next()).collect();
        x[3 * cols..4 * cols].fill(0.0);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()) {
            for threads in [1, 3] {
                let pool = ThreadPool::new(threads);
                let mut scratch = MatmulScratch::default();
                for n in [1, 2, 5, 9, 10, 16, 19, 33, 40] {
                    let x = &x[..n * cols];
                    let padded = screen.padded_rows();
                    let mut approx = vec![0.0f32; n * padded];
                    screen.screen_product(isa, &pool, x, n, &mut approx, &mut scratch);
                    let acts = scratch.acts.view(ActKind::Q8_0, x, cols);
                    let mut want = 0;
                    for t in 0..n {
                        let norm = quantized_norm(&acts, t);
                        let mut kept = Vec::new();
                        collect_survivors(&approx[t * padded..t * padded + rows], &screen.bound, norm, &mut kept);
                        assert!(kept.contains(&77), "{isa:?}: the unbounded row always survives");
                        want += kept.len();
                    }
                    let mut got = vec![0u32; n];
                    let total = screen.argmax_isa(isa, &pool, &w, x, n, &mut got, &mut scratch);
                    assert_eq!(total, want, "{isa:?}, {threads} threads, {n} rows: survivors");
                    assert!(total < n * rows, "{isa:?}, {n} rows: the filter let everything through");
                }
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
    /// The screened logits are within each row's bound of the exact ones (the property the argmax rests on) on
    /// every instruction-set level, over a padded last group and more token rows than a tile, and the SIMD
    /// kernels agree with the scalar one.
    #[test]
    fn screened_logits_are_within_the_bound() {
        let (rows, cols, n_tokens) = (40, 640, 11);
        let mut next = rng(5);
        let f: Vec<f32> = (0..rows * cols).map(|_| next() * next()).collect();
        let bytes = quantize_q8_0_weights(&f);
        let w = QMatrix::new(GgmlType::Q8_0, &bytes, rows, cols).unwrap();
        let screen = HeadScreen::new(&w, 2).unwrap();
        assert_eq!(screen.bytes(), 3 * cols / QK * BLOCK_BYTES);
        let mut x: Vec<f32> = (0..n_tokens * cols).map(|_| 3.0 * next()).collect();
        // The last token points along row 33's quantization error, where the bound is nearly reached (random
        // directions stay far below it): a bound too small by half fails below.
        let probe = 33;
        let mut exact_row = vec![0.0f32; cols];
        crate::dequantize_row(GgmlType::Q8_0, w.row(probe), &mut exact_row);
        for (c, copy) in screen_values(&screen, probe).into_iter().enumerate() {
            x[(n_tokens - 1) * cols + c] = 100.0 * (exact_row[c] - copy);
        }
        let pool = ThreadPool::new(1);
        let mut scratch = MatmulScratch::default();
        let mut exact = vec![0.0f32; n_tokens * rows];
        matmul_isa(Isa::Scalar, &pool, &w, &x, n_tokens, &mut exact, &mut scratch);
        let padded = screen.padded_rows();
        let mut first: Option<Vec<f32>> = None;
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|isa| isa.available()) {
            let mut approx = vec![f32::NAN; n_tokens * padded];
            screen.screen_product(isa, &pool, &x, n_tokens, &mut approx, &mut scratch);
            let acts = scratch.acts.view(ActKind::Q8_0, &x, cols);
            for t in 0..n_tokens {
                let norm = x_norm(&acts, t);
                for r in 0..rows {
                    let (a, e) = (approx[t * padded + r], exact[t * rows + r]);
                    assert!((a - e).abs() <= screen.bound[r] * norm, "{isa:?} token {t} row {r}: {a} vs {e}");
                    // The bound is not vacuous: a 6-bit copy is within a few percent of the row's norm.
                    let wn = f[r * cols..(r + 1) * cols].iter().map(|v| v * v).sum::<f32>().sqrt();
                    assert!(screen.bound[r] < 0.05 * wn, "row {r}: bound {} for norm {wn}", screen.bound[r]);
                }
            }
            let (a, e) = (approx[(n_tokens - 1) * padded + probe], exact[(n_tokens - 1) * rows + probe]);
            let reach = (a - e).abs() / (screen.bound[probe] * x_norm(&acts, n_tokens - 1));
            assert!(reach > 0.6, "{isa:?}: the error reaches only {reach} of the bound");
            let real: Vec<f32> = approx.chunks_exact(padded).flat_map(|t| t[..rows].to_vec()).collect();
            match &first {
                None => first = Some(real),
                Some(s) => {
                    for (a, b) in real.iter().zip(s) {
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

    /// The screen's copy of row `r`, dequantized from its group.
    fn screen_values(screen: &HeadScreen, r: usize) -> Vec<f32> {
        let gb = screen.cols / QK * BLOCK_BYTES;
        let group = &screen.data[r / GROUP * gb..(r / GROUP + 1) * gb];
        group
            .chunks_exact(BLOCK_BYTES)
            .flat_map(|b| (0..QK).map(move |e| scale(b, r % GROUP) * (value(b, r % GROUP, e) as i32 - 32) as f32))
            .collect()
    }
}
