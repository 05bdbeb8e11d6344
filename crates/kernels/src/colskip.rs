//! Column-skipping matrix × vector products for activation sparsity (issue #39 item 2).
//!
//! With TEAL-style sparsity a layer's input vector `x` has many exact zeros; in ggml's row layout every weight
//! row still holds one value per input, so a dense product reads every byte whatever `x` is. A [`ColMatrix`]
//! stores the same 4-bit weights **column-major by tiles of [`TILE`] outputs**: for each tile, the codes of one
//! input column are 32 contiguous bytes, so a product reads only the columns whose input is non-zero, and the
//! scales of a group of 32 inputs only when one of them is.
//!
//! Numbers: as the dense kernels, the row is first quantized to 8 bits per group of 32 inputs (Q8_1 for Q4_1
//! weights, Q8_0 for Q4_0: [`crate::quantize`]), and a Q4_0/Q4_1 weight is `d · q + m` with `d`, `m` per row and
//! group (`m = −8 d` for Q4_0), so `y_i = Σ_g (d_ig · dx_g · Σ_{j∈g} q_ij xq_j + m_ig · s_g)` — the dense kernel's
//! block formula with the same integers; only the order of the float additions over groups differs. An input that
//! quantizes to zero is skipped (it adds nothing in the dense product either), as is the whole group, scales
//! included, when all its inputs do. Integer sums: in 16-bit lanes (one `vpmullw` and one `vpaddw` per 32 outputs
//! and column, widened every 16 columns; scalar, AVX2, AVX-512), or, with AVX-512 VNNI and rows a multiple of 128,
//! with `vpdpbusd` on four columns at a time whose code bytes are interleaved per product by 8 unpacks (the
//! accumulators then hold outputs in the unpacks' order, [`vnni_position`], put back once per product).
//! Measured 1.4–1.6× (VNNI) and 2.0–2.4× (i16) dense's time per weight read (heads/README.md).
//!
//! Layout: column after column, each holding all its outputs: `codes[j · rows / 2 + 32 t + k]` holds output
//! `64 t + k` in its low nibble and `64 t + 32 + k` in its high nibble; `scales[g · 2 · rows + r]` is row `r`'s
//! `d` (f16) in group `g`, `scales[g · 2 · rows + rows + r]` its `m`. A skipped column is `rows / 2` contiguous
//! bytes not read (7 cache lines for a Qwen2.5-0.5B projection). The work goes group by group (a group's columns,
//! `16 · rows` bytes, stay in L1 while its tiles of 64 outputs are swept); threads take contiguous ranges of
//! groups holding about the same number of non-zero inputs and sum into their own outputs, added at the end. The
//! codes are the dense matrix's 4 bits per weight; the scales add 1 bit per weight (dense Q4_1: 1 bit as well,
//! inside its blocks), so a matrix costs its dense size again in memory.
//!
//! Rows must be a multiple of [`TILE`] (every projection of the default models is).

use crate::blocks::{f16_to_f32, Q4_0_BYTES, Q4_1_BYTES, QK};
use crate::kernel::Isa;
use crate::pool::ThreadPool;
use crate::{KernelError, Layout, QMatrix};
use gguf::GgmlType;

/// Outputs per tile.
pub const TILE: usize = 64;
/// Inputs per scale group.
const GROUP: usize = QK;
/// Code bytes of one column in one tile.
const COL_BYTES: usize = TILE / 2;

/// A 4-bit weight matrix stored column-major by tiles (module doc), built from a Q4_0 or Q4_1 matrix.
#[derive(Clone, Debug)]
pub struct ColMatrix {
    rows: usize,
    cols: usize,
    /// Q4_1 (activations as Q8_1) rather than Q4_0 (Q8_0).
    has_min: bool,
    codes: Vec<u8>,
    scales: Vec<u16>,
    /// The same scales in the order of the VNNI kernel's accumulators ([`vnni_position`]); empty unless rows are
    /// a multiple of 128.
    vnni_scales: Vec<u16>,
}

