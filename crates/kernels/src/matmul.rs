//! Quantized matrix × activation products: [`QMatrix`] (a borrowed weight matrix in a ggml type),
//! [`matmul`] (all rows × several activation rows) and [`matmul_rows`] (a few chosen rows × one
//! activation row, for "head rows").
//!
//! Steps, as in ggml's CPU `mul_mat`: (1) quantize the activations once to the weight type's vec-dot
//! format ([`crate::quantize`]), in parallel for many rows, into a reusable [`MatmulScratch`]; (2) split
//! the weight rows into pieces of [`ROW_CHUNK`] rows, one contiguous share of them per thread
//! ([`ThreadPool::run_shares`]: a thread claims its own pieces in order, then helps with the others'); (3) per
//! piece, call the row kernel on tiles of up to [`TILE`] activation rows, so each weight block is loaded once
//! per tile.

use crate::kernel::{kernel_for, row_kernel, Isa, Kernel, TILE};
use crate::pool::{split_range, ThreadPool};
use crate::quantize::{act_kind, ActBuffers};
use crate::{is_supported, KernelError};
use gguf::GgmlType;

/// Weight rows handled per kernel call (the output tile lives on the stack).
const ROW_CHUNK: usize = 16;
// The head screen hands `product` groups of 16 interleaved rows: pieces must hold whole groups.
const _: () = assert!(ROW_CHUNK % crate::screen::GROUP == 0);
/// Most activation rows of one kernel call, any kernel.
const MAX_TILE: usize = if TILE > 16 { TILE } else { 16 };
/// Below this many weight bytes × activation tiles the product runs on the calling thread only.
const SERIAL_BYTES: usize = 24 * 1024;

/// Pieces a thread claims at a time from a product's share of `pieces` per thread (`threads` of them): half
/// a share. Claiming piece by piece measured ~4% slower per SmolLM2 forward than whole shares (kprof, one and
/// three rows), and whole shares leave nothing for a thread that arrives early to take from one that was
/// descheduled after it claimed; halves were as fast as whole shares.
fn share_step(pieces: usize, threads: usize) -> usize {
    pieces.div_ceil(2 * threads.max(1))
}

/// How the blocks of a [`QMatrix`] are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// ggml's layout: row after row, each a run of blocks (as in GGUF files).
    #[default]
    Rows,
    /// Groups of 8 rows interleaved block by block ([`crate::repack::interleave8`]; Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, Q8_0):
    /// faster products, but single rows cannot be picked out ([`matmul_rows`], [`QMatrix::row`]).
    Interleaved8,
}

/// A weight matrix in a ggml type: `rows` rows of `cols` elements (GGUF dims `[cols, rows]`), row-major or
/// interleaved ([`Layout`]).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    /// Element type.
    pub ty: GgmlType,
    /// `rows * row_bytes()` bytes; row `r` (or, interleaved, the group of 8 rows from `r`) starts at
    /// `r * row_bytes()`.
    pub data: &'a [u8],
    /// Number of rows (output features).
    pub rows: usize,
    /// Elements per row (input features).
    pub cols: usize,
    /// Block order.
    pub layout: Layout,
}

