//! Attention of a batch of rows over one layer's KV cache (keys and values stored as f16): the per-layer work
//! that grows with the context, and with every extra row of a speculative tree.
//!
//! Per (row, head) — one task serves a row and one or more heads of the same KV group
//! ([`Attention::heads_per_task`]), loading and converting each key and value row once for all of them:
//! 1. the positions the row sees — every cached slot (subject to the sliding window), then the batch's own rows
//!    allowed by the causal or tree mask — are listed in slot order;
//! 2. their scores `q·k · scale` (eight keys at a time; [`dot`] defines the summation: sixteen lanes of fused
//!    multiply-adds, so that one AVX-512 register or two AVX2 ones hold them);
//! 3. an exact softmax: the maximum first, then `exp(score − max)` ([`exp_nonpositive`], a polynomial that the
//!    vector code evaluates with the same operations), summed in eight lanes;
//! 4. `Σ w·v` in f32, in two partial sums, scaled by `1 / Σ w`.
//!
//! Every lane and partial sum is chosen by a position's **rank** among the visible ones, never by its cache slot,
//! so a row's result depends only on the ordered (key, value) pairs it sees: a draft-tree node whose ancestors sit
//! at scattered slots computes bit for bit what dense decoding computes for the same token at the same position,
//! and a token's result does not depend on the batch it is computed in. The AVX2 and AVX-512 kernels equal the
//! portable ones bit for bit (same lanes, same order; FMA exactly where the portable code calls `mul_add`).
//!
//! Scheduling ([`Attention::run_split`]): tasks are numbered KV head first and each thread takes a contiguous
//! share, so that a thread reads only its own KV heads' part of the cache; that traffic, from beyond the core's own
//! caches, is most of what attention costs at long contexts. Since session 64 the cache is KV head major
//! ([`crate::KvCache`]), so that part is one contiguous run per head instead of a `head_dim`-wide piece of every
//! slot row. Measured on the 2-vCPU Zen 3 (AVX2) VM, `KPROF_NOHEAD=1 KPROF_CTX=C kprof MODEL K 2 60`, slot-major /
//! head-major alternating, median ms a forward: SmolLM2 (3 KV heads) at 1,500 tokens 8.74, 8.99 → 6.38, 6.54 (1
//! row), 19.3, 14.9 → 13.0, 13.4 (4 rows); at 64 and 500 tokens within the noise; Qwen2.5-Coder (2 KV heads) at
//! 1,500 tokens, 4 rows 26.5, 28.2 → 25.2, 25.9, 1 row within the noise. The kernels take any strides.
//!
//! Session 18 widened the dot product from eight lanes of multiply-then-add to sixteen lanes of FMA, added the
//! AVX-512 kernels, the shared heads and the KV-head-major split. Measured with `kprof` (`KPROF_NOHEAD=1
//! KPROF_CTX=C kprof SmolLM2 K 2 60`, median of three alternating runs, ms per forward, before → after): 100
//! tokens of context 6.75 → 6.65 (1 row), 9.17 → 8.52 (3 rows); 500 tokens 9.26 → 8.26, 17.3 → 12.8; 1,500 tokens
//! 15.1 → 11.7, 27.1 → 20.3, 50.7 → 35.8 (6 rows).
//!
//! Until session 15 this followed llama.cpp's CPU flash attention (online softmax, V accumulated in f16, one
//! dependent rounding per position): ~56 cycles per head and position on the 2-core machine, 16% of decoding and
//! the largest per-row cost of a tree verification. The f32 accumulation is more exact than llama.cpp's, and the
//! reference tests (`tests/reference.rs`) bound how far our logits may drift from its own.

use crate::blocks::f16_to_f32;
use crate::kv_cache::Strides;
use crate::model::{Mask, SharedMut};

/// The attention of a batch over one layer's KV cache: one task per row and set of heads of one KV group.
pub(crate) struct Attention<'a> {
    /// Queries, `n × qd` (rounded to f16 values).
    pub q: &'a [f32],
    /// Cached keys (f16 bits): slot `s` of KV head `h` at `h · ks.head + s · ks.slot` ([`crate::KvCache`]'s
    /// layout).
    pub kc: &'a [u16],
    /// Cached values (f16 bits), likewise at `h · vs.head + s · vs.slot`.
    pub vc: &'a [u16],
    pub ks: Strides,
    pub vs: Strides,
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

/// Most query heads one task serves from the same keys and values ([`Attention::heads_per_task`]).
pub(crate) const MAX_HPT: usize = 4;

/// Floats of scratch one thread needs per slot of the layer (cached and new): the visible slots and up to
/// [`MAX_HPT`] heads' scores.
pub(crate) const SCRATCH_PER_SLOT: usize = 1 + MAX_HPT;

/// Most contiguous shares [`Attention::run_split`] divides the tasks into (more threads help with them).
pub(crate) use kernels::pool::MAX_SHARES;

/// Up to [`MAX_HPT`] query vectors (the heads of one task), `len` of them in use.
pub(crate) struct Queries<'a> {
    q: [&'a [f32]; MAX_HPT],
    len: usize,
}

impl<'a> Queries<'a> {
    fn iter(&self) -> impl Iterator<Item = &'a [f32]> + '_ {
        self.q[..self.len].iter().copied()
    }
}