impl ColMatrix {
    /// Repacks a row-layout Q4_0 or Q4_1 matrix (the values are unchanged).
    pub fn from_rows(m: &QMatrix) -> Result<ColMatrix, KernelError> {
        let bad = |reason| KernelError::BadShape {
            ty: m.ty.name(),
            rows: m.rows,
            cols: m.cols,
            data_len: m.data.len(),
            reason,
        };
        let (block_bytes, has_min) = match m.ty {
            GgmlType::Q4_0 => (Q4_0_BYTES, false),
            GgmlType::Q4_1 => (Q4_1_BYTES, true),
            other => return Err(KernelError::UnsupportedType(other.name())),
        };
        if m.layout != Layout::Rows {
            return Err(bad("column layout is made from the row layout"));
        }
        if m.rows % TILE != 0 {
            return Err(bad("rows are not a multiple of the column tile (64)"));
        }
        let (rows, cols) = (m.rows, m.cols);
        let groups = cols / GROUP;
        let mut codes = vec![0u8; rows * cols / 2];
        let mut scales = vec![0u16; groups * 2 * rows];
        for r in 0..rows {
            let (tile, o) = (r / TILE, r % TILE);
            let (hi, k) = (o / 32, o % 32);
            let row = m.row(r);
            for g in 0..groups {
                let b = &row[g * block_bytes..(g + 1) * block_bytes];
                let d = u16::from_le_bytes([b[0], b[1]]);
                let (mn, qs) = if has_min {
                    (u16::from_le_bytes([b[2], b[3]]), &b[4..20])
                } else {
                    // −8·d is exact in f16 (a power-of-two scaling) unless it overflows, which a finite d·8 can not
                    // for the scales quantizers write (|d| < 8192).
                    (crate::blocks::f32_to_f16(-8.0 * f16_to_f32(d)), &b[2..18])
                };
                scales[g * 2 * rows + r] = d;
                scales[g * 2 * rows + rows + r] = mn;
                for e in 0..GROUP {
                    let q = if e < 16 { qs[e] & 0x0F } else { qs[e - 16] >> 4 };
                    let j = g * GROUP + e;
                    let at = j * rows / 2 + tile * COL_BYTES + k;
                    codes[at] |= q << (4 * hi);
                }
            }
        }
        let vnni_scales = if rows % VNNI_BLOCK == 0 {
            let mut v = vec![0u16; scales.len()];
            for g in 0..groups {
                for i in 0..rows {
                    let r = vnni_position(i);
                    v[g * 2 * rows + i] = scales[g * 2 * rows + r];
                    v[g * 2 * rows + rows + i] = scales[g * 2 * rows + rows + r];
                }
            }
            v
        } else {
            Vec::new()
        };
        Ok(ColMatrix { rows, cols, has_min, codes, scales, vnni_scales })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (codes and scales).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 2 * self.scales.len()
    }
}

/// Outputs per block of the VNNI kernel (64 code bytes of a column: two tiles).
const VNNI_BLOCK: usize = 128;

/// The output held at position `i` of the VNNI kernel's accumulator order. Within a block of 128 outputs,
/// position `((h · 4 + k) · 4 + l) · 4 + e` is lane `l` (of four 128-bit lanes), dword `4 k + e`... precisely:
/// the byte unpacks interleave four columns within each 128-bit lane, so accumulator `k` of nibble half `h`
/// (`h = 0`: low nibbles) holds, in lane `l`, outputs `base(h, l) + 4 k .. + 4`, where `base` is the first output of
/// that lane's 16 code bytes.
fn vnni_position(i: usize) -> usize {
    let (block, j) = (i / VNNI_BLOCK, i % VNNI_BLOCK);
    let (h, k, l, e) = (j / 64, (j / 16) % 4, (j / 4) % 4, j % 4);
    // Lane l holds code bytes 16 l .. 16 l + 16 of the 64 loaded: bytes 0..32 are tile 0 (low nibble: outputs
    // 0..32, high: 32..64), bytes 32..64 tile 1 (outputs 64..96 and 96..128).
    let base = [[0, 16, 64, 80], [32, 48, 96, 112]][h][l];
    block * VNNI_BLOCK + base + 4 * k + e
}

/// One activation row quantized as the dense kernels quantize it (8 bits per group of 32: Q8_1 for Q4_1, Q8_0
/// for Q4_0), and its non-zero quantized inputs by group (reused between products).
#[derive(Default, Debug)]
pub struct ColScratch {
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    idx: Vec<u32>,
    val: Vec<i16>,
    /// `start[g]..start[g + 1]`: group `g`'s entries of `idx` / `val`.
    start: Vec<u32>,
    /// Per-thread partial outputs.
    partial: Vec<f32>,
}

