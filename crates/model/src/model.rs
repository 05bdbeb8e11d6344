//! The model and its **per-layer step API** — the one forward pass every decoding strategy builds on:
//!
//! | step | what it does |
//! | --- | --- |
//! | [`Model::embed`] | token ids → hidden rows (`n × n_embd`) |
//! | [`Model::layer`] | one transformer block over `n` rows at given positions, reading and extending that layer's KV cache, under a [`Mask`] |
//! | [`Model::final_norm`] | output RMS norm of hidden rows |
//! | [`Model::head_full`] | full-vocabulary logits of normed rows |
//! | [`Model::head_rows`] | logits of a few chosen token ids only (a handful of head rows, not the vocabulary) |
//!
//! [`Model::forward`] chains them for the common case (all layers, causal, logits for chosen rows).

use crate::arch;
use crate::blocks::{
    axpy_f16, dot_f16, f16_to_f32, glu_in_place, rms_norm, rms_norm_in_place, rope_angles, rope_apply, rope_inv_freq,
    round_f16, scale_f16,
};
use crate::config::Config;
use crate::error::ModelError;
use crate::kv_cache::KvCache;
use crate::weights::{Matrix, Weights};
use crate::workspace::{grow, Workspace};
use gguf::GgufFile;
use kernels::{matmul, matmul_many, matmul_rows, HeadScreen, QMatrix};
use std::path::Path;

/// Which earlier rows of the same batch each new row may attend to. Every row always sees all slots
/// already in the cache (subject to the sliding window).
#[derive(Clone, Copy, Debug)]
pub enum Mask<'a> {
    /// Row `j` sees new rows `0..=j`.
    Causal,
    /// Row `j` sees new row `m` iff `allowed[j * n + m]` (a draft tree's ancestor mask; the diagonal must be set).
    Allowed(&'a [bool]),
}

/// Which rows [`Model::forward`] computes logits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last row.
    Last,
    /// Every row.
    All,
    /// None (prefill only).
    None,
}

/// A loaded model: hyperparameters, weight handles and the memory-mapped file they point into.
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    file: GgufFile,
    rope_inv: Vec<f32>,
    rope_inv_swa: Vec<f32>,
    /// The head's 6-bit screen for exact greedy argmax ([`Model::head_argmax`]), built on first use; `None`
    /// when the head is not Q8_0 or `SPECEE_HEAD_SCREEN=0`.
    head_screen: std::sync::OnceLock<Option<HeadScreen>>,
    /// Greedy head calls made before the screen was built ([`SCREEN_AFTER_CALLS`]).
    greedy_calls: std::sync::atomic::AtomicUsize,
    /// The head interleaved by 8 rows for products over several rows ([`Model::head_full`]), built on first use;
    /// `None` where interleaving does not pay ([`kernels::repack::interleave_pays`]) or `SPECEE_HEAD_X8=0`.
    head_x8: std::sync::OnceLock<Option<Box<[u8]>>>,
    /// Rows multiplied by the head in multi-row products before `head_x8` was built ([`X8_AFTER_ROWS`]).
    x8_rows: std::sync::atomic::AtomicUsize,
    /// Greedy calls use the screen for any number of rows ([`Model::force_head_screen`]).
    screen_forced: std::sync::atomic::AtomicBool,
}

/// The interleaved head ([`Model::head_x8`]) is built once this many rows went through multi-row head products:
/// at once for perplexity or `eval` chunks, after ~128 two-row tree verifications. Gemma 3 270M's build takes
/// ~0.2 s and saves ~1–3 ms per 2-row product on the 2-core AVX-512 machine.
pub const X8_AFTER_ROWS: usize = 256;

/// Attention work items per pool thread (each a contiguous run of (row, head) tasks).
const ATT_ITEMS_PER_THREAD: usize = 4;

/// Elements per work item of the parallel gate activation.
const ACT_CHUNK: usize = 512;

/// llama.cpp switches batches of at least this many rows to its tiled flash-attention path (`GGML_FA_TILE_Q`).
/// We do not follow it there (see the attention comment in [`Model::layer`]); kept for the record.
#[allow(dead_code)]
const FA_TILE_Q: usize = 64;

/// Heads at least this large (Q8_0 bytes) use the head screen for greedy argmax by default. Measured on a
/// 2-core AVX2 machine: Gemma 3 270M's 178 MB head decodes ~20% faster with it, SmolLM2's 30 MB head (much of
/// it staying in a 32 MB L3) no faster.
pub const SCREEN_MIN_BYTES: usize = 64 << 20;

/// [`SCREEN_MIN_BYTES`] where the kernels use AVX-512 VNNI: there the head product is memory-bound, and on the
/// 2-core Zen 4 SmolLM2 (30 MB head) decodes 1–10% faster with the screen (`specee bench -p 16 -n 128 -r 3`,
/// `SPECEE_HEAD_SCREEN=1` vs `0`, alternating, two sessions of 3 rounds; the machine is noisy).
pub const SCREEN_MIN_BYTES_VNNI: usize = 16 << 20;

/// The head screen is built on the greedy head call after this many (0.3 s for Gemma's, paid back after ~130
/// tokens at 1.3 ms each): a short one-shot generation never pays for it, a server or a long generation builds it
/// once. [`Model::warm_head_screen`] builds it at once (benchmarks), `SPECEE_HEAD_SCREEN=1` on the first call.
pub const SCREEN_AFTER_CALLS: usize = 256;

/// A raw pointer that may be shared between pool threads writing disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}
impl SharedMut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