impl Attention<'_> {
    /// Query heads per task: heads of one KV group share a task (each key and value row is then loaded and
    /// converted once for all of them), as many as keep the threads busy. With `T` tasks on `P` threads the slowest
    /// thread runs `⌈T / P⌉` of them, and a task of `h` heads was measured to cost about `√h` one-head tasks
    /// (SmolLM2, one row at 1,500 tokens of context: 3 heads per task 12.3–13.2 ms per forward against 14.7–15.3
    /// with one; Gemma 3: 2 heads per task best for 1 and 3 rows), so `h` minimises `⌈T / P⌉² · h`.
    pub(crate) fn heads_per_task(&self, threads: usize) -> usize {
        let cost = |hpt: usize| self.n_tasks(hpt).div_ceil(threads.max(1)).pow(2) * hpt;
        (1..=self.group.min(MAX_HPT)).min_by_key(|&hpt| (cost(hpt), usize::MAX - hpt)).unwrap_or(1)
    }

    /// Tasks of at most `hpt` heads: each KV group's heads in sets of `hpt`, the last set smaller where `hpt` does
    /// not divide the group (Qwen2.5's 7 heads per KV head: 4 + 3; until session 58 such a group ran one head per
    /// task, converting each key and value 7 times).
    pub(crate) fn n_tasks(&self, hpt: usize) -> usize {
        self.n * (self.n_head / self.group) * self.group.div_ceil(hpt)
    }

    /// Runs `tasks` of up to `hpt` heads each, using `sc` (`SCRATCH_PER_SLOT * total` floats) as scratch. Tasks
    /// are numbered KV head first (task = (kv head · rows + row) · ⌈group / hpt⌉ + head set within the group), so
    /// that a contiguous run of tasks reads few KV heads' keys and values: see [`Attention::run_split`].
    pub(crate) fn run(&self, tasks: std::ops::Range<usize>, hpt: usize, sc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                // SAFETY: the CPU has the features enabled for `run_avx512`.
                return unsafe { self.run_avx512(tasks, hpt, sc) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: the CPU has the features enabled for `run_avx2`.
                return unsafe { self.run_avx2(tasks, hpt, sc) };
            }
        }
        self.run_generic(tasks, hpt, sc, dot, dot8_each(|q, ks| ks.map(|k| dot(q, k))), exp_sum, weigh_each(weigh))
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    unsafe fn run_avx512(&self, tasks: std::ops::Range<usize>, hpt: usize, sc: &mut [f32]) {
        // SAFETY (every closure): this function is only entered when the AVX-512 kernels' features are available.
        self.run_generic(
            tasks,
            hpt,
            sc,
            |a, b| unsafe { avx2::dot(a, b) },
            |qs, ks, out| unsafe { avx512::dot8(qs, ks, out) },
            |w, m| unsafe { avx2::exp_sum(w, m) },
            |ws, rows, outs, invs| unsafe { avx512::weigh(ws, rows, outs, invs) },
        )
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, tasks: std::ops::Range<usize>, hpt: usize, sc: &mut [f32]) {
        // SAFETY (every closure): this function is only entered when avx2, fma and f16c are available.
        self.run_generic(
            tasks,
            hpt,
            sc,
            |a, b| unsafe { avx2::dot(a, b) },
            |qs, ks, out| unsafe { avx2::dot8_multi(qs, ks, out) },
            |w, m| unsafe { avx2::exp_sum(w, m) },
            |ws, rows, outs, invs| unsafe { avx2::weigh_multi(ws, rows, outs, invs) },
        )
    }

    /// Runs every task on `pool`: each thread takes a contiguous share of the tasks (so that it reads only its
    /// own KV heads' part of the cache instead of every thread reading all of it), claiming them a few at a time,
    /// then helps with the others' unclaimed ones. `scratch` holds `SCRATCH_PER_SLOT * total` floats per thread.
    pub(crate) fn run_split(&self, pool: &kernels::ThreadPool, scratch: &mut [f32]) {
        let hpt = self.heads_per_task(pool.n_threads());
        let n_tasks = self.n_tasks(hpt);
        let per_thread_scratch = SCRATCH_PER_SLOT * self.total;
        let shares = pool.n_threads().min(n_tasks).min(MAX_SHARES);
        assert!(scratch.len() >= shares * per_thread_scratch, "attention scratch too small");
        let sc = SharedMut(scratch.as_mut_ptr());
        // Tasks claimed per step: a few, so that a thread that falls behind leaves work to the others.
        pool.run_shares(n_tasks, n_tasks.div_ceil(shares * 4), &|me, tasks| {
            // SAFETY: each share owns its scratch slice, and one share runs on one thread at a time.
            let sc =
                unsafe { std::slice::from_raw_parts_mut(sc.get().add(me * per_thread_scratch), per_thread_scratch) };
            self.run(tasks, hpt, sc);
        });
    }

    /// The attention of several sequences of one batched layer ([`crate::Model::layer_batch`]) in one parallel
    /// region: their tasks are numbered one sequence after another and split over the pool as
    /// [`Attention::run_split`] splits one sequence's, instead of one region per sequence (a batch of 32 decode
    /// rows paid 32 regions per layer, each too small to keep two threads busy). Each task computes exactly what it
    /// computes in its own sequence's region. `scratch` holds `min(threads, MAX_SHARES) · SCRATCH_PER_SLOT ·
    /// max(total)` floats.
    pub(crate) fn run_many(jobs: &[Attention<'_>], pool: &kernels::ThreadPool, scratch: &mut [f32]) {
        if let [one] = jobs {
            return one.run_split(pool, scratch);
        }
        let threads = pool.n_threads();
        let hpts: Vec<usize> = jobs.iter().map(|j| j.heads_per_task(threads)).collect();
        let mut starts = Vec::with_capacity(jobs.len() + 1);
        starts.push(0);
        for (j, &hpt) in jobs.iter().zip(&hpts) {
            starts.push(starts.last().copied().unwrap_or(0) + j.n_tasks(hpt));
        }
        let n_tasks = starts[jobs.len()];
        let per_thread_scratch = SCRATCH_PER_SLOT * jobs.iter().map(|j| j.total).max().unwrap_or(0);
        let shares = threads.min(n_tasks).min(MAX_SHARES);
        assert!(scratch.len() >= shares.max(1) * per_thread_scratch, "attention scratch too small");
        let sc = SharedMut(scratch.as_mut_ptr());
        pool.run_shares(n_tasks, n_tasks.div_ceil(shares.max(1) * 4), &|me, tasks| {
            // SAFETY: each share owns its scratch slice, and one share runs on one thread at a time.
            let sc =
                unsafe { std::slice::from_raw_parts_mut(sc.get().add(me * per_thread_scratch), per_thread_scratch) };
            let mut t = tasks.start;
            while t < tasks.end {
                let j = starts.partition_point(|&s| s <= t) - 1;
                let end = tasks.end.min(starts[j + 1]);
                let need = SCRATCH_PER_SLOT * jobs[j].total;
                jobs[j].run(t - starts[j]..end - starts[j], hpts[j], &mut sc[..need]);
                t = end;
            }
        });
    }

    /// The tasks, with `dot` a query's dot product with one f16 key, `dot8` the same for each of a task's
    /// queries with eight keys (each bit-identical to `dot`), `exp_sum` [`exp_sum`] and `weigh` [`weigh`] for each
    /// of a task's queries, or their vector versions.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn run_generic(
        &self,
        tasks: std::ops::Range<usize>,
        hpt: usize,
        sc: &mut [f32],
        dot: impl Fn(&[f32], &[u16]) -> f32,
        dot8: impl Fn(&Queries, [&[u16]; 8], &mut [[f32; 8]; MAX_HPT]),
        exp_sum: impl Fn(&mut [f32], f32) -> f32,
        weigh: impl Fn(&[&[f32]], &ValueRows, &mut [&mut [f32]], &[f32]),
    ) {
        let Attention { q, kc, vc, ks, vs, pc, positions, mask, window, base, total, n, qd, hd, hdv, .. } = *self;
        assert!((1..=MAX_HPT).contains(&hpt) && sc.len() >= SCRATCH_PER_SLOT * total);
        let (slots, all_scores) = sc.split_at_mut(total);
        // SAFETY: `slots` holds `total` floats; u32 has the size and alignment of f32 and any bits are valid.
        let slots = unsafe { std::slice::from_raw_parts_mut(slots.as_mut_ptr() as *mut u32, total) };
        let subs = self.group.div_ceil(hpt);
        let per_kv = n * subs;
        let mut listed_row = usize::MAX;
        let mut nv = 0;
        for task in tasks {
            let (kvh, rest) = (task / per_kv, task % per_kv);
            let (j, set) = (rest / subs, rest % subs);
            let h0 = kvh * self.group + set * hpt;
            // This task's heads: `hpt`, fewer in a group's last set where `hpt` does not divide the group.
            let hpt = hpt.min(self.group - set * hpt);
            // 1. The visible slots in order (shared by the row's heads).
            if j != listed_row {
                listed_row = j;
                let pj = positions[j] as i64;
                let in_window = |s: usize| window.is_none_or(|w| pj - (pc[s] as i64) < w as i64);
                // Without a sliding window every cached slot is seen: written as a run (which vectorises), so that
                // only the batch's own rows are checked one by one.
                let from = if window.is_none() { base } else { 0 };
                for (i, s) in slots[..from].iter_mut().enumerate() {
                    *s = i as u32;
                }
                nv = from;
                for s in from..total {
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
            let mut scores: [&mut [f32]; MAX_HPT] = Default::default();
            for (i, chunk) in all_scores.chunks_exact_mut(total).take(hpt).enumerate() {
                scores[i] = &mut chunk[..nv];
            }
            // 2. Scores, eight keys at a time.
            let qs = Queries { q: std::array::from_fn(|i| &q[j * qd + (h0 + i.min(hpt - 1)) * hd..][..hd]), len: hpt };
            let key = |s: u32| &kc[kvh * ks.head + s as usize * ks.slot..][..hd];
            let mut d = [[0f32; 8]; MAX_HPT];
            let mut r = 0;
            while r + 8 <= nv {
                for &s in slots.iter().skip(r + PREFETCH_KEYS).take(8) {
                    prefetch(key(s));
                }
                dot8(&qs, std::array::from_fn(|i| key(slots[r + i])), &mut d);
                for (sc, d) in scores.iter_mut().zip(&d).take(hpt) {
                    for i in 0..8 {
                        sc[r + i] = d[i] * self.scale;
                    }
                }
                r += 8;
            }
            for r in r..nv {
                for (sc, qv) in scores.iter_mut().zip(qs.iter()) {
                    sc[r] = dot(qv, key(slots[r])) * self.scale;
                }
            }
            // 3. Softmax weights.
            let mut invs = [0f32; MAX_HPT];
            for (sc, inv) in scores.iter_mut().zip(invs.iter_mut()).take(hpt) {
                let max = sc.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let sum = exp_sum(sc, max);
                *inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            }
            // 4. The weighted values.
            let mut outs: [&mut [f32]; MAX_HPT] = Default::default();
            for (i, out) in outs.iter_mut().enumerate().take(hpt) {
                // SAFETY: each task writes only its own heads' ranges of row j's output.
                *out =
                    unsafe { std::slice::from_raw_parts_mut(self.att.get().add(j * self.att_d + (h0 + i) * hdv), hdv) };
            }
            let rows = ValueRows { vc, slots, stride: vs.slot, offset: kvh * vs.head };
            let weights: [&[f32]; MAX_HPT] = std::array::from_fn(|i| &*scores[i]);
            weigh(&weights[..hpt], &rows, &mut outs[..hpt], &invs[..hpt]);
        }
    }
}

/// A multi-query `dot8` from a one-query one: each query in turn (the portable and AVX2 paths).
#[inline(always)]
fn dot8_each(
    one: impl Fn(&[f32], [&[u16]; 8]) -> [f32; 8],
) -> impl Fn(&Queries, [&[u16]; 8], &mut [[f32; 8]; MAX_HPT]) {
    move |qs, ks, out| {
        for (o, q) in out.iter_mut().zip(qs.iter()) {
            *o = one(q, ks);
        }
    }
}

/// A multi-query `weigh` from a one-query one: each query in turn.
#[inline(always)]
fn weigh_each(
    one: impl Fn(&[f32], &ValueRows, &mut [f32], f32),
) -> impl Fn(&[&[f32]], &ValueRows, &mut [&mut [f32]], &[f32]) {
    move |ws, rows, outs, invs| {
        for ((w, out), &inv) in ws.iter().zip(outs.iter_mut()).zip(invs) {
            one(w, rows, out, inv);
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

    /// Where row `r` starts, without bounds checks: for the vector kernels, after [`check_weigh`].
    #[cfg(target_arch = "x86_64")]
    fn base(&self) -> impl Fn(usize) -> *const u16 + '_ {
        // SAFETY (of each call): `r` is below the row count [`check_weigh`] checked against the cache.
        move |r| unsafe { self.vc.as_ptr().add(self.offset + *self.slots.get_unchecked(r) as usize * self.stride) }
    }
}

/// Checks a multi-query weigh's arguments once — `h` queries, each with as many weights as there are rows and an
/// output of the same width, every row inside the cache — so that the vector kernels read rows without bounds
/// checks. Returns (output width, rows).
#[cfg(target_arch = "x86_64")]
fn check_weigh(h: usize, ws: &[&[f32]], rows: &ValueRows, outs: &[&mut [f32]], invs: &[f32]) -> (usize, usize) {
    assert!(ws.len() == h && outs.len() == h && invs.len() == h);
    let (len, nr) = (outs[0].len(), ws[0].len());
    assert!(outs.iter().all(|o| o.len() == len) && ws.iter().all(|w| w.len() == nr));
    assert!(nr <= rows.slots.len());
    assert!(rows.slots[..nr].iter().all(|&s| s as usize * rows.stride + rows.offset + len <= rows.vc.len()));
    (len, nr)
}

/// The elements from `c0` on of every query's weighed values, by the portable code: the vector kernels' tail.
#[cfg(target_arch = "x86_64")]
fn weigh_tail(c0: usize, ws: &[&[f32]], rows: &ValueRows, outs: &mut [&mut [f32]], invs: &[f32]) {
    let len = outs.first().map_or(0, |o| o.len());
    if c0 >= len {
        return;
    }
    let shifted = ValueRows { vc: rows.vc, slots: rows.slots, stride: rows.stride, offset: rows.offset + c0 };
    for ((w, out), &inv) in ws.iter().zip(outs.iter_mut()).zip(invs) {
        let mut tail = vec![0f32; len - c0];
        weigh(w, &shifted, &mut tail, inv);
        out[c0..].copy_from_slice(&tail);
    }
}

/// How many keys ahead of the eight being dotted their successors are prefetched: the cache is read once per
/// token and layer, mostly from beyond the core's own caches.
const PREFETCH_KEYS: usize = 16;

/// Asks for the cache lines of `row` (f16 bits) to be brought into L1.
#[inline(always)]
fn prefetch(row: &[u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        let (p, bytes) = (row.as_ptr() as *const i8, std::mem::size_of_val(row));
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch hint inside `row`; it cannot fault.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Lanes of a query–key dot product ([`dot`]).
const DOT_LANES: usize = 16;

/// `q · k` (keys as f16 bits), summed exactly as every vector version does: lane `l < 16` accumulates elements
/// `l, l + 16, l + 32, …` by fused multiply-adds; then the lanes are added as `(a₀ + a₈) + (a₁ + a₉) + … + (a₇ +
/// a₁₅)` from the left; then any tail (`len % 16` elements) by fused multiply-adds in order.
fn dot(q: &[f32], k: &[u16]) -> f32 {
    let len = q.len().min(k.len());
    let chunks = len / DOT_LANES;
    let mut acc = [0f32; DOT_LANES];
    for c in 0..chunks {
        for (l, a) in acc.iter_mut().enumerate() {
            let i = c * DOT_LANES + l;
            *a = q[i].mul_add(f16_to_f32(k[i]), *a);
        }
    }
    let mut sum = acc[0] + acc[8];
    for l in 1..8 {
        sum += acc[l] + acc[l + 8];
    }
    for i in chunks * DOT_LANES..len {
        sum = q[i].mul_add(f16_to_f32(k[i]), sum);
    }
    sum
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

    /// [`super::dot`] with explicit vectors: lanes 0–7 and 8–15 in two registers, added lane by lane, then the
    /// eight sums from the left, then the same scalar tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dot(q: &[f32], k: &[u16]) -> f32 {
        let len = q.len().min(k.len());
        let chunks = len / 16;
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in 0..chunks {
            let (qp, kp) = (q.as_ptr().add(16 * c), k.as_ptr().add(16 * c));
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(qp), load_f16x8(kp), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(8)), load_f16x8(kp.add(8)), hi);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(lo, hi));
        let mut sum = lanes[1..].iter().fold(lanes[0], |s, &l| s + l);
        for i in chunks * 16..len {
            sum = q[i].mul_add(f16_to_f32(k[i]), sum);
        }
        sum
    }

    /// Lane sums of eight registers, each from the left (lane 0 + lane 1 + …): an 8 × 8 transpose, then the
    /// transposed rows added in order.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn reduce8(acc: [__m256; 8]) -> [f32; 8] {
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
        out
    }

    /// The scalar tails (elements `from..`) of eight dot products, added to their vector sums `out`.
    #[inline(always)]
    pub(super) fn finish8(q: &[f32], ks: &[&[u16]; 8], from: usize, mut out: [f32; 8]) -> [f32; 8] {
        for (o, k) in out.iter_mut().zip(ks) {
            for i in from..q.len().min(k.len()) {
                *o = q[i].mul_add(f16_to_f32(k[i]), *o);
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

    /// [`super::dot`] of each of a task's queries with eight keys, bit-identical to one call per query and key:
    /// the lane accumulators of [`dot`] (two registers per query and key), then the eight reductions of a query at
    /// once ([`reduce8`]), then the same scalar tail. Each key chunk is loaded and converted once for all the
    /// queries (until session 64 the AVX2 path converted every key once per query).
    /// `KG` keys at a time, so that the `2 · H · KG` accumulators and the two converted halves of a key fit in
    /// sixteen registers (the queries are read as memory operands of the multiply-adds).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dot8_multi(qs: &super::Queries, ks: [&[u16]; 8], out: &mut [[f32; 8]; super::MAX_HPT]) {
        match qs.len {
            1 => dot8_h::<1, 4>(qs, ks, out),
            2 => dot8_h::<2, 2>(qs, ks, out),
            3 => dot8_h::<3, 2>(qs, ks, out),
            _ => dot8_h::<4, 1>(qs, ks, out),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot8_h<const H: usize, const KG: usize>(
        qs: &super::Queries,
        ks: [&[u16]; 8],
        out: &mut [[f32; 8]; super::MAX_HPT],
    ) {
        let len = ks.iter().map(|k| k.len()).chain(qs.q[..H].iter().map(|q| q.len())).min().unwrap_or(0);
        let chunks = len / 16;
        let qp: [*const f32; H] = std::array::from_fn(|h| qs.q[h].as_ptr());
        let mut v = [[_mm256_setzero_ps(); 8]; H];
        for g in (0..8).step_by(KG) {
            let kp: [*const u16; KG] = std::array::from_fn(|i| ks[g + i].as_ptr());
            let (mut lo, mut hi) = ([[_mm256_setzero_ps(); KG]; H], [[_mm256_setzero_ps(); KG]; H]);
            for c in 0..chunks {
                for i in 0..KG {
                    let (kl, kh) = (load_f16x8(kp[i].add(16 * c)), load_f16x8(kp[i].add(16 * c + 8)));
                    for h in 0..H {
                        lo[h][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp[h].add(16 * c)), kl, lo[h][i]);
                        hi[h][i] = _mm256_fmadd_ps(_mm256_loadu_ps(qp[h].add(16 * c + 8)), kh, hi[h][i]);
                    }
                }
            }
            for h in 0..H {
                for i in 0..KG {
                    v[h][g + i] = _mm256_add_ps(lo[h][i], hi[h][i]);
                }
            }
        }
        for (h, o) in out.iter_mut().enumerate().take(H) {
            *o = finish8(qs.q[h], &ks, chunks * 16, reduce8(v[h]));
        }
    }

    /// [`weigh`] for each of a task's queries (weights `ws[i]`, output `outs[i]`, scale `invs[i]`), bit-identical
    /// to one [`weigh`] per query: each value row is loaded and converted once for all of them. Blocks of `8 · NV`
    /// elements with `NV` chosen so that the `2 · H · NV` accumulators, the broadcast weights and the two converted
    /// rows fit in sixteen registers (an accumulator spilled to the stack puts a store and a load on its
    /// dependency chain: the one-query kernel's 32-element block did so and ran at about half its multiply-add
    /// rate), then 8 at a time, then the portable code for a tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn weigh_multi(ws: &[&[f32]], rows: &ValueRows, outs: &mut [&mut [f32]], invs: &[f32]) {
        match ws.len() {
            1 => weigh(ws[0], rows, outs[0], invs[0]),
            2 => weigh_h::<2>(ws, rows, outs, invs),
            3 => weigh_h::<3>(ws, rows, outs, invs),
            _ => weigh_h::<4>(ws, rows, outs, invs),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn weigh_h<const H: usize>(ws: &[&[f32]], rows: &ValueRows, outs: &mut [&mut [f32]], invs: &[f32]) {
        let (len, nr) = super::check_weigh(H, ws, rows, outs, invs);
        let base = rows.base();
        let wp: [*const f32; H] = std::array::from_fn(|i| ws[i].as_ptr());
        let mut c0 = 0;
        macro_rules! block {
            ($nv:literal) => {{
                let mut even = [[_mm256_setzero_ps(); $nv]; H];
                let mut odd = [[_mm256_setzero_ps(); $nv]; H];
                let mut r = 0;
                while r + 2 <= nr {
                    let (p0, p1) = (base(r).add(c0), base(r + 1).add(c0));
                    for i in 0..$nv {
                        let (v0, v1) = (load_f16x8(p0.add(8 * i)), load_f16x8(p1.add(8 * i)));
                        for h in 0..H {
                            even[h][i] = _mm256_fmadd_ps(_mm256_set1_ps(*wp[h].add(r)), v0, even[h][i]);
                            odd[h][i] = _mm256_fmadd_ps(_mm256_set1_ps(*wp[h].add(r + 1)), v1, odd[h][i]);
                        }
                    }
                    r += 2;
                }
                if r < nr {
                    let p0 = base(r).add(c0);
                    for i in 0..$nv {
                        let v0 = load_f16x8(p0.add(8 * i));
                        for h in 0..H {
                            even[h][i] = _mm256_fmadd_ps(_mm256_set1_ps(*wp[h].add(r)), v0, even[h][i]);
                        }
                    }
                }
                for h in 0..H {
                    let inv = _mm256_set1_ps(invs[h]);
                    for i in 0..$nv {
                        _mm256_storeu_ps(
                            outs[h].as_mut_ptr().add(c0 + 8 * i),
                            _mm256_mul_ps(_mm256_add_ps(even[h][i], odd[h][i]), inv),
                        );
                    }
                }
                c0 += 8 * $nv;
            }};
        }
        if H <= 2 {
            while c0 + 16 <= len {
                block!(2);
            }
        }
        while c0 + 8 <= len {
            block!(1);
        }
        super::weigh_tail(c0, ws, rows, outs, invs);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! AVX-512 (F, VL) versions of the dot products and the weighted values, bit-identical to the portable ones:
    //! one 16-float register holds a dot product's sixteen lanes, or sixteen elements of a value sum.

    use super::ValueRows;
    use std::arch::x86_64::*;

    /// Whether the CPU has what these kernels need (AVX-512 F and VL besides AVX2, FMA and F16C).
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }

    /// Value rows prefetched ahead of the pair being weighed.
    const PREFETCH_ROWS: usize = 8;

    /// Sixteen f16 values (bits at `p`) as f32 (exact).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load_f16x16(p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    /// The low and high eight lanes of `a`, added lane by lane (as the portable dot product adds lanes `l` and
    /// `l + 8`).
    #[target_feature(enable = "avx512f,avx2")]
    #[inline]
    unsafe fn fold_halves(a: __m512) -> __m256 {
        _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a))))
    }

    /// [`super::avx2::dot8_multi`] with 512-bit registers: each key chunk is loaded and converted once for all
    /// the queries, one 16-lane register per (query, key) accumulates as the portable code does, and the lanes are
    /// reduced by the same transpose.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn dot8(qs: &super::Queries, ks: [&[u16]; 8], out: &mut [[f32; 8]; super::MAX_HPT]) {
        match qs.len {
            1 => dot8_h::<1>(qs, ks, out),
            2 => dot8_h::<2>(qs, ks, out),
            3 => dot8_h::<3>(qs, ks, out),
            _ => dot8_h::<4>(qs, ks, out),
        }
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn dot8_h<const H: usize>(qs: &super::Queries, ks: [&[u16]; 8], out: &mut [[f32; 8]; super::MAX_HPT]) {
        let len = ks.iter().map(|k| k.len()).chain(qs.q[..H].iter().map(|q| q.len())).min().unwrap_or(0);
        let chunks = len / 16;
        let mut v = [[_mm256_setzero_ps(); 8]; H];
        for half in 0..2 {
            let mut acc = [[_mm512_setzero_ps(); 4]; H];
            for c in 0..chunks {
                let kv: [__m512; 4] = std::array::from_fn(|i| load_f16x16(ks[4 * half + i].as_ptr().add(16 * c)));
                for (acc, q) in acc.iter_mut().zip(&qs.q[..H]) {
                    let x = _mm512_loadu_ps(q.as_ptr().add(16 * c));
                    for i in 0..4 {
                        acc[i] = _mm512_fmadd_ps(x, kv[i], acc[i]);
                    }
                }
            }
            for (v, acc) in v.iter_mut().zip(&acc) {
                for i in 0..4 {
                    v[4 * half + i] = fold_halves(acc[i]);
                }
            }
        }
        for ((o, v), q) in out.iter_mut().zip(v).zip(&qs.q[..H]) {
            *o = super::avx2::finish8(q, &ks, chunks * 16, super::avx2::reduce8(v));
        }
    }

    /// [`super::weigh`] for each of the task's queries (weights `ws[i]`, output `outs[i]`, scale `invs[i]`): per
    /// element the same two partial sums of fused multiply-adds; each value row is loaded and converted once for
    /// all queries, 32 elements at a time, then 16, then the portable code for a tail.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn weigh(ws: &[&[f32]], rows: &ValueRows, outs: &mut [&mut [f32]], invs: &[f32]) {
        match ws.len() {
            1 => weigh_h::<1>(ws, rows, outs, invs),
            2 => weigh_h::<2>(ws, rows, outs, invs),
            3 => weigh_h::<3>(ws, rows, outs, invs),
            _ => weigh_h::<4>(ws, rows, outs, invs),
        }
    }

    #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn weigh_h<const H: usize>(ws: &[&[f32]], rows: &ValueRows, outs: &mut [&mut [f32]], invs: &[f32]) {
        let (len, nr) = super::check_weigh(H, ws, rows, outs, invs);
        let base = rows.base();
        let wp: [*const f32; H] = std::array::from_fn(|i| ws[i].as_ptr());
        let mut c0 = 0;
        macro_rules! block {
            ($nv:literal) => {{
                let mut even = [[_mm512_setzero_ps(); $nv]; H];
                let mut odd = [[_mm512_setzero_ps(); $nv]; H];
                let mut r = 0;
                while r + 2 <= nr {
                    let (p0, p1) = (base(r).add(c0), base(r + 1).add(c0));
                    if c0 == 0 && r + 2 + PREFETCH_ROWS <= nr {
                        for p in [base(r + PREFETCH_ROWS), base(r + PREFETCH_ROWS + 1)] {
                            for l in (0..len).step_by(32) {
                                _mm_prefetch::<_MM_HINT_T0>(p.add(l) as *const i8);
                            }
                        }
                    }
                    let v0: [__m512; $nv] = std::array::from_fn(|i| load_f16x16(p0.add(16 * i)));
                    let v1: [__m512; $nv] = std::array::from_fn(|i| load_f16x16(p1.add(16 * i)));
                    for h in 0..H {
                        let (w0, w1) = (_mm512_set1_ps(*wp[h].add(r)), _mm512_set1_ps(*wp[h].add(r + 1)));
                        for i in 0..$nv {
                            even[h][i] = _mm512_fmadd_ps(w0, v0[i], even[h][i]);
                            odd[h][i] = _mm512_fmadd_ps(w1, v1[i], odd[h][i]);
                        }
                    }
                    r += 2;
                }
                if r < nr {
                    let p0 = base(r).add(c0);
                    let v0: [__m512; $nv] = std::array::from_fn(|i| load_f16x16(p0.add(16 * i)));
                    for h in 0..H {
                        let w0 = _mm512_set1_ps(*wp[h].add(r));
                        for i in 0..$nv {
                            even[h][i] = _mm512_fmadd_ps(w0, v0[i], even[h][i]);
                        }
                    }
                }
                for h in 0..H {
                    let inv = _mm512_set1_ps(invs[h]);
                    for i in 0..$nv {
                        _mm512_storeu_ps(
                            outs[h].as_mut_ptr().add(c0 + 16 * i),
                            _mm512_mul_ps(_mm512_add_ps(even[h][i], odd[h][i]), inv),
                        );
                    }
                }
                c0 += 16 * $nv;
            }};
        }
        if H <= 2 {
            while c0 + 64 <= len {
                block!(4);
            }
        }
        while c0 + 32 <= len {
            block!(2);
        }
        while c0 + 16 <= len {
            block!(1);
        }
        super::weigh_tail(c0, ws, rows, outs, invs);
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

    /// The multi-query kernels of one instruction set, as safe calls.
    #[cfg(target_arch = "x86_64")]
    struct MultiKernels {
        dot8: Box<dyn Fn(&Queries, [&[u16]; 8], &mut [[f32; 8]; MAX_HPT])>,
        weigh: Box<dyn Fn(&[&[f32]], &ValueRows, &mut [&mut [f32]], &[f32])>,
    }

    /// The multi-query kernels this CPU runs: AVX2's (the caller checked AVX2, FMA and F16C), and AVX-512's where
    /// it has them.
    #[cfg(target_arch = "x86_64")]
    fn multi_kernels() -> Vec<(&'static str, MultiKernels)> {
        // SAFETY (every closure): the CPU has the features of the kernel it calls (checked by the caller, or here).
        let mut all = vec![(
            "AVX2",
            MultiKernels {
                dot8: Box::new(|qs, ks, out| unsafe { avx2::dot8_multi(qs, ks, out) }),
                weigh: Box::new(|ws, rows, outs, invs| unsafe { avx2::weigh_multi(ws, rows, outs, invs) }),
            },
        )];
        if avx512::available() {
            all.push((
                "AVX-512",
                MultiKernels {
                    dot8: Box::new(|qs, ks, out| unsafe { avx512::dot8(qs, ks, out) }),
                    weigh: Box::new(|ws, rows, outs, invs| unsafe { avx512::weigh(ws, rows, outs, invs) }),
                },
            ));
        }
        all
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

    /// A row's attention output does not depend on how many heads share a task, on the task ranges a thread runs,
    /// or on the split across threads: the same bits for every heads-per-task choice (1 to 4) of groups of 4, 3 and
    /// 7 (whose sets are uneven: 4 + 3, 3 + 3 + 1, 2 + 2 + 2 + 1), with a tree mask over cached slots.
    #[test]
    fn attention_results_do_not_depend_on_the_task_split() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let f16 = |v: f32| half::f16::from_f32(v).to_bits();
        for (n_head, n_kv, hd) in [(8usize, 2usize, 64usize), (6, 2, 32), (4, 1, 80), (14, 2, 64)] {
            let (n, base) = (4usize, 37usize);
            let total = base + n;
            let (qd, kvd) = (n_head * hd, n_kv * hd);
            let q: Vec<f32> = (0..n * qd).map(|_| f16_to_f32(f16(next()))).collect();
            let kc: Vec<u16> = (0..total * kvd).map(|_| f16(next())).collect();
            let vc: Vec<u16> = (0..total * kvd).map(|_| f16(next())).collect();
            let pc: Vec<u32> = (0..total as u32).collect();
            let positions: Vec<u32> = vec![37, 38, 38, 39];
            // A small tree: row 0 the root, rows 1 and 2 its children, row 3 a child of row 1.
            let allowed: Vec<bool> = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
                .iter()
                .flat_map(|r| r.iter().map(|&b| b == 1))
                .collect();
            let group = n_head / n_kv;
            let job = |att: &mut [f32]| Attention {
                q: &q,
                kc: &kc,
                vc: &vc,
                pc: &pc,
                positions: &positions,
                mask: Mask::Allowed(&allowed),
                window: None,
                base,
                total,
                n,
                qd,
                // Slot-major (llama.cpp's layout): the kernels take any strides.
                ks: Strides { slot: kvd, head: hd },
                vs: Strides { slot: kvd, head: hd },
                hd,
                hdv: hd,
                att_d: qd,
                n_head,
                group,
                scale: 0.125,
                att: SharedMut(att.as_mut_ptr()),
            };
            let bits = |att: &[f32]| att.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let run = |hpt: usize, chunk: usize| {
                let mut att = vec![0f32; n * qd];
                let mut sc = vec![0f32; SCRATCH_PER_SLOT * total];
                let tasks = job(&mut att).n_tasks(hpt);
                for start in (0..tasks).step_by(chunk) {
                    job(&mut att).run(start..(start + chunk).min(tasks), hpt, &mut sc);
                }
                bits(&att)
            };
            let want = run(1, 1);
            assert!(want.iter().any(|&b| b != 0));
            for hpt in 1..=group.min(MAX_HPT) {
                for chunk in [1, 3, 1000] {
                    assert_eq!(
                        run(hpt, chunk),
                        want,
                        "{n_head} heads, {n_kv} KV heads: {hpt} per task, runs of {chunk}"
                    );
                }
            }
            // And through the pool, as a forward runs it.
            let pool = kernels::ThreadPool::new(2);
            let mut att = vec![0f32; n * qd];
            let mut sc = vec![0f32; 2 * SCRATCH_PER_SLOT * total];
            job(&mut att).run_split(&pool, &mut sc);
            assert_eq!(bits(&att), want);
        }
    }

    /// The attention's vector kernels (AVX2, and AVX-512 where the CPU has it) equal the portable ones bit for
    /// bit: dot products (eight at once and one at a time), the exponentials and their sum, and the weighted values
    /// (with and without scalar tails).
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
            for len in [64, 72, 29, 8, 256, 40, 16, 136, 200] {
                let q: Vec<f32> = (0..len).map(|_| next()).collect();
                let keys: Vec<Vec<u16>> = (0..8).map(|_| (0..len).map(|_| f16(next() * 1e3)).collect()).collect();
                // The one-key AVX2 dot product (the scalar tails of a task) equals the portable one.
                for k in &keys {
                    // SAFETY: the CPU has avx2, fma and f16c (checked above).
                    let one = unsafe { avx2::dot(&q, k) };
                    assert_eq!(one.to_bits(), dot(&q, k).to_bits(), "len {len}");
                }
                // Up to MAX_HPT queries at once (the first is `q`), each as the portable code computes it.
                let more: Vec<Vec<f32>> = (0..MAX_HPT).map(|_| (0..len).map(|_| next()).collect()).collect();
                for (isa, multi) in multi_kernels() {
                    for h in 1..=MAX_HPT {
                        let qs =
                            Queries { q: std::array::from_fn(|i| if i == 0 { &q[..] } else { &more[i][..] }), len: h };
                        let mut wide = [[0f32; 8]; MAX_HPT];
                        (multi.dot8)(&qs, std::array::from_fn(|i| &keys[i][..]), &mut wide);
                        for (i, qv) in qs.iter().enumerate() {
                            let want: Vec<f32> = keys.iter().map(|k| dot(qv, k)).collect();
                            assert_eq!(bits(&wide[i]), bits(&want), "{isa}, len {len}, {h} queries, query {i}");
                        }
                    }
                }
                for nr in [1, 2, 7, 8, 9, 33, 64, 65, 100, 130, 257] {
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
                    // Up to MAX_HPT weight vectors over the same rows, each as the portable code weighs it.
                    let ws: Vec<Vec<f32>> = (0..MAX_HPT)
                        .map(|i| if i == 0 { w.clone() } else { w.iter().map(|x| x * next().abs()).collect() })
                        .collect();
                    for (isa, multi) in multi_kernels() {
                        for h in 1..=MAX_HPT {
                            let mut outs: Vec<Vec<f32>> = vec![vec![1f32; len]; h];
                            let invs: Vec<f32> = (0..h).map(|i| 1.0 / (sum + i as f32)).collect();
                            let wr: Vec<&[f32]> = ws[..h].iter().map(|v| &v[..]).collect();
                            let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                            (multi.weigh)(&wr, &rows, &mut or, &invs);
                            for i in 0..h {
                                let mut want = vec![0f32; len];
                                weigh(&ws[i], &rows, &mut want, invs[i]);
                                assert_eq!(bits(&outs[i]), bits(&want), "{isa}, len {len} rows {nr}, {h} queries");
                            }
                        }
                    }
                }
            }
        }
    }
}