impl ColScratch {
    fn gather(&mut self, x: &[f32], has_min: bool) {
        let groups = x.len() / GROUP;
        self.qs.resize(x.len(), 0);
        self.d.resize(groups, 0.0);
        self.s.resize(groups, 0.0);
        crate::quantize::quantize_q8_row(x, &mut self.qs, &mut self.d, &mut self.s, has_min);
        // Q8_0's `s` is `f16(d) · Σq`: what `m · s` needs with Q4_0's `m = −8 d_w`.
        self.idx.clear();
        self.val.clear();
        self.start.clear();
        for (g, chunk) in self.qs.chunks_exact(GROUP).enumerate() {
            self.start.push(self.idx.len() as u32);
            for (e, &q) in chunk.iter().enumerate() {
                // An input that quantizes to 0 adds nothing in the dense kernels either: skipping it is exact.
                if q != 0 {
                    self.idx.push((g * GROUP + e) as u32);
                    self.val.push(i16::from(q));
                }
            }
        }
        self.start.push(self.idx.len() as u32);
    }

    fn groups(&self) -> usize {
        self.start.len().saturating_sub(1)
    }
}

/// Per-thread partial outputs of one product (each thread sums a range of input groups into its own).
#[derive(Clone, Copy)]
struct PartPtr(*mut f32);
// SAFETY: thread `i` writes only `partial[i · rows .. (i + 1) · rows]` of a buffer that outlives the parallel region.
unsafe impl Send for PartPtr {}
unsafe impl Sync for PartPtr {}