impl<'a> QMatrix<'a> {
    /// Checks that `ty` is supported, `cols` is a whole number of blocks and `data` holds exactly
    /// `rows` rows.
    pub fn new(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, KernelError> {
        if !is_supported(ty) {
            return Err(KernelError::UnsupportedType(ty.name()));
        }
        let bad = |reason| KernelError::BadShape { ty: ty.name(), rows, cols, data_len: data.len(), reason };
        if cols == 0 || cols % ty.block_size() != 0 {
            return Err(bad("cols is not a positive multiple of the block size"));
        }
        let expected = (cols / ty.block_size()).checked_mul(ty.type_size()).and_then(|rb| rb.checked_mul(rows));
        if expected != Some(data.len()) {
            return Err(bad("data length is not rows * row_bytes"));
        }
        Ok(QMatrix { ty, data, rows, cols, layout: Layout::Rows })
    }

    /// A matrix reordered by [`crate::repack::interleave8`]: `ty` must be Q4_0, Q4_1, Q5_0, Q4_K, Q6_K or Q8_0, `rows`
    /// a multiple of 8, `cols` a whole number of blocks, and `data` exactly the interleaved size.
    pub fn interleaved8(ty: GgmlType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, KernelError> {
        let Some(xb) = crate::repack::x8_block_bytes(ty) else {
            return Err(KernelError::UnsupportedType(ty.name()));
        };
        let bad = |reason| KernelError::BadShape { ty: ty.name(), rows, cols, data_len: data.len(), reason };
        if cols == 0 || cols % ty.block_size() != 0 {
            return Err(bad("cols is not a positive multiple of the block size"));
        }
        if rows % 8 != 0 {
            return Err(bad("interleaved rows are not a multiple of 8"));
        }
        if (rows / 8).checked_mul(cols / ty.block_size() * xb) != Some(data.len()) {
            return Err(bad("data length is not the interleaved size"));
        }
        Ok(QMatrix { ty, data, rows, cols, layout: Layout::Interleaved8 })
    }

    /// Bytes per row (interleaved: an eighth of a group of 8 rows).
    pub fn row_bytes(&self) -> usize {
        let blocks = self.cols / self.ty.block_size();
        match (self.layout, crate::repack::x8_block_bytes(self.ty)) {
            (Layout::Interleaved8, Some(xb)) => blocks * xb / 8,
            _ => blocks * self.ty.type_size(),
        }
    }

    fn raw(&self) -> RawRows<'a> {
        RawRows { data: self.data, rows: self.rows, row_bytes: self.row_bytes() }
    }

    /// The bytes of row `r`.
    ///
    /// # Panics
    /// If the matrix is interleaved (its rows are not contiguous).
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert_eq!(self.layout, Layout::Rows, "QMatrix::row of an interleaved matrix");
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// Reusable buffers for quantized activations; they grow to the largest product seen and never shrink.
#[derive(Default)]
pub struct MatmulScratch {
    pub(crate) acts: ActBuffers,
    /// The head screen's per-share survivor filters ([`crate::HeadScreen`]).
    pub(crate) screen: Vec<crate::screen::ShareFilter>,
    /// The head screen's surviving rows of one token and their exact logits.
    pub(crate) survivors: Vec<u32>,
    pub(crate) survivor_logits: Vec<f32>,
}

/// A raw output pointer shared by the threads of one product, each writing disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(*mut f32);
// SAFETY: used only inside `matmul`/`matmul_rows`, where every thread writes a disjoint set of indices
// of a slice that outlives the parallel region.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[t * w.rows + r] = sum_c W[r, c] * x[t * w.cols + c]` for `t < n_tokens`, `r < w.rows`, with the
/// activations quantized exactly as ggml does for `w.ty`.
///
/// # Panics
/// If `x` has fewer than `n_tokens * w.cols` or `out` fewer than `n_tokens * w.rows` elements.
pub fn matmul(
    pool: &ThreadPool,
    w: &QMatrix,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_isa(Isa::current(), pool, w, x, n_tokens, out, scratch)
}

/// [`matmul`] on a given instruction-set level (tests compare levels).
pub(crate) fn matmul_isa(
    isa: Isa,
    pool: &ThreadPool,
    w: &QMatrix,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (rows, cols, rb) = (w.rows, w.cols, w.row_bytes());
    assert!(x.len() >= n_tokens * cols, "matmul: x has {} elements, need {n_tokens} x {cols}", x.len());
    assert!(out.len() >= n_tokens * rows, "matmul: out has {} elements, need {n_tokens} x {rows}", out.len());
    if n_tokens == 0 || rows == 0 {
        return;
    }
    let (Some(kind), Some(kernel)) = (act_kind(w.ty), kernel_for(isa, w.ty, w.layout)) else {
        panic!("matmul: unsupported type {} (QMatrix::new rejects it)", w.ty.name());
    };
    let raw = RawRows { data: w.data, rows, row_bytes: rb };
    product(pool, kernel, kind, raw, x, cols, n_tokens, out, scratch);
}

/// Weight rows for a kernel: `rows` rows of `row_bytes` bytes each (or, for a group kernel, groups of 8).
#[derive(Clone, Copy)]
pub(crate) struct RawRows<'a> {
    pub data: &'a [u8],
    pub rows: usize,
    pub row_bytes: usize,
}

/// The parallel body of [`matmul`] for any kernel and activation format (also the head screen's approximate
/// pass): quantizes the `n_tokens` rows of `x` into `scratch` and writes `out[t * w.rows + r]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    pool: &ThreadPool,
    kernel: Kernel,
    kind: crate::quantize::ActKind,
    w: RawRows,
    x: &[f32],
    cols: usize,
    n_tokens: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    scratch.acts.reserve(kind, n_tokens, cols);
    scratch.acts.quantize_tokens_parallel(pool, kind, x, cols, n_tokens);
    let acts = scratch.acts.view(kind, x, cols);
    // SAFETY of the writes: `out` holds n_tokens * rows elements (checked by the callers); ranges are disjoint.
    product_quantized(pool, kernel, w, &acts, n_tokens, Out::Slice(OutPtr(out.as_mut_ptr())));
}