impl Model {
    /// Opens a GGUF file and loads the model it holds.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        Model::from_gguf(GgufFile::open(path)?)
    }

    /// Loads the model held by an opened GGUF file.
    pub fn from_gguf(file: GgufFile) -> Result<Model, ModelError> {
        let config = arch::config_from_gguf(&file)?;
        let mut weights = arch::load_weights(&file, &config)?;
        // Layer matrices in a type or layout with slow kernels become an exactly equal faster one (Q5_0 →
        // Q8_0, Q4_1 → 8 interleaved rows); `SPECEE_REPACK=0` keeps the file's (to measure the difference).
        // The embeddings and the head stay as stored (single rows are read from them).
        if std::env::var("SPECEE_REPACK").map_or(true, |v| v != "0") {
            for lw in &mut weights.layers {
                for m in [&mut lw.wq, &mut lw.wk, &mut lw.wv, &mut lw.wo, &mut lw.w_gate, &mut lw.w_up, &mut lw.w_down]
                {
                    m.repack(&file);
                }
            }
        }
        let rope_inv = rope_inv_freq(config.rope_base, config.rope_dims);
        let rope_inv_swa = rope_inv_freq(config.rope_base_swa, config.rope_dims);
        let (head_screen, greedy_calls) = (std::sync::OnceLock::new(), std::sync::atomic::AtomicUsize::new(0));
        let (head_x8, x8_rows) = (std::sync::OnceLock::new(), std::sync::atomic::AtomicUsize::new(0));
        let screen_forced = std::sync::atomic::AtomicBool::new(false);
        Ok(Model {
            config,
            weights,
            file,
            rope_inv,
            rope_inv_swa,
            head_screen,
            greedy_calls,
            head_x8,
            x8_rows,
            screen_forced,
        })
    }

    /// The GGUF file (metadata, e.g. for the tokenizer).
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }

    /// A KV cache sized for `capacity` tokens.
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::new(&self.config, capacity)
    }

    fn qmatrix<'a>(&'a self, m: &'a Matrix) -> QMatrix<'a> {
        QMatrix { ty: m.ty, data: self.matrix_bytes(m), rows: m.rows, cols: m.cols, layout: m.layout }
    }

    /// The bytes of `m` in its type `m.ty` (converted at load, or in the file).
    fn matrix_bytes<'a>(&'a self, m: &'a Matrix) -> &'a [u8] {
        m.owned.as_deref().unwrap_or_else(|| self.file.tensor_bytes(&m.info))
    }

    /// The output head (`vocab × n_embd`, in its stored type), for callers that multiply by it on their own
    /// threads (a published EAGLE-1 head drafts through the target's head).
    pub fn output_matrix(&self) -> QMatrix<'_> {
        self.qmatrix(&self.weights.output)
    }

    /// Writes the embeddings of `tokens` into `out` (`tokens.len() × n_embd`).
    pub fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<(), ModelError> {
        let d = self.config.n_embd;
        let emb = &self.weights.token_embd;
        let bytes = self.matrix_bytes(emb);
        let rb = emb.row_bytes();
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= emb.rows {
                return Err(ModelError::BadToken { id: t, vocab: emb.rows });
            }
            let row = &bytes[t as usize * rb..(t as usize + 1) * rb];
            let dst = &mut out[i * d..(i + 1) * d];
            kernels::dequantize_row(emb.ty, row, dst);
            if self.config.embed_scale != 1.0 {
                dst.iter_mut().for_each(|v| *v *= self.config.embed_scale);
            }
        }
        Ok(())
    }

    /// Runs transformer block `il` over the `n = positions.len()` rows of `x` (`n × n_embd`, updated in place).
    /// The rows' keys and values are appended to layer `il` of `kv` (at slots `kv.len(il)..+n`); each row
    /// attends to every earlier slot of that layer and to the new rows that `mask` allows.
    pub fn layer(
        &self,
        il: usize,
        x: &mut [f32],
        positions: &[u32],
        mask: Mask,
        kv: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let lw = &self.weights.layers[il];
        let n = positions.len();
        let d = c.n_embd;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let hd = c.head_dim;
        let hdv = c.head_dim_v;
        let vd = c.n_head_kv * hdv;
        let att_d = c.n_head * hdv;
        kv.check_room(il, n)?;
        if let Mask::Allowed(a) = mask {
            assert_eq!(a.len(), n * n, "mask must be n×n");
        }

        grow(&mut ws.h, n * d);
        grow(&mut ws.q, n * qd);
        grow(&mut ws.k, n * kvd);
        grow(&mut ws.v, n * vd);
        grow(&mut ws.att, n * att_d);
        grow(&mut ws.o, n * d);
        grow(&mut ws.gate, n * c.n_ff);
        grow(&mut ws.up, n * c.n_ff);
        grow(&mut ws.cos, c.rope_dims / 2);
        grow(&mut ws.sin, c.rope_dims / 2);

        // Attention block.
        for r in 0..n {
            rms_norm(&x[r * d..(r + 1) * d], &lw.attn_norm, c.rms_eps, &mut ws.h[r * d..(r + 1) * d]);
        }
        let pool = &ws.pool;
        let (wq, wk, wv) = (self.qmatrix(&lw.wq), self.qmatrix(&lw.wk), self.qmatrix(&lw.wv));
        matmul_many(
            pool,
            &mut [(&wq, &mut ws.q[..n * qd]), (&wk, &mut ws.k[..n * kvd]), (&wv, &mut ws.v[..n * vd])],
            &ws.h[..n * d],
            n,
            &mut ws.mm,
        );
        self.finish_qkv(il, positions, n, true, ws);
        let base = kv.len(il);
        let total = base + n;
        self.append_kv(il, positions, kv, ws);
        let swa = c.layer_is_swa.get(il).copied().unwrap_or(false);

        // Attention: one task per (row, head), spread over the pool.
        let n_threads = ws.pool.n_threads();
        // Per item: scores and the two online-softmax factors of every position (see `Attention::run`).
        grow(&mut ws.scores, n_threads * ATT_ITEMS_PER_THREAD * 3 * total);
        let lc = kv.layer_mut(il);
        let (kc, vc, pc) = (&lc.k[..], &lc.v[..], &lc.pos[..]);
        let window = if swa { c.sliding_window } else { None };
        let group = c.n_head / c.n_head_kv;
        let scale = c.attn_scale;
        let q = &ws.q[..];
        let att = SharedMut(ws.att.as_mut_ptr());
        let scores = SharedMut(ws.scores.as_mut_ptr());
        let n_tasks = n * c.n_head;
        let job = Attention {
            q,
            kc,
            vc,
            pc,
            positions,
            mask,
            window,
            base,
            total,
            n,
            qd,
            kvd,
            vd,
            hd,
            hdv,
            att_d,
            n_head: c.n_head,
            group,
            scale,
            att,
        };
        // Items of a few tasks, claimed dynamically (a descheduled thread then delays only its own item),
        // at most ATT_ITEMS_PER_THREAD per thread so that each item has its own score scratch.
        let per_item = n_tasks.div_ceil(n_threads * ATT_ITEMS_PER_THREAD);
        let n_items = n_tasks.div_ceil(per_item);
        ws.pool.run_items(n_items, &|i| {
            // SAFETY: each item owns its scores slice and writes only the att rows of its own tasks.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(i * 3 * total), 3 * total) };
            job.run(i * per_item..((i + 1) * per_item).min(n_tasks), sc);
        });

        let pool = &ws.pool;
        matmul(pool, &self.qmatrix(&lw.wo), &ws.att[..n * att_d], n, &mut ws.o[..n * d], &mut ws.mm);
        self.residual(x, &mut ws.o[..n * d], lw.post_attn_norm.as_deref(), n);

        // Feed-forward block.
        for r in 0..n {
            rms_norm(&x[r * d..(r + 1) * d], &lw.ffn_norm, c.rms_eps, &mut ws.h[r * d..(r + 1) * d]);
        }
        let ff = c.n_ff;
        let (wg, wu) = (self.qmatrix(&lw.w_gate), self.qmatrix(&lw.w_up));
        matmul_many(
            pool,
            &mut [(&wg, &mut ws.gate[..n * ff]), (&wu, &mut ws.up[..n * ff])],
            &ws.h[..n * d],
            n,
            &mut ws.mm,
        );
        // Element-wise, split across the pool (with libm's expf/tanhf this was 9% of a Gemma 8-row forward in
        // callgrind on one thread and 14% of a Gemma prefill in perf; now vectorised, see `glu_in_place`).
        let (gate, up, len) = (SharedMut(ws.gate.as_mut_ptr()), &ws.up[..n * ff], n * ff);
        let activation = c.activation;
        pool.run_items(len.div_ceil(ACT_CHUNK), &|i| {
            let range = i * ACT_CHUNK..((i + 1) * ACT_CHUNK).min(len);
            // SAFETY: `gate` holds n * ff elements; items are disjoint ranges of it.
            let g = unsafe { std::slice::from_raw_parts_mut(gate.get().add(range.start), range.len()) };
            glu_in_place(activation, g, &up[range]);
        });
        matmul(pool, &self.qmatrix(&lw.w_down), &ws.gate[..n * ff], n, &mut ws.o[..n * d], &mut ws.mm);
        self.residual(x, &mut ws.o[..n * d], lw.post_ffn_norm.as_deref(), n);
        Ok(())
    }

    /// Biases, QK norms and RoPE of the `n` freshly projected rows in `ws.q` (if `with_q`), `ws.k` and `ws.v`,
    /// then the rounding to f16 of everything the attention reads.
    ///
    /// Attention follows llama.cpp's CPU flash attention (on by default), whose rounding dominates the
    /// difference between our logits and its own. K and V are cached in f16. Every row takes its per-row
    /// path (queries rounded to f16, online softmax, V·softmax accumulated in f16) whatever the batch size:
    /// llama.cpp switches batches of `FA_TILE_Q` or more rows to a tiled f32 path, but then a token's result
    /// would depend on the batch it is computed in, and a speculative step (the last prompt token verified
    /// in a small tree) would no longer reproduce dense decoding (which ran it inside the prompt's batch)
    /// bit for bit. Prompt processing differs from llama.cpp's by that rounding only (perplexity −0.1%).
    fn finish_qkv(&self, il: usize, positions: &[u32], n: usize, with_q: bool, ws: &mut Workspace) {
        let c = &self.config;
        let lw = &self.weights.layers[il];
        let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let vd = c.n_head_kv * c.head_dim_v;
        let q_rows = if with_q { n } else { 0 };
        for (buf, bias, width, rows) in
            [(&mut ws.q, &lw.bq, qd, q_rows), (&mut ws.k, &lw.bk, kvd, n), (&mut ws.v, &lw.bv, vd, n)]
        {
            if let Some(b) = bias {
                for r in 0..rows {
                    buf[r * width..(r + 1) * width].iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        }
        let swa = c.layer_is_swa.get(il).copied().unwrap_or(false);
        let inv = if swa { &self.rope_inv_swa } else { &self.rope_inv };
        let half = c.rope_dims / 2;
        for r in 0..n {
            rope_angles(positions[r], inv, &mut ws.cos[..half], &mut ws.sin[..half]);
            for h in 0..c.n_head * usize::from(with_q) {
                let head = &mut ws.q[r * qd + h * hd..r * qd + (h + 1) * hd];
                if let Some(w) = &lw.q_norm {
                    rms_norm_in_place(head, w, c.rms_eps);
                }
                rope_apply(head, &ws.cos[..half], &ws.sin[..half], c.rope_style);
            }
            for h in 0..c.n_head_kv {
                let head = &mut ws.k[r * kvd + h * hd..r * kvd + (h + 1) * hd];
                if let Some(w) = &lw.k_norm {
                    rms_norm_in_place(head, w, c.rms_eps);
                }
                rope_apply(head, &ws.cos[..half], &ws.sin[..half], c.rope_style);
            }
        }
        for v in ws.q[..q_rows * qd].iter_mut().chain(ws.k[..n * kvd].iter_mut()).chain(ws.v[..n * vd].iter_mut()) {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }

    /// Appends the `n = positions.len()` rows of `ws.k` / `ws.v` to layer `il` of the cache.
    fn append_kv(&self, il: usize, positions: &[u32], kv: &mut KvCache, ws: &Workspace) {
        let c = &self.config;
        let (kvd, vd, n) = (c.kv_dim(), c.n_head_kv * c.head_dim_v, positions.len());
        let base = kv.len(il);
        let total = base + n;
        let lc = kv.layer_mut(il);
        // Exact: `finish_qkv` rounded them to f16.
        let bits = |dst: &mut [u16], src: &[f32]| {
            dst.iter_mut().zip(src).for_each(|(d, &s)| *d = half::f16::from_f32(s).to_bits());
        };
        bits(&mut lc.k[base * kvd..total * kvd], &ws.k[..n * kvd]);
        bits(&mut lc.v[base * vd..total * vd], &ws.v[..n * vd]);
        lc.pos[base..total].copy_from_slice(positions);
        lc.len = total;
    }

    /// Computes only the keys and values that block `il` would cache for the rows `x` (`n × n_embd`, not
    /// changed) and appends them to that layer's cache — no attention, no feed-forward. Early exit uses it to
    /// fill the layers a token skipped from its exit hidden state (CALM-style state propagation).
    pub fn layer_kv(
        &self,
        il: usize,
        x: &[f32],
        positions: &[u32],
        kv: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let lw = &self.weights.layers[il];
        let n = positions.len();
        let d = c.n_embd;
        let (kvd, vd) = (c.kv_dim(), c.n_head_kv * c.head_dim_v);
        kv.check_room(il, n)?;
        grow(&mut ws.h, n * d);
        grow(&mut ws.k, n * kvd);
        grow(&mut ws.v, n * vd);
        grow(&mut ws.cos, c.rope_dims / 2);
        grow(&mut ws.sin, c.rope_dims / 2);
        for r in 0..n {
            rms_norm(&x[r * d..(r + 1) * d], &lw.attn_norm, c.rms_eps, &mut ws.h[r * d..(r + 1) * d]);
        }
        let (wk, wv) = (self.qmatrix(&lw.wk), self.qmatrix(&lw.wv));
        matmul_many(
            &ws.pool,
            &mut [(&wk, &mut ws.k[..n * kvd]), (&wv, &mut ws.v[..n * vd])],
            &ws.h[..n * d],
            n,
            &mut ws.mm,
        );
        self.finish_qkv(il, positions, n, false, ws);
        self.append_kv(il, positions, kv, ws);
        Ok(())
    }

    /// `x += post_norm(o)` row by row.
    fn residual(&self, x: &mut [f32], o: &mut [f32], post_norm: Option<&[f32]>, n: usize) {
        let d = self.config.n_embd;
        for r in 0..n {
            let orow = &mut o[r * d..(r + 1) * d];
            if let Some(w) = post_norm {
                rms_norm_in_place(orow, w, self.config.rms_eps);
            }
            x[r * d..(r + 1) * d].iter_mut().zip(orow.iter()).for_each(|(a, b)| *a += b);
        }
    }

    /// Output RMS norm of `n` hidden rows.
    pub fn final_norm(&self, x: &[f32], out: &mut [f32]) {
        let d = self.config.n_embd;
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            rms_norm(xr, &self.weights.output_norm, self.config.rms_eps, or);
        }
    }

    /// Full-vocabulary logits of `n` normed rows into `logits` (`n × vocab`). Several rows are multiplied by the
    /// head interleaved by 8 rows where that pays ([`Model::head_x8`]; the same numbers up to float summation
    /// order), one row by the head as stored.
    pub fn head_full(&self, normed: &[f32], n: usize, logits: &mut [f32], ws: &mut Workspace) {
        let x8 = if n >= 2 { self.head_x8(n) } else { None };
        self.head_product(x8, normed, n, logits, ws);
    }

    /// [`Model::head_full`] with the interleaved head `x8` if given, else the head as stored.
    fn head_product(&self, x8: Option<&[u8]>, normed: &[f32], n: usize, logits: &mut [f32], ws: &mut Workspace) {
        let v = self.config.vocab_size;
        let m = &self.weights.output;
        let head = match x8 {
            Some(bytes) => {
                QMatrix { ty: m.ty, data: bytes, rows: m.rows, cols: m.cols, layout: kernels::Layout::Interleaved8 }
            }
            None => self.qmatrix(m),
        };
        matmul(&ws.pool, &head, &normed[..n * self.config.n_embd], n, &mut logits[..n * v], &mut ws.mm);
    }

    /// The head interleaved by 8 rows ([`kernels::repack::interleave8`]) for products over several rows: with
    /// AVX-512 VNNI a Q8_0 head interleaved multiplies 2 rows in the time of one and 8 rows in ~1.5–2.6×
    /// (vs ~1.4× and ~3–3.9× as stored; `kbench`), at the cost of a second copy (32 bytes more per 8 rows and
    /// block than the file: +34 MB for SmolLM2, +199 MB for Gemma 3 270M). Single rows keep the stored head (its
    /// rows are also read one by one: embeddings, the screen's exact rows). `SPECEE_HEAD_X8=0` turns it off.
    ///
    /// Built once [`X8_AFTER_ROWS`] rows went through multi-row head products (`rows` is this call's), so a short
    /// generation does not pay the build (Gemma's: 0.2 s); [`Model::warm_head_screen`] builds it at once.
    fn head_x8(&self, rows: usize) -> Option<&[u8]> {
        if let Some(built) = self.head_x8.get() {
            return built.as_deref();
        }
        let seen = self.x8_rows.fetch_add(rows, std::sync::atomic::Ordering::Relaxed) + rows;
        if seen < X8_AFTER_ROWS {
            return None;
        }
        self.build_head_x8()
    }

    /// Builds the interleaved head now if it pays ([`Model::head_x8`]).
    fn build_head_x8(&self) -> Option<&[u8]> {
        self.head_x8
            .get_or_init(|| {
                let m = &self.weights.output;
                let on = std::env::var("SPECEE_HEAD_X8").map_or(true, |v| v != "0")
                    && m.layout == kernels::Layout::Rows
                    && m.rows % 8 == 0
                    && kernels::repack::interleave_pays(m.ty);
                on.then(|| kernels::repack::interleave8(m.ty, self.matrix_bytes(m), m.rows, m.cols).into())
            })
            .as_deref()
    }

    /// The argmax token of each of `n` normed rows into `out` — the first maximum of [`Model::head_full`]'s
    /// logits, exactly. A Q8_0 head of at least [`SCREEN_MIN_BYTES`] is read (after [`SCREEN_AFTER_CALLS`]
    /// calls) through a 6-bit screen plus the exact rows of the few tokens it cannot rule out
    /// ([`kernels::screen`]; 23% fewer head bytes, the same instructions per weight, so it pays where the head
    /// product is memory-bound); others take the full product. `SPECEE_HEAD_SCREEN=1`/`0` forces the screen
    /// on/off. Returns how many head rows got the exact product.
    pub fn head_argmax(&self, normed: &[f32], n: usize, out: &mut [u32], ws: &mut Workspace) -> usize {
        let d = self.config.n_embd;
        // Several rows: the interleaved head's full product, where built, beats the screen (Gemma 3 270M, 2 rows:
        // 5.3 vs 6.2 ms; 4 rows: 5.5 vs 8.2 ms; `headbench`), unless the screen is forced.
        let forced = self.screen_forced.load(std::sync::atomic::Ordering::Relaxed);
        let x8 = if n >= 2 && !forced { self.head_x8(n) } else { None };
        let screen = if x8.is_none() { self.screen(ws.n_threads()) } else { None };
        if let Some(screen) = screen {
            let head = self.qmatrix(&self.weights.output);
            return screen.argmax(&ws.pool, &head, &normed[..n * d], n, &mut out[..n], &mut ws.mm);
        }
        let v = self.config.vocab_size;
        let mut logits = std::mem::take(&mut ws.logits);
        grow(&mut logits, n * v);
        self.head_product(x8, normed, n, &mut logits, ws);
        for (o, row) in out.iter_mut().zip(logits.chunks_exact(v).take(n)) {
            *o = kernels::screen::first_max(row) as u32;
        }
        ws.logits = logits;
        n * v
    }

    /// Makes [`Model::head_argmax`] use the head screen whatever the head's size and the number of rows (unless
    /// it already ran, or `SPECEE_HEAD_SCREEN=0`), building it on `threads` threads. Returns whether the screen is
    /// in use (a head that is not Q8_0 has none).
    pub fn force_head_screen(&self, threads: usize) -> bool {
        self.screen_forced.store(true, std::sync::atomic::Ordering::Relaxed);
        self.build_screen(threads, true).is_some()
    }

    /// Builds the head screen now if [`Model::head_argmax`] would use it (a large enough Q8_0 head, or
    /// `SPECEE_HEAD_SCREEN=1`), instead of after [`SCREEN_AFTER_CALLS`] greedy calls, and the interleaved head
    /// where it pays instead of after [`X8_AFTER_ROWS`] rows: for benchmarks, which time the steady state.
    /// Returns whether the screen is in use.
    pub fn warm_head_screen(&self, threads: usize) -> bool {
        self.build_head_x8();
        self.build_screen(threads, false).is_some()
    }

    /// The head screen for a greedy call: none while the head does not qualify or fewer than
    /// [`SCREEN_AFTER_CALLS`] calls were made (unless `SPECEE_HEAD_SCREEN=1`), then built once.
    fn screen(&self, threads: usize) -> Option<&HeadScreen> {
        if let Some(built) = self.head_screen.get() {
            return built.as_ref();
        }
        let setting = screen_setting();
        if !self.screen_wanted(setting) {
            return self.head_screen.get_or_init(|| None).as_ref();
        }
        let calls = self.greedy_calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if calls < SCREEN_AFTER_CALLS && setting.is_none() {
            return None;
        }
        self.build_screen(threads, false)
    }

    /// Whether greedy calls use the screen: as `SPECEE_HEAD_SCREEN` says (`setting`), else for a Q8_0 head of at
    /// least [`SCREEN_MIN_BYTES`] ([`SCREEN_MIN_BYTES_VNNI`] with AVX-512 VNNI kernels).
    fn screen_wanted(&self, setting: Option<bool>) -> bool {
        let head = self.qmatrix(&self.weights.output);
        let min = if kernels::vnni() { SCREEN_MIN_BYTES_VNNI } else { SCREEN_MIN_BYTES };
        setting.unwrap_or(head.ty == gguf::GgmlType::Q8_0 && head.data.len() >= min)
    }

    /// Builds the screen on `threads` threads, once, if it is wanted or `force`d; `SPECEE_HEAD_SCREEN=0` always
    /// wins.
    fn build_screen(&self, threads: usize, force: bool) -> Option<&HeadScreen> {
        let built = self.head_screen.get_or_init(|| {
            let setting = screen_setting();
            let on = setting != Some(false) && (force || self.screen_wanted(setting));
            on.then(|| HeadScreen::new(&self.qmatrix(&self.weights.output), threads).ok()).flatten()
        });
        built.as_ref()
    }

    /// Row `id` of the output head (the weights of token `id`'s logit), dequantized into `out` (`n_embd`).
    pub fn head_row(&self, id: u32, out: &mut [f32]) -> Result<(), ModelError> {
        let m = &self.weights.output;
        if id as usize >= m.rows {
            return Err(ModelError::BadToken { id, vocab: m.rows });
        }
        let rb = m.row_bytes();
        let bytes = self.matrix_bytes(m);
        kernels::dequantize_row(m.ty, &bytes[id as usize * rb..(id as usize + 1) * rb], &mut out[..m.cols]);
        Ok(())
    }

    /// Logits of the tokens `ids` only, for one normed row.
    pub fn head_rows(&self, normed: &[f32], ids: &[u32], out: &mut [f32], ws: &mut Workspace) {
        matmul_rows(
            &ws.pool,
            &self.qmatrix(&self.weights.output),
            ids,
            &normed[..self.config.n_embd],
            &mut out[..ids.len()],
            &mut ws.mm,
        );
    }

    /// Logits of `per_row` chosen tokens for each of several normed rows, in one call: `out[i]` is the logit of
    /// `ids[i]` for row `i / per_row` (`normed` holds `ids.len() / per_row` rows).
    pub fn head_rows_grouped(&self, normed: &[f32], ids: &[u32], per_row: usize, out: &mut [f32], ws: &mut Workspace) {
        kernels::matmul_rows_grouped(
            &ws.pool,
            &self.qmatrix(&self.weights.output),
            ids,
            normed,
            per_row,
            &mut out[..ids.len()],
            &mut ws.mm,
        );
    }

    /// Runs `tokens` through every layer as [`Model::forward`] and returns the greedy next token after the last
    /// one ([`Model::head_argmax`]: the argmax of the logits `forward` would return, without computing them).
    pub fn forward_argmax(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        ws: &mut Workspace,
        hidden: &mut Vec<f32>,
    ) -> Result<u32, ModelError> {
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::EmptyInput);
        }
        self.forward(tokens, kv, ws, hidden, Logits::None)?;
        let d = self.config.n_embd;
        let mut normed = std::mem::take(&mut ws.normed);
        grow(&mut normed, d);
        self.final_norm(&hidden[(n - 1) * d..n * d], &mut normed[..d]);
        let mut out = [0u32];
        self.head_argmax(&normed, 1, &mut out, ws);
        ws.normed = normed;
        Ok(out[0])
    }

    /// Runs `tokens` through every layer at positions `kv.seq_len()..`, causally, and returns the logits of the
    /// rows `which` asks for (`rows × vocab`, borrowed from the workspace). `hidden` receives the final
    /// (un-normed) hidden rows.
    pub fn forward<'w>(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        ws: &'w mut Workspace,
        hidden: &mut Vec<f32>,
        which: Logits,
    ) -> Result<&'w [f32], ModelError> {
        let n = tokens.len();
        let d = self.config.n_embd;
        if n == 0 {
            return Ok(&ws.logits[..0]);
        }
        let start = kv.seq_len();
        if start + n > kv.capacity() {
            return Err(ModelError::ContextFull { needed: start + n, capacity: kv.capacity() });
        }
        hidden.resize(n * d, 0.0);
        self.embed(tokens, hidden)?;
        let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
        for il in 0..self.config.n_layers {
            self.layer(il, hidden, &positions, Mask::Causal, kv, ws)?;
        }
        let (first, rows) = match which {
            Logits::Last => (n - 1, 1),
            Logits::All => (0, n),
            Logits::None => return Ok(&ws.logits[..0]),
        };
        let v = self.config.vocab_size;
        let mut normed = std::mem::take(&mut ws.normed);
        grow(&mut normed, rows * d);
        self.final_norm(&hidden[first * d..(first + rows) * d], &mut normed[..rows * d]);
        let mut logits = std::mem::take(&mut ws.logits);
        grow(&mut logits, rows * v);
        self.head_full(&normed, rows, &mut logits, ws);
        ws.normed = normed;
        ws.logits = logits;
        Ok(&ws.logits[..rows * v])
    }
}