impl PartPtr {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not its raw field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out = W · x` for one activation row, reading only the columns of `W` whose `x` is non-zero.
///
/// # Panics
/// If `x.len() != w.cols()` or `out.len() != w.rows()`.
pub fn colskip_matvec(pool: &ThreadPool, w: &ColMatrix, x: &[f32], out: &mut [f32], scratch: &mut ColScratch) {
    colskip_matvec_isa(Isa::current(), pool, w, x, out, scratch)
}

pub(crate) fn colskip_matvec_isa(
    isa: Isa,
    pool: &ThreadPool,
    w: &ColMatrix,
    x: &[f32],
    out: &mut [f32],
    scratch: &mut ColScratch,
) {
    assert_eq!(x.len(), w.cols, "colskip_matvec: activation length");
    assert_eq!(out.len(), w.rows, "colskip_matvec: output length");
    scratch.gather(x, w.has_min);
    let groups = scratch.groups();
    let nonzero = scratch.idx.len();
    let threads = pool.n_threads().min(groups).max(1);
    if threads == 1 || nonzero < 64 {
        out.fill(0.0);
        group_range(isa, w, 0..groups, scratch, out);
        return;
    }
    // Split the groups so that each thread gets about the same number of non-zero columns (the work), each
    // summing into its own partial output; then add the partials.
    let mut bounds = Vec::with_capacity(threads + 1);
    bounds.push(0usize);
    for i in 1..threads {
        let want = (nonzero * i / threads) as u32;
        bounds.push(scratch.start.partition_point(|&s| s < want).min(groups).max(bounds[i - 1]));
    }
    bounds.push(groups);
    let rows = w.rows;
    let mut partial = std::mem::take(&mut scratch.partial);
    partial.resize(threads * rows, 0.0);
    let ptr = PartPtr(partial.as_mut_ptr());
    let acts = &*scratch;
    pool.run(&|index, _| {
        if index < threads {
            // SAFETY: each index writes its own `rows` floats of `partial`.
            let y = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(index * rows), rows) };
            y.fill(0.0);
            group_range(isa, w, bounds[index]..bounds[index + 1], acts, y);
        }
    });
    out.copy_from_slice(&partial[..rows]);
    for part in partial[rows..].chunks_exact(rows) {
        for (o, p) in out.iter_mut().zip(part) {
            *o += p;
        }
    }
    scratch.partial = partial;
}

/// Adds the products of the input groups `gs` into `y` (all `rows` outputs).
fn group_range(isa: Isa, w: &ColMatrix, gs: std::ops::Range<usize>, acts: &ColScratch, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 && !w.vnni_scales.is_empty() && std::env::var_os("SPECEE_COLSKIP_I16").is_none() {
            let mut perm = vec![0.0f32; w.rows];
            // SAFETY: as below; `perm` holds `rows` floats, `rows` is a multiple of 128.
            unsafe { avx512::groups_vnni(&w.codes, &w.vnni_scales, w.rows, gs, acts, &mut perm) };
            for (i, v) in perm.iter().enumerate() {
                y[vnni_position(i)] += v;
            }
            return;
        }
        if isa == Isa::Avx512 {
            // SAFETY: the level was checked available when chosen; every index the kernel forms is below
            // `cols · rows / 2` (codes) or `groups · 2 · rows` (scales): `idx < cols`, tiles `< rows / 64`.
            unsafe { avx512::groups(&w.codes, &w.scales, w.rows, gs, acts, y) };
            return;
        }
        if isa == Isa::Avx2 {
            // SAFETY: as above.
            unsafe { avx2::groups(&w.codes, &w.scales, w.rows, gs, acts, y) };
            return;
        }
    }
    let _ = isa;
    groups_scalar(&w.codes, &w.scales, w.rows, gs, acts, y);
}

fn groups_scalar(
    codes: &[u8],
    scales: &[u16],
    rows: usize,
    gs: std::ops::Range<usize>,
    acts: &ColScratch,
    y: &mut [f32],
) {
    let stride = rows / 2;
    for g in gs {
        let (s, e) = (acts.start[g] as usize, acts.start[g + 1] as usize);
        if s == e {
            continue;
        }
        let sc = &scales[g * 2 * rows..(g + 1) * 2 * rows];
        let (dx, sum) = (acts.d[g], acts.s[g]);
        for tile in 0..rows / TILE {
            let mut t = [0i32; TILE];
            for n in s..e {
                let (j, v) = (acts.idx[n] as usize, i32::from(acts.val[n]));
                let c = &codes[j * stride + tile * COL_BYTES..j * stride + (tile + 1) * COL_BYTES];
                for k in 0..COL_BYTES {
                    t[k] += v * i32::from(c[k] & 0x0F);
                    t[32 + k] += v * i32::from(c[k] >> 4);
                }
            }
            for (o, &t) in t.iter().enumerate() {
                let r = tile * TILE + o;
                y[r] += f16_to_f32(sc[r]) * dx * t as f32 + f16_to_f32(sc[rows + r]) * sum;
            }
        }
    }
}

/// Columns summed in 16-bit lanes before widening: |q · x| ≤ 15 · 127 = 1,905, and 17 of them fit in an i16.
const I16_RUN: usize = 16;

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{ColScratch, COL_BYTES, I16_RUN, TILE, VNNI_BLOCK};
    use std::arch::x86_64::*;

    /// Prefetches group `g + 1`'s non-zero columns, whole, while group `g` runs: the sweeps read 32 or 64 bytes
    /// of every column at a time, a pattern the hardware prefetchers do not follow.
    #[inline(always)]
    unsafe fn prefetch_next_group(cp: *const u8, stride: usize, acts: &ColScratch, g: usize) {
        if g + 1 < acts.groups() {
            let (ns, ne) = (*acts.start.get_unchecked(g + 1) as usize, *acts.start.get_unchecked(g + 2) as usize);
            for n in ns..ne {
                let p = cp.add(*acts.idx.get_unchecked(n) as usize * stride);
                let mut off = 0;
                while off < stride {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(off) as *const i8);
                    off += 64;
                }
            }
        }
    }

    /// `y[r..r + 16] += d · dx · sums + m · s` for 16 outputs' integer sums of one group (`sp`: the group's
    /// scales, `d` at `sp[r..]`, `m` at `sp[rows + r..]`).
    #[inline]
    #[target_feature(enable = "avx512f,f16c,fma")]
    unsafe fn scale_into(sums: __m512i, sp: *const u16, rows: usize, r: usize, dx: __m512, s: __m512, y: &mut [f32]) {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(r) as *const __m256i));
        let m = _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(rows + r) as *const __m256i));
        let yp = y.as_mut_ptr().add(r);
        let t = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), dx);
        let acc = _mm512_fmadd_ps(d, t, _mm512_loadu_ps(yp));
        _mm512_storeu_ps(yp, _mm512_fmadd_ps(m, s, acc));
    }

    /// The VNNI form: per group and block of 128 outputs, the non-zero columns four at a time: their 64 code bytes
    /// interleaved byte by byte within each 128-bit lane (two rounds of unpacks, 8 shuffles per quad) so that every
    /// dword holds one code byte of each of the four columns, then split into nibbles and one `vpdpbusd` per 16
    /// outputs with the four inputs' 8-bit values (a missing fourth column has input 0). `y` is in
    /// [`super::vnni_position`] order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    pub(super) unsafe fn groups_vnni(
        codes: &[u8],
        scales: &[u16],
        rows: usize,
        gs: std::ops::Range<usize>,
        acts: &ColScratch,
        y: &mut [f32],
    ) {
        let mask = _mm512_set1_epi8(0x0F);
        let stride = rows / 2;
        let cp = codes.as_ptr();
        for g in gs {
            let (s, e) = (*acts.start.get_unchecked(g) as usize, *acts.start.get_unchecked(g + 1) as usize);
            if s == e {
                continue;
            }
            prefetch_next_group(cp, stride, acts, g);
            // Quads of (column offset, packed inputs).
            let mut quads = [(0usize, 0usize, 0usize, 0usize, 0i32); 8];
            let mut nq = 0;
            let mut n = s;
            while n < e {
                let col = |m: usize| {
                    if m < e {
                        (*acts.idx.get_unchecked(m) as usize * stride, *acts.val.get_unchecked(m) as i8 as u8 as i32)
                    } else {
                        (*acts.idx.get_unchecked(s) as usize * stride, 0)
                    }
                };
                let (c0, x0) = col(n);
                let (c1, x1) = col(n + 1);
                let (c2, x2) = col(n + 2);
                let (c3, x3) = col(n + 3);
                quads[nq] = (c0, c1, c2, c3, x0 | (x1 << 8) | (x2 << 16) | (x3 << 24));
                nq += 1;
                n += 4;
            }
            let sp = scales.as_ptr().add(g * 2 * rows);
            let dx = _mm512_set1_ps(*acts.d.get_unchecked(g));
            let sum = _mm512_set1_ps(*acts.s.get_unchecked(g));
            for block in 0..rows / VNNI_BLOCK {
                let base = cp.add(block * 2 * COL_BYTES);
                let mut acc = [_mm512_setzero_si512(); 8];
                for &(c0, c1, c2, c3, xs) in &quads[..nq] {
                    let x = _mm512_set1_epi32(xs);
                    let v0 = _mm512_loadu_si512(base.add(c0) as *const _);
                    let v1 = _mm512_loadu_si512(base.add(c1) as *const _);
                    let v2 = _mm512_loadu_si512(base.add(c2) as *const _);
                    let v3 = _mm512_loadu_si512(base.add(c3) as *const _);
                    // Interleave the raw bytes (the nibble split commutes with moving bytes): every dword then
                    // holds one code byte of each of the four columns, two outputs' codes (low and high nibble).
                    let ab_lo = _mm512_unpacklo_epi8(v0, v1);
                    let ab_hi = _mm512_unpackhi_epi8(v0, v1);
                    let cd_lo = _mm512_unpacklo_epi8(v2, v3);
                    let cd_hi = _mm512_unpackhi_epi8(v2, v3);
                    let w = [
                        _mm512_unpacklo_epi16(ab_lo, cd_lo),
                        _mm512_unpackhi_epi16(ab_lo, cd_lo),
                        _mm512_unpacklo_epi16(ab_hi, cd_hi),
                        _mm512_unpackhi_epi16(ab_hi, cd_hi),
                    ];
                    for k in 0..4 {
                        acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_and_si512(w[k], mask), x);
                        let hi = _mm512_and_si512(_mm512_srli_epi16(w[k], 4), mask);
                        acc[4 + k] = _mm512_dpbusd_epi32(acc[4 + k], hi, x);
                    }
                }
                for (q, a) in acc.iter().enumerate() {
                    scale_into(*a, sp, rows, block * VNNI_BLOCK + 16 * q, dx, sum, y);
                }
            }
        }
    }

    /// Per group and tile of 64 outputs: each non-zero column's 32 code bytes widened to 16-bit lanes (low
    /// nibbles: outputs 0..32 of the tile, high: 32..64) times the input, summed in i16 over runs of up to 16
    /// columns and in i32 over the group, then scaled into `y`. A group's columns (32 · rows / 2 bytes) stay in
    /// L1 while its tiles are swept.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn groups(
        codes: &[u8],
        scales: &[u16],
        rows: usize,
        gs: std::ops::Range<usize>,
        acts: &ColScratch,
        y: &mut [f32],
    ) {
        let mask = _mm512_set1_epi16(0x0F);
        let stride = rows / 2;
        let cp = codes.as_ptr();
        for g in gs {
            let (s, e) = (*acts.start.get_unchecked(g) as usize, *acts.start.get_unchecked(g + 1) as usize);
            if s == e {
                continue;
            }
            prefetch_next_group(cp, stride, acts, g);
            let sp = scales.as_ptr().add(g * 2 * rows);
            let dx = _mm512_set1_ps(*acts.d.get_unchecked(g));
            let sum = _mm512_set1_ps(*acts.s.get_unchecked(g));
            for tile in 0..rows / TILE {
                let base = cp.add(tile * COL_BYTES);
                let mut wide = [_mm512_setzero_si512(); 4];
                let mut n = s;
                while n < e {
                    let end = (n + I16_RUN).min(e);
                    let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    while n < end {
                        let p = base.add(*acts.idx.get_unchecked(n) as usize * stride);
                        let v = _mm512_set1_epi16(*acts.val.get_unchecked(n));
                        let b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
                        lo = _mm512_add_epi16(lo, _mm512_mullo_epi16(_mm512_and_si512(b, mask), v));
                        hi = _mm512_add_epi16(hi, _mm512_mullo_epi16(_mm512_srli_epi16(b, 4), v));
                        n += 1;
                    }
                    wide[0] = _mm512_add_epi32(wide[0], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(lo)));
                    wide[1] = _mm512_add_epi32(wide[1], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(lo, 1)));
                    wide[2] = _mm512_add_epi32(wide[2], _mm512_cvtepi16_epi32(_mm512_castsi512_si256(hi)));
                    wide[3] = _mm512_add_epi32(wide[3], _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(hi, 1)));
                }
                for (q, w) in wide.iter().enumerate() {
                    scale_into(*w, sp, rows, tile * TILE + 16 * q, dx, sum, y);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ColScratch, COL_BYTES, I16_RUN, TILE};
    use std::arch::x86_64::*;

    /// [`super::avx512::groups`] with 16-lane vectors: code bytes 0..16 give outputs 0..16 and 32..48 of the
    /// tile, bytes 16..32 outputs 16..32 and 48..64.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn groups(
        codes: &[u8],
        scales: &[u16],
        rows: usize,
        gs: std::ops::Range<usize>,
        acts: &ColScratch,
        y: &mut [f32],
    ) {
        let mask = _mm256_set1_epi16(0x0F);
        let stride = rows / 2;
        let cp = codes.as_ptr();
        for g in gs {
            let (s, e) = (*acts.start.get_unchecked(g) as usize, *acts.start.get_unchecked(g + 1) as usize);
            if s == e {
                continue;
            }
            let sp = scales.as_ptr().add(g * 2 * rows);
            let dx = _mm256_set1_ps(*acts.d.get_unchecked(g));
            let sum = _mm256_set1_ps(*acts.s.get_unchecked(g));
            for tile in 0..rows / TILE {
                let base = cp.add(tile * COL_BYTES);
                // Eight vectors of 8 i32: outputs 8q .. 8q + 8 of the tile.
                let mut wide = [_mm256_setzero_si256(); 8];
                let mut n = s;
                while n < e {
                    let end = (n + I16_RUN).min(e);
                    // Outputs 0..16, 16..32, 32..48, 48..64 in i16.
                    let mut part = [_mm256_setzero_si256(); 4];
                    while n < end {
                        let p = base.add(*acts.idx.get_unchecked(n) as usize * stride);
                        let v = _mm256_set1_epi16(*acts.val.get_unchecked(n));
                        let b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
                        let b1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(16) as *const __m128i));
                        part[0] = _mm256_add_epi16(part[0], _mm256_mullo_epi16(_mm256_and_si256(b0, mask), v));
                        part[1] = _mm256_add_epi16(part[1], _mm256_mullo_epi16(_mm256_and_si256(b1, mask), v));
                        part[2] = _mm256_add_epi16(part[2], _mm256_mullo_epi16(_mm256_srli_epi16(b0, 4), v));
                        part[3] = _mm256_add_epi16(part[3], _mm256_mullo_epi16(_mm256_srli_epi16(b1, 4), v));
                        n += 1;
                    }
                    for (i, p) in part.iter().enumerate() {
                        let lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(*p));
                        let hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(*p, 1));
                        wide[2 * i] = _mm256_add_epi32(wide[2 * i], lo);
                        wide[2 * i + 1] = _mm256_add_epi32(wide[2 * i + 1], hi);
                    }
                }
                for (q, w) in wide.iter().enumerate() {
                    let r = tile * TILE + 8 * q;
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(r) as *const __m128i));
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(rows + r) as *const __m128i));
                    let yp = y.as_mut_ptr().add(r);
                    let t = _mm256_mul_ps(_mm256_cvtepi32_ps(*w), dx);
                    let acc = _mm256_fmadd_ps(d, t, _mm256_loadu_ps(yp));
                    _mm256_storeu_ps(yp, _mm256_fmadd_ps(m, sum, acc));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::testutil::{random_weights, Rng};

    fn dense_reference(ty: GgmlType, data: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        let m = QMatrix::new(ty, data, rows, cols).unwrap();
        let mut row = vec![0.0f32; cols];
        (0..rows)
            .map(|r| {
                crate::dequantize_row(ty, m.row(r), &mut row);
                row.iter().zip(x).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() as f32
            })
            .collect()
    }

    /// The column product against the dense kernel on the same (partly zero) row: the same integers, so equal to
    /// float rounding; and against an f64 product of the dequantized weights to the 8-bit quantization of `x`.
    #[test]
    fn equals_the_dense_kernels_on_every_isa() {
        let mut rng = Rng(7);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1] {
            for (rows, cols) in [(64, 32), (192, 96), (128, 576)] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let m = QMatrix::new(ty, &data, rows, cols).unwrap();
                let cm = ColMatrix::from_rows(&m).unwrap();
                for zero_share in [0.0, 0.5, 0.9, 1.0] {
                    let x: Vec<f32> =
                        (0..cols).map(|_| if rng.f32().abs() < zero_share as f32 { 0.0 } else { rng.f32() }).collect();
                    let exact = dense_reference(ty, &data, rows, cols, &x);
                    let mut dense = vec![0.0f32; rows];
                    crate::matmul(&ThreadPool::new(1), &m, &x, 1, &mut dense, &mut crate::MatmulScratch::default());
                    let scale = exact.iter().fold(0.0f32, |a, b| a.max(b.abs())).max(1e-3);
                    for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
                        if !isa.available() {
                            continue;
                        }
                        for threads in [1, 2, 3] {
                            let pool = ThreadPool::new(threads);
                            let mut out = vec![f32::NAN; rows];
                            colskip_matvec_isa(isa, &pool, &cm, &x, &mut out, &mut ColScratch::default());
                            for r in 0..rows {
                                let what = format!("{ty:?} {rows}x{cols} {isa:?} t{threads} zero {zero_share} row {r}");
                                let (a, b, c) = (out[r], dense[r], exact[r]);
                                assert!((a - b).abs() <= 1e-5 * scale, "{what}: {a} vs dense {b}");
                                assert!((a - c).abs() <= 2e-2 * scale, "{what}: {a} vs exact {c}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_hold() {
        let mut rng = Rng(3);
        let data = random_weights(GgmlType::Q4_1, 32, 64, &mut rng);
        let m = QMatrix::new(GgmlType::Q4_1, &data, 32, 64).unwrap();
        assert!(matches!(ColMatrix::from_rows(&m), Err(KernelError::BadShape { .. })));
        let data = random_weights(GgmlType::Q8_0, 64, 64, &mut rng);
        let m = QMatrix::new(GgmlType::Q8_0, &data, 64, 64).unwrap();
        assert!(matches!(ColMatrix::from_rows(&m), Err(KernelError::UnsupportedType(_))));
    }
}