/// A tile of a product's results handed to [`Out::Sink`]: `sink(share, t0, r0, nr, buf)` gets the results of
/// weight rows `r0..r0 + nr` for activation rows `t0..t0 + nt`, token-major (`buf[j * nr + i]` is row `r0 + i` of
/// activation row `t0 + j`; `nt = buf.len() / nr`; `nr` is [`ROW_CHUNK`] but for a last piece). `share` is the
/// calling thread's share of [`ThreadPool::run_shares`] (0 on one thread): no two calls with the same share run
/// at once, so per-share state needs no lock.
pub(crate) type Sink<'a> = &'a (dyn Fn(usize, usize, usize, usize, &[f32]) + Sync);

/// Where [`product_quantized`] puts its results.
#[derive(Clone, Copy)]
pub(crate) enum Out<'a> {
    /// `out[t * w.rows + r]`, `n_tokens * w.rows` writable floats no one else touches during the product (an
    /// [`OutPtr`] is made only in this module, from such a slice).
    Slice(OutPtr),
    /// Each tile to a function (group kernels only), nothing stored: the head screen filters its approximate
    /// logits as they are made instead of writing and re-reading them.
    Sink(Sink<'a>),
}

/// [`product`] of activations already quantized (`acts`, `n_tokens` rows), into `out`.
pub(crate) fn product_quantized(
    pool: &ThreadPool,
    kernel: Kernel,
    w: RawRows,
    acts: &crate::quantize::Acts,
    n_tokens: usize,
    out: Out,
) {
    let (rows, rb, cols) = (w.rows, w.row_bytes, acts.cols);
    let work = |share: usize, row_range: std::ops::Range<usize>| {
        // SAFETY: `Out::Slice` holds n_tokens * rows elements (the callers' contract); ranges are disjoint.
        unsafe { rows_work(kernel, w, cols, acts, n_tokens, row_range, out, share) }
    };
    let tiles = n_tokens.div_ceil(TILE);
    let n = pool.n_threads();
    if n == 1 || rows * rb * tiles < SERIAL_BYTES || rows < 2 {
        work(0, 0..rows);
    } else {
        // A contiguous share of ROW_CHUNK pieces per thread, claimed half a share at a time and then helped
        // with: balanced even when a thread is slowed down or arrives late.
        let pieces = rows.div_ceil(ROW_CHUNK);
        pool.run_shares(pieces, share_step(pieces, n), &|share, pieces| {
            work(share, pieces.start * ROW_CHUNK..(pieces.end * ROW_CHUNK).min(rows))
        });
    }
}