/// `SPECEE_HEAD_SCREEN`: `Some(true)` for `1`, `Some(false)` for `0`, `None` otherwise (automatic).
fn screen_setting() -> Option<bool> {
    match std::env::var("SPECEE_HEAD_SCREEN").as_deref() {
        Ok("1") => Some(true),
        Ok("0") => Some(false),
        _ => None,
    }
}

/// The attention of a batch over one layer's KV cache: one task per (row, head).
struct Attention<'a> {
    q: &'a [f32],
    kc: &'a [u16],
    vc: &'a [u16],
    pc: &'a [u32],
    positions: &'a [u32],
    mask: Mask<'a>,
    window: Option<usize>,
    base: usize,
    total: usize,
    n: usize,
    qd: usize,
    kvd: usize,
    vd: usize,
    hd: usize,
    hdv: usize,
    att_d: usize,
    n_head: usize,
    group: usize,
    scale: f32,
    att: SharedMut,
}

impl Attention<'_> {
    /// Runs `tasks` (task = row * n_head + head), using `sc` (`3 * total` floats) as scratch.
    /// With AVX2+FMA+F16C: explicit vector kernels for the f16 cache rows, each bit-identical to the portable
    /// one (the element order of every sum is fixed, and floating-point contraction is never applied).
    fn run(&self, tasks: std::ops::Range<usize>, sc: &mut [f32]) {
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
        self.run_generic(tasks, sc, dot_f16, |q, ks| ks.map(|k| dot_f16(q, k)), axpy_f16)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, tasks: std::ops::Range<usize>, sc: &mut [f32]) {
        // SAFETY: this function is only entered when avx2, fma and f16c are available.
        self.run_generic(
            tasks,
            sc,
            |a, b| unsafe { dot_avx2(a, b) },
            |q, ks| unsafe { dot8_avx2(q, ks) },
            |a, x, y| unsafe { axpy_f16_avx2(a, x, y) },
        )
    }

    /// The attention tasks, with `dot` a dot product with an f16 key, `dot8` eight of them against one query
    /// (each bit-identical to `dot`) and `axpy` [`axpy_f16`].
    #[inline(always)]
    fn run_generic(
        &self,
        tasks: std::ops::Range<usize>,
        sc: &mut [f32],
        dot: impl Fn(&[f32], &[u16]) -> f32,
        dot8: impl Fn(&[f32], [&[u16]; 8]) -> [f32; 8],
        axpy: impl Fn(f32, &[u16], &mut [f32]),
    ) {
        let Attention {
            q,
            kc,
            vc,
            pc,
            positions,
            mask,
            window,
            base,
            total,
            n,
            qd,
            kvd,
            vd,
            hd,
            hdv,
            att_d,
            n_head,
            group,
            scale,
            att,
        } = *self;
        let c_n_head = n_head;
        for task in tasks {
            let (j, h) = (task / c_n_head, task % c_n_head);
            let kvh = h / group;
            let qv = &q[j * qd + h * hd..j * qd + (h + 1) * hd];
            let pj = positions[j];
            let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(j * att_d + h * hdv), hdv) };
            out.fill(0.0);
            // Whether row j sees cache position s (its own batch causally or by the tree mask, and inside
            // the sliding window), and the key at s.
            let visible = |s: usize| {
                (if s < base {
                    true
                } else {
                    let m = s - base;
                    match mask {
                        Mask::Causal => m <= j,
                        Mask::Allowed(a) => a[j * n + m],
                    }
                }) && window.is_none_or(|w| (pj as i64 - pc[s] as i64) < w as i64)
            };
            let krow = |s: usize| &kc[s * kvd + kvh * hd..s * kvd + (kvh + 1) * hd];
            // Online softmax with an f16 accumulator (ggml's flash_attn_ext one_chunk kernel), in three
            // passes with exactly its sequence of operations: (1) every visible position's score, (2) in
            // order, the running maximum and the factors it implies (`ms` rescales the accumulator when the
            // maximum grows, `vs` weighs the position's V), (3) the f16 accumulation. The exps run in their
            // own loop, so the vector loop (3) makes no calls.
            let (scores, rest) = sc.split_at_mut(total);
            let (rescale, weight) = rest.split_at_mut(total);
            // Eight positions at a time (their dot products' reductions interleave), the rest one by one.
            let mut s0 = 0;
            while s0 < total {
                let len = (total - s0).min(8);
                let mut vis = [false; 8];
                let mut any = false;
                for i in 0..len {
                    vis[i] = visible(s0 + i);
                    any |= vis[i];
                }
                if len == 8 && any {
                    let d = dot8(qv, std::array::from_fn(|i| krow(s0 + i)));
                    for i in 0..8 {
                        scores[s0 + i] = if vis[i] { d[i] * scale } else { f32::NEG_INFINITY };
                    }
                } else {
                    for i in 0..len {
                        scores[s0 + i] = if vis[i] { dot(qv, krow(s0 + i)) * scale } else { f32::NEG_INFINITY };
                    }
                }
                s0 += len;
            }
            let (mut m_max, mut sum) = (f32::NEG_INFINITY, 0f32);
            for s in 0..total {
                let sv = scores[s];
                if sv == f32::NEG_INFINITY {
                    continue;
                }
                // rescale < 0: no rescaling at this position.
                let (mut ms, mut vs, mut r) = (1f32, 1f32, -1f32);
                if sv > m_max {
                    if m_max != f32::NEG_INFINITY {
                        ms = (m_max - sv).exp();
                        r = ms;
                    } else {
                        ms = 0.0;
                    }
                    m_max = sv;
                } else {
                    vs = (sv - m_max).exp();
                }
                rescale[s] = r;
                weight[s] = vs;
                sum = sum * ms + vs;
            }
            for s in 0..total {
                if scores[s] == f32::NEG_INFINITY {
                    continue;
                }
                if rescale[s] >= 0.0 {
                    scale_f16(rescale[s], out);
                }
                axpy(weight[s], &vc[s * vd + kvh * hdv..s * vd + (kvh + 1) * hdv], out);
            }
            let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
            out.iter_mut().for_each(|v| *v *= inv);
        }
    }
}

