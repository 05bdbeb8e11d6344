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
use crate::attention::{Attention, MAX_SHARES, SCRATCH_PER_SLOT};
use crate::blocks::{glu_in_place, rms_norm, rms_norm_in_place, rope_angles, rope_apply, rope_inv_freq};
use crate::config::Config;
use crate::error::ModelError;
use crate::kv_cache::KvCache;
use crate::sparsity::{sparsify, sparsify_blocks, ActCounts, ActHistograms, ActThresholds, Site};
use crate::weights::{Matrix, Weights};
use crate::workspace::{grow, Workspace};
use gguf::GgufFile;
use kernels::{matmul, matmul_many, matmul_pair_then, matmul_rows, HeadScreen, QMatrix};
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

/// One sequence's share of a [`Model::layer_batch`] or [`Model::forward_batch`] call: the positions of its new
/// rows (consecutive in the batch), which of them each may see, and its own cache.
pub struct Sequence<'p, 'k> {
    pub positions: &'p [u32],
    pub mask: Mask<'p>,
    pub kv: &'k mut KvCache,
}

/// One sequence's new rows for [`Model::forward_rows`]: their tokens, their positions and which of them each sees.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub mask: Mask<'a>,
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
    /// The head interleaved by 8 rows for full-logit products ([`Model::head_full`]), built on first use;
    /// `None` where interleaving does not pay ([`kernels::repack::interleave_pays`]) or `SPECEE_HEAD_X8=0`.
    head_x8: std::sync::OnceLock<Option<Box<[u8]>>>,
    /// Rows multiplied by the full head before `head_x8` was built ([`X8_AFTER_ROWS`]).
    x8_rows: std::sync::atomic::AtomicUsize,
    /// Greedy calls use the screen for any number of rows ([`Model::force_head_screen`]).
    screen_forced: std::sync::atomic::AtomicBool,
    /// Activation sparsity: thresholds below which the layers' matrix inputs are zeroed ([`crate::sparsity`]).
    act_sparsity: Option<ActThresholds>,
}

/// The interleaved head ([`Model::head_x8`]) is built once this many rows went through full-logit head products:
/// at once for perplexity or `eval` chunks, after ~128 two-row tree verifications or 256 sampled tokens. Gemma 3
/// 270M's build takes ~0.2 s and saves ~1–3 ms per 2-row product on the 2-core AVX-512 machine.
pub const X8_AFTER_ROWS: usize = 256;

/// llama.cpp switches batches of at least this many rows to its tiled flash-attention path (`GGML_FA_TILE_Q`).
/// We do not follow it there (see the attention comment in [`Model::layer`]); kept for the record.
#[allow(dead_code)]
const FA_TILE_Q: usize = 64;

/// Heads at least this large (Q8_0 bytes) use the head screen for greedy argmax by default, on every instruction
/// set. Until session 19 AVX2 machines needed 64 MB (Gemma 3 270M's 178 MB head decoded ~20% faster with the
/// row-major screen on a 2-core AVX2 machine, SmolLM2's 30 MB one, much of it staying in a 32 MB L3, no faster)
/// and AVX-512 VNNI ones 16 MB. With the interleaved screen, SmolLM2 on the 2-vCPU Sapphire Rapids VM with the AVX2
/// kernels (`SPECEE_KERNEL=avx2`, `SPECEE_HEAD_SCREEN=1` vs `0`, session 20): `bench -p 16 -n 128 -r 3` decodes
/// 342.8 vs 324.7 and 327.9 vs 315.3 tok/s (alternating), the eagle chat bench 406.3 vs 355.7 tok/s.
pub const SCREEN_MIN_BYTES: usize = 16 << 20;

/// Greedy head calls of up to this many rows use the screen (where built), and the interleaved full product above
/// it. Since the screen is interleaved like the matmuls (session 20) each further row costs it little, and it won
/// at every size measured: `headbench MODEL 2 REFERENCE.jsonl` (a forward of n rows plus the head's argmax, real
/// token ids, 200 alternating runs each, median ms, interleaved against screened), SmolLM2 (49,152 rows) 1 row
/// 2.68 vs 2.43, 4 rows 4.49 vs 4.13, 8 rows 6.58 vs 5.97, 16 rows 12.23 vs 11.11; Gemma 3 270M (262,144 rows)
/// 1 row 13.26 vs 10.79, 4 rows 14.83 vs 13.66, 8 rows 20.41 vs 16.46, 16 rows 33.02 vs 26.24. (The row-major
/// screen before it lost from 8 rows.) Larger calls were not measured.
pub const SCREEN_MAX_ROWS: usize = 16;