/// Rows `row_range` of `w` (`cols` elements each) times the `n_tokens` quantized activation rows, written
/// to `out` ([`Out`]) as the calling thread's share `share`.
///
/// # Safety
/// An [`Out::Slice`] must point at `n_tokens * w.rows` writable floats that no other thread writes at these rows.
///
/// # Panics
/// On an [`Out::Sink`] with a row kernel (sinks take group kernels' token-major tiles).
#[allow(clippy::too_many_arguments)]
unsafe fn rows_work(
    kernel: Kernel,
    w: RawRows,
    cols: usize,
    acts: &crate::quantize::Acts,
    n_tokens: usize,
    row_range: std::ops::Range<usize>,
    out: Out,
    share: usize,
) {
    let (rows, rb) = (w.rows, w.row_bytes);
    // With AMX: the tile kernel (up to 16 activation rows a call) for tiles of at least MIN_ROWS rows, the groups
    // kernel (up to TILE) for the rest; the two give bit-identical results.
    #[cfg(target_arch = "x86_64")]
    let (kernel, tiles) = match kernel {
        Kernel::Tiles { groups, tiles } => (Kernel::Groups(groups), Some(tiles)),
        k => (k, None),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let tiles: Option<crate::kernel::GroupKernel> = None;
    let mut tile = [0.0f32; ROW_CHUNK * MAX_TILE];
    let mut r0 = row_range.start;
    while r0 < row_range.end {
        let r1 = (r0 + ROW_CHUNK).min(row_range.end);
        let wr = &w.data[r0 * rb..r1 * rb];
        let mut t0 = 0;
        while t0 < n_tokens {
            let rest = n_tokens - t0;
            let nr = r1 - r0;
            let (kernel, nt) = match tiles {
                #[cfg(target_arch = "x86_64")]
                Some(t) if rest >= crate::kernel::amx::MIN_ROWS => {
                    (Kernel::Groups(t), rest.min(crate::kernel::amx::ROWS))
                }
                _ => (kernel, rest.min(TILE)),
            };
            let buf = &mut tile[..nr * nt];
            match kernel {
                Kernel::Rows(kernel) => {
                    let Out::Slice(out_ptr) = out else { panic!("a product's sink needs a group kernel") };
                    kernel(wr, rb, acts, t0, nt, buf);
                    for j in 0..nt {
                        // SAFETY: rows r0..r1 < rows and t0 + j < n_tokens (caller's contract); buf holds
                        // nr * nt.
                        unsafe {
                            let dst = out_ptr.0.add((t0 + j) * rows + r0);
                            for i in 0..nr {
                                *dst.add(i) = *buf.get_unchecked(i * nt + j);
                            }
                        }
                    }
                }
                Kernel::Groups(kernel) => {
                    // Token-major tile: each token's nr results are contiguous, as in `out`.
                    kernel(wr, cols, acts, t0, nt, buf, nr);
                    match out {
                        Out::Slice(out_ptr) => {
                            for j in 0..nt {
                                // SAFETY: as above.
                                unsafe {
                                    let dst = out_ptr.0.add((t0 + j) * rows + r0);
                                    std::ptr::copy_nonoverlapping(buf.as_ptr().add(j * nr), dst, nr);
                                }
                            }
                        }
                        Out::Sink(sink) => sink(share, t0, r0, nr, buf),
                    }
                }
                #[cfg(target_arch = "x86_64")]
                Kernel::Tiles { .. } => unreachable!("resolved above"),
            }
            t0 += nt;
        }
        r0 = r1;
    }
    #[cfg(target_arch = "x86_64")]
    if tiles.is_some() {
        crate::kernel::amx::release();
    }
}

/// Several products of the same activations: `outs[m] = mats[m] × x` for every `m` (each as [`matmul`]),
/// with `x` quantized once and the union of all matrices' rows split across the pool in one parallel
/// region (e.g. the q/k/v or gate/up projections of a layer). Results are bit-identical to separate
/// [`matmul`] calls. Matrices of different types or widths fall back to separate calls.
///
/// # Panics
/// As [`matmul`], for any pair.
pub fn matmul_many(
    pool: &ThreadPool,
    mats: &mut [(&QMatrix, &mut [f32])],
    x: &[f32],
    n_tokens: usize,
    scratch: &mut MatmulScratch,
) {
    matmul_many_isa(Isa::current(), pool, mats, x, n_tokens, scratch, None)
}

/// An element-wise step on matching pieces of two products' outputs ([`matmul_pair_then`]).
pub type PairThen<'a> = &'a (dyn Fn(&mut [f32], &[f32]) + Sync);

/// `a = wa × x` and `b = wb × x` as [`matmul_many`] (the same number of rows), then, inside the
/// same parallel region, `then(a_piece, b_piece)` on matching pieces of one token's rows of `a` and `b` until
/// every token's every row went through it once (in any order, pieces in parallel): an element-wise step such
/// as a gated activation, run by the thread that just computed those rows instead of in another region
/// (a region costs about a microsecond of hand-off on the 2-core machines; a layer had six). Matrices of
/// different types or layouts are multiplied one after the other and the step runs after both, on this thread.
///
/// # Panics
/// As [`matmul`], or if the two matrices differ in rows.
#[allow(clippy::too_many_arguments)]
pub fn matmul_pair_then(
    pool: &ThreadPool,
    wa: &QMatrix,
    wb: &QMatrix,
    x: &[f32],
    n_tokens: usize,
    a: &mut [f32],
    b: &mut [f32],
    scratch: &mut MatmulScratch,
    then: PairThen,
) {
    assert!(wa.rows == wb.rows, "matmul_pair_then: the matrices differ in rows ({} and {})", wa.rows, wb.rows);
    matmul_many_isa(Isa::current(), pool, &mut [(wa, a), (wb, b)], x, n_tokens, scratch, Some(then))
}

/// At most this many matrices per [`matmul_many`] call share one parallel region.
const MANY_MAX: usize = 8;

/// [`matmul_many`] on a given instruction-set level.
pub(crate) fn matmul_many_isa(
    isa: Isa,
    pool: &ThreadPool,
    mats: &mut [(&QMatrix, &mut [f32])],
    x: &[f32],
    n_tokens: usize,
    scratch: &mut MatmulScratch,
    then: Option<PairThen>,
) {
    let Some(first) = mats.first().map(|(w, _)| **w) else { return };
    let (ty, cols, layout) = (first.ty, first.cols, first.layout);
    // `then` (only with two matrices of equal rows) on whole rows of every token, after both products.
    let then_all = |mats: &mut [(&QMatrix, &mut [f32])]| {
        if let (Some(then), [(wa, a), (_, b)]) = (then, mats) {
            for t in 0..n_tokens {
                let rows = t * wa.rows..(t + 1) * wa.rows;
                then(&mut a[rows.clone()], &b[rows]);
            }
        }
    };
    if mats.len() == 1
        || mats.len() > MANY_MAX
        || mats.iter().any(|(w, _)| w.ty != ty || w.cols != cols || w.layout != layout)
    {
        for (w, out) in mats.iter_mut() {
            matmul_isa(isa, pool, w, x, n_tokens, out, scratch);
        }
        then_all(mats);
        return;
    }
    assert!(x.len() >= n_tokens * cols, "matmul_many: x has {} elements, need {n_tokens} x {cols}", x.len());
    for (w, out) in mats.iter() {
        assert!(
            out.len() >= n_tokens * w.rows,
            "matmul_many: out has {} elements, need {n_tokens} x {}",
            out.len(),
            w.rows
        );
    }
    if n_tokens == 0 {
        return;
    }
    let (Some(kind), Some(kernel)) = (act_kind(ty), kernel_for(isa, ty, layout)) else {
        panic!("matmul_many: unsupported type {} (QMatrix::new rejects it)", ty.name());
    };
    scratch.acts.reserve(kind, n_tokens, cols);
    scratch.acts.quantize_tokens_parallel(pool, kind, x, cols, n_tokens);
    let acts = scratch.acts.view(kind, x, cols);
    let mut ws: [Option<(&QMatrix, OutPtr)>; MANY_MAX] = [None; MANY_MAX];
    let mut total_rows = 0;
    for (slot, (w, out)) in ws.iter_mut().zip(mats.iter_mut()) {
        *slot = Some((*w, OutPtr(out.as_mut_ptr())));
        total_rows += w.rows;
    }
    let ws = &ws[..mats.len()];
    let tiles = n_tokens.div_ceil(TILE);
    let n = pool.n_threads();
    if n == 1 || total_rows * first.row_bytes() * tiles < SERIAL_BYTES {
        for &(w, out_ptr) in ws.iter().flatten() {
            // SAFETY: each output was checked to hold n_tokens * w.rows elements.
            unsafe { rows_work(kernel, w.raw(), cols, &acts, n_tokens, 0..w.rows, Out::Slice(out_ptr), 0) };
        }
        then_all(mats);
        return;
    }
    if let (Some(then), [Some((wa, a)), Some((wb, b))]) = (then, ws) {
        // Matching pieces of both matrices per item, then `then` on them, token by token.
        let (rows, pieces) = (wa.rows, wa.rows.div_ceil(ROW_CHUNK));
        pool.run_shares(pieces, share_step(pieces, n), &|_, items| {
            for i in items {
                let range = i * ROW_CHUNK..((i + 1) * ROW_CHUNK).min(rows);
                // SAFETY: both outputs hold n_tokens * rows elements (checked above); pieces are disjoint, so
                // the slices below are this thread's alone.
                unsafe {
                    rows_work(kernel, wa.raw(), cols, &acts, n_tokens, range.clone(), Out::Slice(*a), 0);
                    rows_work(kernel, wb.raw(), cols, &acts, n_tokens, range.clone(), Out::Slice(*b), 0);
                    for t in 0..n_tokens {
                        let at = std::slice::from_raw_parts_mut(a.0.add(t * rows + range.start), range.len());
                        let bt = std::slice::from_raw_parts(b.0.add(t * rows + range.start), range.len());
                        then(at, bt);
                    }
                }
            }
        });
        return;
    }
    // The ROW_CHUNK pieces of all matrices, counted through them in order, in one share per thread.
    let n_items: usize = ws.iter().flatten().map(|(w, _)| w.rows.div_ceil(ROW_CHUNK)).sum();
    pool.run_shares(n_items, share_step(n_items, n), &|_, pieces| {
        for mut i in pieces {
            for &(w, out_ptr) in ws.iter().flatten() {
                let c = w.rows.div_ceil(ROW_CHUNK);
                if i < c {
                    let range = i * ROW_CHUNK..((i + 1) * ROW_CHUNK).min(w.rows);
                    // SAFETY: each output holds n_tokens * w.rows elements; pieces are disjoint.
                    unsafe { rows_work(kernel, w.raw(), cols, &acts, n_tokens, range, Out::Slice(out_ptr), 0) };
                    break;
                }
                i -= c;
            }
        }
    });
}

/// `out[i] = row(row_ids[i]) · x` for one activation row `x` (`w.cols` elements).
///
/// # Panics
/// If a row id is out of range, `x` is shorter than `w.cols` or `out` shorter than `row_ids`.
pub fn matmul_rows(
    pool: &ThreadPool,
    w: &QMatrix,
    row_ids: &[u32],
    x: &[f32],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_rows_isa(Isa::current(), pool, w, row_ids, x, row_ids.len().max(1), out, scratch)
}

/// Grouped [`matmul_rows`]: `out[i] = row(row_ids[i]) · x_(i / per_row)`, where `x` holds
/// `row_ids.len() / per_row` activation rows of `w.cols` elements — each activation row against its own few
/// weight rows (every draft-tree node against its own candidates' head rows), in one call.
///
/// # Panics
/// If a row id is out of range, `per_row` is 0, `x` holds fewer rows than the ids need or `out` is shorter
/// than `row_ids`.
pub fn matmul_rows_grouped(
    pool: &ThreadPool,
    w: &QMatrix,
    row_ids: &[u32],
    x: &[f32],
    per_row: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    matmul_rows_isa(Isa::current(), pool, w, row_ids, x, per_row, out, scratch)
}

/// [`matmul_rows_grouped`] on a given instruction-set level.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_rows_isa(
    isa: Isa,
    pool: &ThreadPool,
    w: &QMatrix,
    row_ids: &[u32],
    x: &[f32],
    per_row: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
) {
    let (cols, rb) = (w.cols, w.row_bytes());
    assert!(per_row > 0, "matmul_rows: per_row must be positive");
    let n_x = row_ids.len().div_ceil(per_row).max(1);
    assert!(x.len() >= n_x * cols, "matmul_rows: x has {} elements, need {}", x.len(), n_x * cols);
    assert!(out.len() >= row_ids.len(), "matmul_rows: out has {} elements for {} ids", out.len(), row_ids.len());
    assert_eq!(w.layout, Layout::Rows, "matmul_rows: an interleaved matrix has no contiguous rows");
    if let Some(&bad) = row_ids.iter().find(|&&id| id as usize >= w.rows) {
        panic!("matmul_rows: row id {bad} out of range (matrix has {} rows)", w.rows);
    }
    let (Some(kind), Some(kernel)) = (act_kind(w.ty), row_kernel(isa, w.ty)) else {
        panic!("matmul_rows: unsupported type {} (QMatrix::new rejects it)", w.ty.name());
    };
    scratch.acts.reserve(kind, n_x, cols);
    scratch.acts.quantize_tokens(kind, x, cols, 0..n_x);
    let acts = scratch.acts.view(kind, x, cols);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let work = |ids: std::ops::Range<usize>| {
        let out_ptr = &out_ptr;
        for i in ids {
            let r = row_ids[i] as usize;
            let mut one = [0.0f32];
            kernel(&w.data[r * rb..(r + 1) * rb], rb, &acts, i / per_row, 1, &mut one);
            // SAFETY: i < row_ids.len() <= out.len(); ids are split disjointly between threads.
            unsafe { *out_ptr.0.add(i) = one[0] };
        }
    };
    if pool.n_threads() == 1 || row_ids.len() * rb < SERIAL_BYTES || row_ids.len() < 2 {
        work(0..row_ids.len());
    } else {
        pool.run(&|i, n| work(split_range(row_ids.len(), i, n)));
    }
}