/// [`dot_avx2`] of one query `q` with eight keys, bit-identical to eight calls: the same lane accumulators
/// (multiply, then add), then the eight reductions at once (an 8 × 8 transpose, and the lanes added in the same
/// order `((l0 + l1) + l2) + …`), then the same scalar tail. Eight independent accumulation chains instead of
/// one keep the adder busy.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot8_avx2(q: &[f32], ks: [&[u16]; 8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let len = ks.iter().fold(q.len(), |m, k| m.min(k.len()));
    let chunks = q.len() / 8;
    assert!(chunks * 8 <= len);
    let mut acc = [_mm256_setzero_ps(); 8];
    for c in 0..chunks {
        // SAFETY: c * 8 + 8 <= len for q and every key (asserted above).
        let x = unsafe { _mm256_loadu_ps(q.as_ptr().add(c * 8)) };
        for (acc, k) in acc.iter_mut().zip(&ks) {
            let y = unsafe { load_f16x8(k.as_ptr().add(c * 8)) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
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
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
    for (o, k) in out.iter_mut().zip(&ks) {
        for i in chunks * 8..q.len() {
            *o += q[i] * f16_to_f32(k[i]);
        }
    }
    out
}

/// Eight f16 values (bits at `p`) as f32 (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load_f16x8(p: *const u16) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees 8 readable values at `p`.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}

/// [`axpy_f16`] with explicit vectors: the same fused multiply-add and the same f16 rounding (Veltkamp split:
/// one multiply, two subtractions) per element, so the result is bit-identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy_f16_avx2(a: f32, x: &[u16], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let len = x.len().min(y.len());
    let (va, split) = (_mm256_set1_ps(a), _mm256_set1_ps(8193.0));
    for c in 0..len / 8 {
        // SAFETY: c * 8 + 8 <= len for both slices.
        unsafe {
            let xv = load_f16x8(x.as_ptr().add(c * 8));
            let yp = y.as_mut_ptr().add(c * 8);
            let f = _mm256_fmadd_ps(va, xv, _mm256_loadu_ps(yp));
            let t = _mm256_mul_ps(f, split);
            _mm256_storeu_ps(yp, _mm256_sub_ps(t, _mm256_sub_ps(t, f)));
        }
    }
    for i in len / 8 * 8..len {
        y[i] = round_f16(a.mul_add(f16_to_f32(x[i]), y[i]));
    }
}

/// [`dot_f16`] with explicit AVX2 vectors: the same eight lane accumulators (multiply, then add; no FMA) and
/// the same final summation order, so the result is bit-identical.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_avx2(a: &[f32], b: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let len = a.len().min(b.len());
    let chunks = a.len() / 8;
    assert!(chunks * 8 <= len);
    let mut acc = _mm256_setzero_ps();
    for c in 0..chunks {
        // SAFETY: c * 8 + 8 <= len for both slices (asserted above).
        let (x, y) = unsafe { (_mm256_loadu_ps(a.as_ptr().add(c * 8)), load_f16x8(b.as_ptr().add(c * 8))) };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum: f32 = lanes.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * f16_to_f32(b[i]);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attention's vector kernels over f16 cache rows equal the portable ones bit for bit: eight dot
    /// products at once, one at a time (the same sums in the same order), and the f16 accumulation, with and
    /// without a scalar tail.
    #[test]
    fn attention_vector_kernels_are_bit_identical() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            let mut state = 0x2545_f491_4f6c_dd1du64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 22) as f32 - 2.0
            };
            let f16 = |v: f32| half::f16::from_f32(v).to_bits();
            for len in [64, 72, 29, 8] {
                let q: Vec<f32> = (0..len).map(|_| next()).collect();
                let keys: Vec<Vec<u16>> = (0..8).map(|_| (0..len).map(|_| f16(next() * 1e3)).collect()).collect();
                // SAFETY: the CPU has avx2, fma and f16c (checked above).
                let got = unsafe { dot8_avx2(&q, std::array::from_fn(|i| &keys[i][..])) };
                for (g, k) in got.iter().zip(&keys) {
                    let one = unsafe { dot_avx2(&q, k) };
                    assert_eq!(g.to_bits(), one.to_bits(), "len {len}: {g} vs {one}");
                    assert_eq!(g.to_bits(), dot_f16(&q, k).to_bits(), "len {len}");
                }
                // Many accumulations: a fused and an unfused multiply-add differ in the f16 result only rarely.
                for trial in 0..400 {
                    let x: Vec<u16> = (0..len).map(|_| f16(next())).collect();
                    let y0: Vec<f32> = (0..len).map(|_| round_f16(next())).collect();
                    let a = next();
                    let (mut want, mut got) = (y0.clone(), y0);
                    axpy_f16(a, &x, &mut want);
                    // SAFETY: as above.
                    unsafe { axpy_f16_avx2(a, &x, &mut got) };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "len {len} trial {trial}");
                }
            }
        }
    }
}