/// The head screen is built on the greedy head call after this many (0.3 s for Gemma's, paid back after ~130
/// tokens at 1.3 ms each): a short one-shot generation never pays for it, a server or a long generation builds it
/// once. [`Model::warm_head_screen`] builds it at once (benchmarks), `SPECEE_HEAD_SCREEN=1` on the first call.
pub const SCREEN_AFTER_CALLS: usize = 256;

/// Rounds every value of `v` to the nearest f16 (ties to even), in place: what the KV cache stores.
fn round_to_f16(v: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut buf = [half::f16::ZERO; 256];
    for chunk in v.chunks_mut(buf.len()) {
        let b = &mut buf[..chunk.len()];
        b.convert_from_f32_slice(chunk);
        b.convert_to_f32_slice(chunk);
    }
}

/// A raw pointer that may be shared between pool threads writing disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut(pub(crate) *mut f32);
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}
impl SharedMut {
    pub(crate) fn get(self) -> *mut f32 {
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
        // Layer matrices in a type or layout with slow kernels become an exactly equal faster one (Q4_1, Q5_0 →
        // 8 interleaved rows; Q5_0 → Q8_0 on the scalar kernels); `SPECEE_REPACK=0` keeps the file's (to measure the
        // difference).
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
            act_sparsity: None,
        })
    }

    /// Zeroes every layer's matrix inputs below `thresholds` from now on (`None`: dense again). Refuses thresholds
    /// for another number of layers.
    pub fn set_act_sparsity(&mut self, thresholds: Option<ActThresholds>) -> Result<(), ModelError> {
        if let Some(t) = &thresholds {
            if t.layers.len() != self.config.n_layers {
                return Err(ModelError::ActLayers { found: t.layers.len(), layers: self.config.n_layers });
            }
        }
        self.act_sparsity = thresholds;
        Ok(())
    }

    /// The activation-sparsity thresholds in use ([`Model::set_act_sparsity`]).
    pub fn act_sparsity(&self) -> Option<&ActThresholds> {
        self.act_sparsity.as_ref()
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
        self.layer_batch(il, x, &mut [Sequence { positions, mask, kv }], ws)
    }

    /// [`Model::layer`] over the rows of several independent sequences at once (`x` holds their rows in order):
    /// the products read each weight once for all rows; each sequence attends only to its own cache and rows.
    /// Every row's result is what a one-sequence call would give it (the products are batch-invariant).
    pub fn layer_batch(
        &self,
        il: usize,
        x: &mut [f32],
        seqs: &mut [Sequence<'_, '_>],
        ws: &mut Workspace,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let lw = &self.weights.layers[il];
        let joined: Vec<u32>;
        let positions: &[u32] = match seqs {
            [one] => one.positions,
            _ => {
                joined = seqs.iter().flat_map(|s| s.positions.iter().copied()).collect();
                &joined
            }
        };
        let n = positions.len();
        let d = c.n_embd;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let hd = c.head_dim;
        let hdv = c.head_dim_v;
        let vd = c.n_head_kv * hdv;
        let att_d = c.n_head * hdv;
        for s in seqs.iter() {
            s.kv.check_room(il, s.positions.len())?;
            if let Mask::Allowed(a) = s.mask {
                let m = s.positions.len();
                assert_eq!(a.len(), m * m, "mask must be n×n");
            }
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
        let act = self.act_sparsity.as_ref();
        act_input(act, il, Site::Qkv, &mut ws.h[..n * d], n, &mut ws.act_record, &mut ws.act_counts);
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
        let swa = c.layer_is_swa.get(il).copied().unwrap_or(false);
        let window = if swa { c.sliding_window } else { None };
        let n_threads = ws.pool.n_threads();
        let mut row0 = 0;
        for s in seqs.iter_mut() {
            self.append_kv(il, s.positions, row0, s.kv, ws);
            row0 += s.positions.len();
        }
        // Attention: tasks of a row and one or more heads of a KV group, split over the pool by KV head, every
        // sequence's in one parallel region. Per thread: every position's score and slot (see
        // `Attention::run_split`).
        let longest = seqs.iter().map(|s| s.kv.len(il)).max().unwrap_or(0);
        grow(&mut ws.scores, n_threads.min(MAX_SHARES) * SCRATCH_PER_SLOT * longest);
        let mut jobs = Vec::with_capacity(seqs.len());
        let mut row0 = 0;
        for s in seqs.iter() {
            let m = s.positions.len();
            let total = s.kv.len(il);
            let lc = s.kv.layer(il);
            let (ks, vs) = s.kv.strides();
            jobs.push(Attention {
                q: &ws.q[row0 * qd..(row0 + m) * qd],
                kc: &lc.k[..],
                vc: &lc.v[..],
                ks,
                vs,
                pc: &lc.pos[..],
                positions: s.positions,
                mask: s.mask,
                window,
                base: total - m,
                total,
                n: m,
                qd,
                hd,
                hdv,
                att_d,
                n_head: c.n_head,
                group: c.n_head / c.n_head_kv,
                scale: c.attn_scale,
                // SAFETY of the offset: `ws.att` holds `n × att_d` floats and these rows are within it.
                att: SharedMut(ws.att[row0 * att_d..].as_mut_ptr()),
            });
            row0 += m;
        }
        Attention::run_many(&jobs, &ws.pool, &mut ws.scores);

        act_input(act, il, Site::O, &mut ws.att[..n * att_d], n, &mut ws.act_record, &mut ws.act_counts);
        let pool = &ws.pool;
        matmul(pool, &self.qmatrix(&lw.wo), &ws.att[..n * att_d], n, &mut ws.o[..n * d], &mut ws.mm);
        self.residual(x, &mut ws.o[..n * d], lw.post_attn_norm.as_deref(), n);

        // Feed-forward block.
        for r in 0..n {
            rms_norm(&x[r * d..(r + 1) * d], &lw.ffn_norm, c.rms_eps, &mut ws.h[r * d..(r + 1) * d]);
        }
        act_input(act, il, Site::GateUp, &mut ws.h[..n * d], n, &mut ws.act_record, &mut ws.act_counts);
        let pool = &ws.pool;
        let ff = c.n_ff;
        let (wg, wu) = (self.qmatrix(&lw.w_gate), self.qmatrix(&lw.w_up));
        // The gated activation runs inside the gate/up product's parallel region, on each thread's own rows (with
        // libm's expf/tanhf it was 9% of a Gemma 8-row forward in callgrind; now vectorised, see `glu_in_place`).
        let activation = c.activation;
        matmul_pair_then(
            pool,
            &wg,
            &wu,
            &ws.h[..n * d],
            n,
            &mut ws.gate[..n * ff],
            &mut ws.up[..n * ff],
            &mut ws.mm,
            &|g, u| glu_in_place(activation, g, u),
        );
        act_input(act, il, Site::Down, &mut ws.gate[..n * ff], n, &mut ws.act_record, &mut ws.act_counts);
        let pool = &ws.pool;
        matmul(pool, &self.qmatrix(&lw.w_down), &ws.gate[..n * ff], n, &mut ws.o[..n * d], &mut ws.mm);
        self.residual(x, &mut ws.o[..n * d], lw.post_ffn_norm.as_deref(), n);
        Ok(())
    }

    /// Biases, QK norms and RoPE of the `n` freshly projected rows in `ws.q` (if `with_q`), `ws.k` and `ws.v`,
    /// then the rounding to f16 of everything the attention reads.
    ///
    /// K and V are cached in f16 and queries rounded to f16, as llama.cpp's CPU flash attention (on by default)
    /// reads them; the attention itself ([`crate::attention`]) accumulates in f32, and every row's result depends
    /// only on the positions it sees, whatever the batch, so a speculative step reproduces dense decoding bit for
    /// bit.
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
        for v in [&mut ws.q[..q_rows * qd], &mut ws.k[..n * kvd], &mut ws.v[..n * vd]] {
            round_to_f16(v);
        }
    }

    /// Appends the `n = positions.len()` rows of `ws.k` / `ws.v` from row `row0` on to layer `il` of the cache.
    fn append_kv(&self, il: usize, positions: &[u32], row0: usize, kv: &mut KvCache, ws: &Workspace) {
        let c = &self.config;
        let (kvd, vd, n) = (c.kv_dim(), c.n_head_kv * c.head_dim_v, positions.len());
        // Exact: `finish_qkv` rounded them to f16 (per element, `f16::from_f32` was ~1% of a forward on the main
        // thread, with that rounding; the cache converts slices, with F16C where the CPU has it).
        kv.append(il, &ws.k[row0 * kvd..(row0 + n) * kvd], &ws.v[row0 * vd..(row0 + n) * vd], positions);
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
        // The same zeroed input as the full layer's Q/K/V product (not recorded: it is not a new activation).
        if let Some(t) = &self.act_sparsity {
            sparsify(&mut ws.h[..n * d], t.get(il, Site::Qkv));
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
        self.append_kv(il, positions, 0, kv, ws);
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

    /// Full-vocabulary logits of `n` normed rows into `logits` (`n × vocab`), multiplied by the head interleaved
    /// by 8 rows where that pays ([`Model::head_x8`]; the same numbers up to float summation order), else by the
    /// head as stored.
    pub fn head_full(&self, normed: &[f32], n: usize, logits: &mut [f32], ws: &mut Workspace) {
        let x8 = self.head_x8(n);
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

    /// The head interleaved by 8 rows ([`kernels::repack::interleave8`]) for full-logit products: with AVX-512
    /// VNNI a Q8_0 head interleaved multiplies 2 rows in the time of one and 8 rows in ~1.5–2.6× (vs ~1.4× and
    /// ~3–3.9× as stored; `kbench`), at the cost of a second copy (32 bytes more per 8 rows and block than the
    /// file: +34 MB for SmolLM2, +199 MB for Gemma 3 270M). Single rows use it too since session 22 (sampled
    /// decoding: a one-row forward with full logits, `kprof MODEL 1 2`, 5% faster on SmolLM2 and 4–6% on Gemma);
    /// greedy single rows go through the screen ([`Model::head_argmax`]), embeddings and the screen's exact rows
    /// read the stored head. `SPECEE_HEAD_X8=0` turns it off.
    ///
    /// Built once [`X8_AFTER_ROWS`] rows went through full-logit head products (`rows` is this call's), so a short
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
        // Up to `SCREEN_MAX_ROWS` rows (or where forced) the screen, else the interleaved full product; each where
        // built, the other (or the stored head) when not.
        let v = self.config.vocab_size;
        let prefer_screen = n <= SCREEN_MAX_ROWS || self.screen_forced.load(std::sync::atomic::Ordering::Relaxed);
        let x8_first = if prefer_screen { None } else { self.head_x8(n) };
        if x8_first.is_none() {
            if let Some(screen) = self.screen(ws.n_threads()) {
                let head = self.qmatrix(&self.weights.output);
                return screen.argmax(&ws.pool, &head, &normed[..n * d], n, &mut out[..n], &mut ws.mm);
            }
        }
        let x8 = x8_first.or_else(|| if n >= 2 && prefer_screen { self.head_x8(n) } else { None });
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
    /// least [`SCREEN_MIN_BYTES`].
    fn screen_wanted(&self, setting: Option<bool>) -> bool {
        let head = self.qmatrix(&self.weights.output);
        setting.unwrap_or(head.ty == gguf::GgmlType::Q8_0 && head.data.len() >= SCREEN_MIN_BYTES)
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

    /// Runs the new `tokens[i]` of several independent sequences through every layer at once, sequence `i` at
    /// positions `kvs[i].seq_len()..` of its own cache, causally (see [`Model::layer_batch`]). `hidden` receives
    /// the final (un-normed) hidden rows of all sequences in order. Each row comes out as a one-sequence
    /// [`Model::forward`] would compute it; several short sequences cost little more than one, as every weight
    /// is read once per layer for all of their rows.
    pub fn forward_batch(
        &self,
        tokens: &[&[u32]],
        kvs: &mut [&mut KvCache],
        ws: &mut Workspace,
        hidden: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        assert_eq!(tokens.len(), kvs.len(), "one cache per sequence");
        let positions: Vec<Vec<u32>> = tokens
            .iter()
            .zip(kvs.iter())
            .map(|(t, kv)| (kv.seq_len() as u32..(kv.seq_len() + t.len()) as u32).collect())
            .collect();
        let rows: Vec<Rows<'_>> = tokens
            .iter()
            .zip(&positions)
            .map(|(&tokens, positions)| Rows { tokens, positions, mask: Mask::Causal })
            .collect();
        self.forward_rows(&rows, kvs, ws, hidden)
    }

    /// [`Model::forward_batch`] with each sequence's positions and mask given: e.g. the draft trees of several
    /// requests verified in one forward ([`Mask::Allowed`] with a tree's ancestor mask, node positions root +
    /// depth). Sequence `i`'s rows take the slots after its cache's current end, in order. Each row comes out as
    /// a one-sequence forward of the same rows would compute it.
    pub fn forward_rows(
        &self,
        seqs: &[Rows<'_>],
        kvs: &mut [&mut KvCache],
        ws: &mut Workspace,
        hidden: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        assert_eq!(seqs.len(), kvs.len(), "one cache per sequence");
        let d = self.config.n_embd;
        for (s, kv) in seqs.iter().zip(kvs.iter()) {
            assert_eq!(s.tokens.len(), s.positions.len(), "one position per row");
            if let Mask::Allowed(a) = s.mask {
                assert_eq!(a.len(), s.tokens.len() * s.tokens.len(), "one mask entry per pair of rows");
            }
            let needed = kv.seq_len() + s.tokens.len();
            if needed > kv.capacity() {
                return Err(ModelError::ContextFull { needed, capacity: kv.capacity() });
            }
        }
        let all: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        hidden.resize(all.len() * d, 0.0);
        if all.is_empty() {
            return Ok(());
        }
        self.embed(&all, hidden)?;
        for il in 0..self.config.n_layers {
            let mut batch: Vec<Sequence<'_, '_>> = seqs
                .iter()
                .zip(kvs.iter_mut())
                .filter(|(s, _)| !s.tokens.is_empty())
                .map(|(s, kv)| Sequence { positions: s.positions, mask: s.mask, kv })
                .collect();
            self.layer_batch(il, hidden, &mut batch, ws)?;
        }
        Ok(())
    }
}

/// The input `x` of `site`'s products in layer `il`: recorded (before zeroing) while a recording is on, then
/// zeroed below the layer's threshold (or its smallest blocks, [`ActThresholds::blocks`]) where activation
/// sparsity is set, the zeroed entries counted ([`ActCounts::add`]).
#[inline]
fn act_input(
    act: Option<&ActThresholds>,
    il: usize,
    site: Site,
    x: &mut [f32],
    rows: usize,
    record: &mut Option<Box<ActHistograms>>,
    counts: &mut ActCounts,
) {
    if let Some(h) = record {
        h.record(il, site, x, rows);
    }
    if let Some(t) = act {
        let zeroed = match &t.blocks {
            Some(b) => {
                let order = b.order.as_ref().and_then(|o| o.get(il)).map(|o| o[site as usize].as_slice());
                sparsify_blocks(x, rows, b.size, b.share[site as usize], order)
            }
            None => sparsify(x, t.get(il, site)),
        };
        counts.add(site, x, rows, zeroed);
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

#[cfg(test)]
mod f16_tests {
    /// The slice rounding (F16C where present) gives every value `f16::from_f32` gives one at a time: ties to
    /// even, subnormals, overflow to infinity, signed zeros, NaN; and lengths across the chunk size.
    #[test]
    fn slice_rounding_equals_per_value_rounding() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut values: Vec<f32> = (0..1000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f32::from_bits(state as u32)
            })
            .collect();
        // Exact ties between two f16 values (1 + 2^-11, 1 + 3·2^-11), the smallest subnormal's half, limits.
        values.extend([1.000_488_3, 1.001_464_8, 2.980_232_2e-8, 65_520.0, 65_519.0, -0.0, 0.0, f32::INFINITY]);
        values.extend((0..300).map(|i| (i as f32 - 150.0) * 0.013_7));
        for len in [0, 1, 255, 256, 257, values.len()] {
            let mut got = values[..len].to_vec();
            super::round_to_f16(&mut got);
            for (g, v) in got.iter().zip(&values[..len]) {
                let want = half::f16::from_f32(*v).to_f32();
                assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{v:e}: {g:e} vs {want:e}");
            }
        }
    }
}
