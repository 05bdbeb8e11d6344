//! Continuous batching (`specee serve --parallel N`, N ≥ 2): one thread owns the model and every compute thread,
//! and each forward takes the next rows of every active request — one decode row per generating request, and
//! chunks of prompts being prefilled — through [`model::Model::forward_batch`], which reads each weight once for
//! all rows. Requests join and leave between forwards; each keeps its own sampler, stop rules and KV cache, and
//! rows never see another request's cache. Because every row's result is batch-invariant (the products and the
//! per-row attention give a row the same bits whatever else is in the batch, and chunked prefill the same bits as
//! one prefill), a greedy request's tokens are exactly those of `specee generate --mode dense`, whatever else runs.
//!
//! Memory: the KV caches come from one token budget (`--kv-budget`, default `--ctx-size × --parallel`). A
//! request reserves `min(prompt + max_tokens, ctx)` tokens when admitted and returns them when it ends;
//! requests wait, in arrival order, until their reservation fits. Finished requests leave their cache to the
//! [`PrefixCache`] (bounded, `--prefix-cache` tokens), from which a later prompt sharing a prefix — the same
//! system prompt, the earlier turns of a chat — copies that prefix instead of computing it again.
//!
//! Speculation: a greedy `eagle` request (no grammar, no log probabilities) goes on with the draft head's trees once
//! its prompt is in ([`SpeculativeDecoder::resume`] takes over its cache and the final-normed state of its last
//! row, all an MLP head reads). Every forward verifies the trees of all such requests beside the other requests'
//! rows, each tree with its own ancestor mask over its own cache ([`model::Model::forward_rows`]), and the greedy
//! tokens of every row come from one head call. Alone, a request drafts its whole tree; with company the trees
//! share a row budget ([`BatchConfig::tree_rows`]: each gets `tree_rows / decoding requests` rows, 1 = its root
//! only, a dense step), because past a few rows a forward's cost grows with its rows. Lossless either way: the
//! tokens are dense greedy's; the answer says `eagle` when any draft was verified, with the forwards it took. Other
//! speculative requests are decoded as dense rows (the answer says `dense`).

use crate::holdback::Holdback;
use crate::metrics::Observe;
use crate::mode::{DecodeStats, Mode};
use crate::request::GenerationRequest;
use crate::scheduler::{panic_error, stream_piece, Event, Job, Shared};
use decode::speculative::{DraftHead, FeatureSource, SpeculativeDecoder, TreeConfig};
use decode::Sampler;
use decode::TokenConstraint;
use engine::speculative::AnyProposer;
use engine::{Emitter, FinishReason, GenerateParams};
use model::{KvCache, Workspace};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Prefix-cache granularity: a reused prefix is a whole number of blocks of this many tokens.
pub const PREFIX_BLOCK: usize = 16;

/// Settings of the batching scheduler.
#[derive(Clone, Debug)]
pub struct BatchConfig {
    /// Requests generated at once.
    pub parallel: usize,
    /// Compute threads of the shared forward.
    pub threads: usize,
    /// Tokens of KV cache all admitted requests may reserve together (at least the context size).
    pub kv_budget: usize,
    /// Tokens the prefix cache may hold (0: no prefix cache).
    pub prefix_cache: usize,
    /// Most prompt rows one forward prefills (decode rows always go; chunks of prompts fill up to this).
    pub prefill_rows: usize,
    /// Rows the draft trees of several decoding requests share in one forward (a lone request drafts its whole
    /// tree); 0 or 1: no drafts beside other requests.
    pub tree_rows: usize,
}

/// Finished requests' caches, kept for the prompts that start like them. Entries are whole token sequences
/// with their caches; a lookup finds the longest shared prefix (whole [`PREFIX_BLOCK`]s, leaving at least one
/// prompt token to compute); entries superseded by a longer one are dropped; the least recently used go first
/// when the held tokens pass the bound.
pub struct PrefixCache {
    entries: Vec<PrefixEntry>,
    limit: usize,
    held: usize,
    clock: u64,
}

struct PrefixEntry {
    tokens: Vec<u32>,
    kv: KvCache,
    used: u64,
}

impl PrefixCache {
    /// A cache holding at most `limit` tokens (0: holds nothing).
    pub fn new(limit: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), limit, held: 0, clock: 0 }
    }

    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.held
    }

    /// The longest reusable prefix of `prompt`: its length (a multiple of [`PREFIX_BLOCK`], below the prompt's
    /// length) and the cache holding it; `None` when no entry shares a whole block.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, &KvCache)> {
        let usable = |tokens: &[u32]| {
            let shared = tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            shared.min(prompt.len().saturating_sub(1)) / PREFIX_BLOCK * PREFIX_BLOCK
        };
        let (best, len) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, usable(&e.tokens)))
            .max_by_key(|&(i, len)| (len, self.entries[i].used))?;
        if len == 0 {
            return None;
        }
        self.clock += 1;
        let entry = &mut self.entries[best];
        entry.used = self.clock;
        Some((len, &entry.kv))
    }

    /// Offers a finished request's cache, which holds `tokens` (every layer). Kept unless it is shorter than a
    /// block, larger than the whole cache, or a prefix of an entry already held.
    pub fn insert(&mut self, tokens: Vec<u32>, kv: KvCache) {
        debug_assert_eq!(kv.seq_len(), tokens.len());
        if tokens.len() < PREFIX_BLOCK || tokens.len() > self.limit {
            return;
        }
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens.starts_with(&tokens)) {
            e.used = self.clock;
            return;
        }
        // Entries this one extends are no longer needed.
        self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        self.entries.push(PrefixEntry { tokens, kv, used: self.clock });
        self.held = self.entries.iter().map(|e| e.tokens.len()).sum();
        while self.held > self.limit {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used).expect("held > 0");
            self.held -= self.entries.swap_remove(oldest).tokens.len();
        }
    }
}

/// The batching scheduler's thread.
pub(crate) struct Batcher {
    shared: Arc<Shared>,
    config: BatchConfig,
    /// The draft head lone eagle requests continue with (`None`: not loaded, or a fused head, whose features the
    /// batched forward does not keep).
    draft: Option<Arc<DraftHead>>,
    datastore: Option<Arc<decode::speculative::Datastore>>,
    /// The tree the head drafts with, which answers that drafted name ([`crate::mode::ModeResources::eagle_tree`]).
    tree: Option<TreeConfig>,
}

/// A request's speculative decoder; it holds the request's cache (and a one-thread workspace it does not use: the
/// batcher's forwards verify its trees).
type Tree<'e> = Box<SpeculativeDecoder<'e, AnyProposer>>;

/// A request waiting for admission.
struct Waiting {
    job: Job,
    prompt: Vec<u32>,
    params: GenerateParams,
    /// KV tokens it will reserve.
    reserve: usize,
}

/// A request being prefilled or decoded.
struct Active<'e> {
    request: GenerationRequest,
    events: UnboundedSender<Event>,
    admitted_at: Instant,
    params: GenerateParams,
    /// Prompt, then generated tokens.
    history: Vec<u32>,
    prompt_len: usize,
    /// Tokens in `kv` (prompt tokens prefilled so far, then every generated token but the last).
    kv: KvCache,
    /// The token to feed next once the prompt is in (the last one generated).
    next: Option<u32>,
    sampler: Sampler,
    /// The grammar its tokens follow (`response_format`), if any: its rows get full logits, masked.
    constraint: Option<engine::constraint::Constraint>,
    emitter: Emitter<'e>,
    holdback: Holdback,
    reserve: usize,
    started: Instant,
    decode_start: Option<Instant>,
    last_token: Option<Instant>,
    /// It ended (see `emitter.finish`) and leaves after this forward.
    done: bool,
    /// Its error was answered already.
    failed: bool,
    /// Goes on with draft trees once its prompt is in: greedy `eagle`, no grammar, no log probabilities.
    speculable: bool,
    /// The final-normed state of the row that produced `next` (kept for speculable requests only).
    root_feature: Vec<f32>,
    /// Once it drafts trees: the decoder, holding its cache (`kv` is then an empty stand-in).
    tree: Option<Tree<'e>>,
    /// Target forwards that gave it tokens (dense rows and tree steps alike), and the draft nodes verified.
    forwards: u64,
    drafted: u64,
}

impl<'e> Active<'e> {
    /// Whether its cache is full once a token was taken: every token of the history but the last is (or, inside a
    /// tree step, would be) in it.
    fn cache_full(&self) -> bool {
        let capacity = self.tree.as_ref().map_or(self.kv.capacity(), |t| t.capacity());
        self.history.len() > capacity
    }

    /// Rows this request feeds in the next forward as dense rows (at most `budget` prompt rows; none while it
    /// drafts trees).
    fn rows(&self, budget: usize) -> &[u32] {
        if self.tree.is_some() {
            return &[];
        }
        match self.next {
            Some(_) => &self.history[self.history.len() - 1..],
            None => {
                let fed = self.kv.seq_len();
                &self.history[fed..self.prompt_len.min(fed + budget)]
            }
        }
    }
}

impl Batcher {
    pub(crate) fn new(shared: Arc<Shared>, config: BatchConfig, resources: &crate::mode::ModeResources) -> Batcher {
        shared.metrics.kv_budget.store(config.kv_budget, Ordering::Relaxed);
        // `SPECEE_BATCH_TREES=0` keeps lone requests on dense rows too (to measure what the trees bring).
        let trees = !std::env::var("SPECEE_BATCH_TREES").is_ok_and(|v| v == "0");
        let draft = resources.draft.clone().filter(|h| trees && h.feature_source() == FeatureSource::FinalNorm);
        Batcher { shared, config, draft, datastore: resources.datastore.clone(), tree: resources.eagle_tree() }
    }

    /// Runs until the job channel closes and every admitted request is answered.
    pub(crate) fn run(self, receiver: &Mutex<mpsc::Receiver<Job>>) {
        let rx = receiver.lock().unwrap_or_else(|p| p.into_inner());
        let shared = &*self.shared;
        let engine = &*shared.engine;
        let model = &engine.model;
        let metrics = &shared.metrics;
        let mut ws = Workspace::new(self.config.threads.max(1));
        // A server makes thousands of head calls: build the greedy head screen and the interleaved head now rather
        // than part-way through (their memory then belongs to the start-up, not to some later request).
        model.warm_head_screen(self.config.threads.max(1));
        let mut hidden = Vec::new();
        let mut normed = Vec::new();
        let mut logits = Vec::new();
        let mut prefix = PrefixCache::new(self.config.prefix_cache);
        let mut waiting: VecDeque<Waiting> = VecDeque::new();
        let mut active: Vec<Active<'_>> = Vec::new();
        let mut reserved = 0usize;
        let mut open = true;
        loop {
            // Intake: block only when there is nothing else to do.
            if active.is_empty() && waiting.is_empty() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(job) => self.enqueue(job, &mut waiting),
                    Err(_) => return,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(job) => self.enqueue(job, &mut waiting),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            // Clients that left while waiting.
            waiting.retain(|w| {
                let gone = w.job.events.is_closed();
                if gone {
                    self.release_queued(&w.job);
                }
                !gone
            });
            // Admission, in arrival order, while a slot and the reservation are free.
            while active.len() < self.config.parallel {
                let Some(w) = waiting.front() else { break };
                if reserved + w.reserve > self.config.kv_budget {
                    break;
                }
                let w = waiting.pop_front().expect("front exists");
                metrics.queued.fetch_sub(1, Ordering::AcqRel);
                metrics.in_flight.fetch_add(1, Ordering::AcqRel);
                metrics.observe(Observe::QueueWait, w.job.admitted_at.elapsed().as_secs_f64());
                if w.job.events.send(Event::Started { prompt_tokens: w.prompt.len() }).is_err() {
                    shared.record_cancelled(Mode::Dense);
                    self.release(0, &mut reserved);
                    continue;
                }
                let capacity = w.reserve;
                let kv = match self.config.prefix_cache {
                    0 => model.new_cache(capacity),
                    _ => match prefix.lookup(&w.prompt) {
                        Some((len, cached)) => {
                            metrics.record_prefix_lookup(len);
                            cached.prefix_copy(len, capacity)
                        }
                        None => {
                            metrics.record_prefix_lookup(0);
                            model.new_cache(capacity)
                        }
                    },
                };
                reserved += w.reserve;
                metrics.kv_reserved.store(reserved, Ordering::Relaxed);
                let Waiting { job, prompt, params, reserve } = w;
                let prompt_len = prompt.len();
                let speculable = self.draft.is_some()
                    && job.request.mode == Mode::Eagle
                    && params.sampling.is_greedy()
                    && params.grammar.is_none()
                    && params.logprobs.is_none();
                // Compiled once already when the request was checked (a bad grammar never gets here).
                let constraint = match params.grammar.as_ref().map(|g| engine.constraint(g)).transpose() {
                    Ok(c) => c,
                    Err(e) => {
                        shared.fail(&job.request, &job.events, e.into());
                        self.release(0, &mut reserved);
                        continue;
                    }
                };
                active.push(Active {
                    constraint,
                    emitter: Emitter::new(engine, &params, prompt_len),
                    sampler: Sampler::new(params.sampling.clone()),
                    holdback: Holdback::for_request(&job.request),
                    request: job.request,
                    events: job.events,
                    admitted_at: job.admitted_at,
                    params,
                    history: prompt,
                    prompt_len,
                    kv,
                    next: None,
                    reserve,
                    started: Instant::now(),
                    decode_start: None,
                    last_token: None,
                    done: false,
                    failed: false,
                    speculable,
                    root_feature: Vec::new(),
                    tree: None,
                    forwards: 0,
                    drafted: 0,
                });
            }
            if active.is_empty() {
                continue;
            }

            // A speculable request whose prompt is in goes on with draft trees.
            for a in active.iter_mut() {
                if a.tree.is_none() && a.speculable && a.next.is_some() && !a.done {
                    self.start_tree(engine, a);
                }
            }

            // One forward: the next rows of every request, draft trees included.
            let alone = active.len() == 1 && waiting.is_empty();
            let started = Instant::now();
            let step = catch_unwind(AssertUnwindSafe(|| {
                self.step(&mut active, alone, &mut ws, &mut hidden, &mut normed, &mut logits)
            }));
            metrics.observe(Observe::BatchStep, started.elapsed().as_secs_f64());
            if let Err(error) = step.map_err(panic_error).and_then(|r| r) {
                // The forward failed: every request in it is answered with the error.
                for a in active.iter_mut() {
                    shared.fail(&a.request, &a.events, error.clone());
                    a.done = true;
                    a.failed = true;
                }
            }

            // Requests that ended leave: answer, free the reservation, offer the cache to the prefix cache.
            let mut i = 0;
            while i < active.len() {
                if !active[i].done {
                    i += 1;
                    continue;
                }
                let mut a = active.swap_remove(i);
                self.stop_tree(&mut a);
                self.finish(a, &mut prefix, &mut reserved);
            }
        }
    }

    /// Checks and tokenizes a new job, answering it at once when it cannot run; queues it otherwise.
    fn enqueue(&self, job: Job, waiting: &mut VecDeque<Waiting>) {
        let shared = &*self.shared;
        match catch_unwind(AssertUnwindSafe(|| shared.prepare(&job.request))).map_err(panic_error).and_then(|r| r) {
            Ok((prompt, params)) => {
                let reserve = (prompt.len() + params.max_tokens).min(shared.ctx);
                waiting.push_back(Waiting { job, prompt, params, reserve });
            }
            Err(error) => {
                shared.fail(&job.request, &job.events, error);
                self.release_queued(&job);
            }
        }
    }

    /// Forgets a job that never became active.
    fn release_queued(&self, job: &Job) {
        let metrics = &self.shared.metrics;
        if job.events.is_closed() {
            self.shared.record_cancelled(Mode::Dense);
        }
        metrics.queued.fetch_sub(1, Ordering::AcqRel);
        self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
    }

    /// Frees an active request's slot and `tokens` of reservation.
    fn release(&self, tokens: usize, reserved: &mut usize) {
        let metrics = &self.shared.metrics;
        *reserved -= tokens;
        metrics.kv_reserved.store(*reserved, Ordering::Relaxed);
        // Free the slot before the gauge says so, so that a client seeing 0 in flight can be admitted.
        self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
        metrics.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// One batched forward: feeds every request its rows — chunks of its prompt, one dense row, or its draft
    /// tree — then hands each request whose prompt is in its next token(s).
    fn step(
        &self,
        active: &mut [Active<'_>],
        alone: bool,
        ws: &mut Workspace,
        hidden: &mut Vec<f32>,
        normed: &mut Vec<f32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), crate::ApiError> {
        let model = &self.shared.engine.model;
        let metrics = &self.shared.metrics;
        let d = model.config.n_embd;
        let vocab = model.config.vocab_size;
        // Clients that left stop here.
        for a in active.iter_mut().filter(|a| a.events.is_closed()) {
            a.emitter.finish = FinishReason::Cancelled;
            a.done = true;
        }
        // Draft trees: alone, a request drafts its whole tree; with company the trees share the row budget.
        let decoding = active.iter().filter(|a| !a.done && a.next.is_some()).count();
        let cap = if alone { usize::MAX } else { (self.config.tree_rows / decoding.max(1)).max(1) };
        for a in active.iter_mut().filter(|a| !a.done) {
            let Some(dec) = a.tree.as_mut() else { continue };
            let at_most = a.params.max_tokens.saturating_sub(a.emitter.generated.len()).max(1);
            if let Err(e) = dec.draft_rows(ws.pool(), at_most, cap) {
                self.shared.fail(&a.request, &a.events, engine::speculative::speculative_error(e).into());
                (a.done, a.failed) = (true, true);
            }
        }
        // Dense rows: decode rows first, then prompt chunks while the prefill budget lasts.
        let mut budget = self.config.prefill_rows.max(1);
        let mut feeds: Vec<Vec<u32>> = Vec::with_capacity(active.len());
        let mut positions: Vec<Vec<u32>> = Vec::with_capacity(active.len());
        for a in active.iter() {
            let rows = if a.done || (a.next.is_none() && budget == 0) { &[][..] } else { a.rows(budget) };
            if a.next.is_none() {
                budget -= rows.len();
            }
            let start = a.kv.seq_len() as u32;
            positions.push((start..start + rows.len() as u32).collect());
            feeds.push(rows.to_vec());
        }
        // The requests with rows in this forward, their rows and their caches.
        let mut in_step: Vec<usize> = Vec::with_capacity(active.len());
        let mut seqs: Vec<model::Rows<'_>> = Vec::with_capacity(active.len());
        let mut kvs: Vec<&mut KvCache> = Vec::with_capacity(active.len());
        for (i, a) in active.iter_mut().enumerate() {
            if let Some(dec) = a.tree.as_mut() {
                if let Some((rows, kv)) = dec.pending_rows() {
                    in_step.push(i);
                    let mask = model::Mask::Allowed(&rows.mask);
                    seqs.push(model::Rows { tokens: &rows.tokens, positions: &rows.positions, mask });
                    kvs.push(kv);
                }
            } else if !feeds[i].is_empty() {
                in_step.push(i);
                seqs.push(model::Rows { tokens: &feeds[i], positions: &positions[i], mask: model::Mask::Causal });
                kvs.push(&mut a.kv);
            }
        }
        if in_step.is_empty() {
            return Ok(());
        }
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        metrics.observe(Observe::BatchRows, lens.iter().sum::<usize>() as f64);
        metrics.observe(Observe::BatchSequences, in_step.len() as f64);
        model.forward_rows(&seqs, &mut kvs, ws, hidden).map_err(engine::EngineError::from)?;
        drop((seqs, kvs)); // The caches and trees are reached through `active` again below.

        // Rows that now give tokens: every row of a tree, and the last row of each other request whose prompt is
        // complete. Unconstrained greedy rows without log probabilities make do with the head's argmax.
        let mut row_end = 0;
        let mut greedy: Vec<(usize, std::ops::Range<usize>)> = Vec::new();
        let mut sampled: Vec<(usize, usize)> = Vec::new();
        for (&i, &n) in in_step.iter().zip(&lens) {
            row_end += n;
            let a = &active[i];
            if a.tree.is_some() {
                greedy.push((i, row_end - n..row_end));
            } else if a.kv.seq_len() < a.prompt_len {
                continue;
            } else if a.params.sampling.is_greedy() && a.constraint.is_none() && a.params.logprobs.is_none() {
                greedy.push((i, row_end - 1..row_end));
            } else {
                sampled.push((i, row_end - 1));
            }
        }
        // Each request's tokens of this forward, in order.
        let mut next: Vec<(usize, Vec<u32>, Option<engine::TokenLogprobs>)> =
            Vec::with_capacity(greedy.len() + sampled.len());
        if !greedy.is_empty() {
            let n: usize = greedy.iter().map(|(_, r)| r.len()).sum();
            normed.resize(n * d, 0.0);
            let mut r = 0;
            for (_, rows) in &greedy {
                let dst = &mut normed[r * d..(r + rows.len()) * d];
                model.final_norm(&hidden[rows.start * d..rows.end * d], dst);
                r += rows.len();
            }
            let mut out = vec![0u32; n];
            model.head_argmax(normed, n, &mut out, ws);
            let mut r = 0;
            for (i, rows) in &greedy {
                let (i, k) = (*i, rows.len());
                let (choices, states) = (&out[r..r + k], &normed[r * d..(r + k) * d]);
                r += k;
                let a = &mut active[i];
                match a.tree.as_mut() {
                    Some(dec) => match dec.commit_rows(choices, states) {
                        Ok(tokens) => next.push((i, tokens.to_vec(), None)),
                        Err(e) => {
                            self.shared.fail(&a.request, &a.events, engine::speculative::speculative_error(e).into());
                            (a.done, a.failed) = (true, true);
                        }
                    },
                    None => {
                        // The draft head's input once the request drafts trees.
                        if a.speculable {
                            a.root_feature.clear();
                            a.root_feature.extend_from_slice(states);
                        }
                        next.push((i, choices.to_vec(), None));
                    }
                }
            }
        }
        if !sampled.is_empty() {
            let n = sampled.len();
            normed.resize(n * d, 0.0);
            for (r, &(_, row)) in sampled.iter().enumerate() {
                model.final_norm(&hidden[row * d..(row + 1) * d], &mut normed[r * d..(r + 1) * d]);
            }
            logits.resize(n * vocab, 0.0);
            model.head_full(normed, n, logits, ws);
            for (r, &(i, _)) in sampled.iter().enumerate() {
                let a = &mut active[i];
                let row = &mut logits[r * vocab..(r + 1) * vocab];
                // Log probabilities are the raw logits' (a grammar masks the row in place).
                let raw = a.params.logprobs.map(|k| (k, row.to_vec()));
                let t = match a.constraint.as_mut() {
                    None => a.sampler.sample(row, &a.history),
                    Some(c) if a.params.sampling.is_greedy() => match decode::constraint::masked_argmax(c, row) {
                        Ok(t) => t,
                        Err(e) => {
                            self.fail_grammar(a, e);
                            continue;
                        }
                    },
                    Some(c) => match c.mask(row) {
                        Ok(()) => a.sampler.sample(row, &a.history),
                        Err(e) => {
                            self.fail_grammar(a, e);
                            continue;
                        }
                    },
                };
                next.push((i, vec![t], raw.map(|(k, raw)| engine::logprobs::token_logprobs(&raw, t, k))));
            }
        }
        let now = Instant::now();
        for (i, tokens, mut entry) in next {
            let a = &mut active[i];
            a.forwards += 1;
            for token in tokens {
                self.take(a, token, entry.take(), now);
                if a.done {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Hands a speculable request's cache to a draft-tree decoder (see the module header).
    fn start_tree<'e>(&self, engine: &'e engine::Engine, a: &mut Active<'e>) {
        let d = engine.model.config.n_embd;
        let Some(head) = self.draft.as_ref() else { return };
        // The decoder's contract: every committed token but the last cached, and that token's parent's feature.
        if a.root_feature.len() != d || a.kv.seq_len() + 1 != a.history.len() {
            return;
        }
        let proposer = AnyProposer::eagle(Arc::clone(head), None, self.datastore.clone());
        let kv = std::mem::replace(&mut a.kv, engine.model.new_cache(0));
        let (sampling, tokens) = (a.params.sampling.clone(), a.history.clone());
        let ws = Workspace::new(1);
        match SpeculativeDecoder::resume(&engine.model, kv, ws, proposer, sampling, tokens, &a.root_feature) {
            Ok(dec) => a.tree = Some(Box::new(dec)),
            Err(e) => {
                // Checked above, so not expected.
                self.shared.fail(&a.request, &a.events, crate::ApiError::internal(format!("draft trees: {e}")));
                (a.done, a.failed) = (true, true);
            }
        }
    }

    /// Takes a finished request's cache back from its draft-tree decoder, if any. The cache keeps only tokens of
    /// its history (a stop rule may have ended it inside a step).
    fn stop_tree(&self, a: &mut Active<'_>) {
        let Some(dec) = a.tree.take() else { return };
        a.drafted += dec.stats().drafted_nodes as u64;
        let (mut kv, _) = dec.into_parts();
        kv.truncate(kv.seq_len().min(a.history.len().saturating_sub(1)));
        a.kv = kv;
    }

    /// Hands a request its next token: stop rules, streaming, timing; decides whether it goes on.
    fn take(&self, a: &mut Active<'_>, token: u32, entry: Option<engine::TokenLogprobs>, now: Instant) {
        let metrics = &self.shared.metrics;
        match a.last_token {
            None => {
                metrics.observe(Observe::FirstToken, now.duration_since(a.admitted_at).as_secs_f64());
                a.emitter.timings.prompt_seconds = now.duration_since(a.started).as_secs_f64();
                a.decode_start = Some(now);
            }
            Some(t) => metrics.observe(Observe::InterToken, now.duration_since(t).as_secs_f64()),
        }
        a.last_token = Some(now);
        let (request, events, holdback) = (&a.request, &a.events, &mut a.holdback);
        let tokenizer = &self.shared.engine.tokenizer;
        let mut on_text = |piece: &str| stream_piece(request, events, holdback, tokenizer, piece);
        let layers = self.shared.n_layers;
        if !a.emitter.push_traced(token, engine::TokenSource::Plain, layers, entry, &mut on_text) {
            a.done = true;
            return;
        }
        a.history.push(token);
        a.next = Some(token);
        if let Some(c) = a.constraint.as_mut() {
            if let Err(e) = c.commit(token) {
                self.fail_grammar(a, e);
                return;
            }
            if c.is_finished() {
                a.emitter.finish = FinishReason::Stop;
                a.done = true;
                return;
            }
        }
        if a.emitter.generated.len() >= a.params.max_tokens {
            a.done = true;
        } else if a.cache_full() {
            a.emitter.finish = FinishReason::ContextFull;
            a.done = true;
        }
    }

    /// Ends a request whose grammar failed mid-generation (llguidance's error; a 500, as it is no fault of the
    /// request, which compiled).
    fn fail_grammar(&self, a: &mut Active<'_>, e: decode::ConstraintError) {
        if !a.failed {
            self.shared.fail(&a.request, &a.events, engine::EngineError::from(e).into());
        }
        a.failed = true;
        a.done = true;
    }

    /// Answers a request that ended (unless its failure was already answered) and frees what it held.
    fn finish(&self, a: Active<'_>, prefix: &mut PrefixCache, reserved: &mut usize) {
        let shared = &*self.shared;
        let Active {
            request,
            events,
            history,
            prompt_len,
            kv,
            emitter,
            mut holdback,
            reserve,
            decode_start,
            failed,
            forwards,
            drafted,
            ..
        } = a;
        if !failed {
            let tokenizer = &shared.engine.tokenizer;
            let mut on_text = |piece: &str| stream_piece(&request, &events, &mut holdback, tokenizer, piece);
            let generation =
                emitter.finish(&history[..prompt_len], decode_start.unwrap_or_else(Instant::now), &mut on_text);
            let mut stats = DecodeStats::dense(&generation, shared.n_layers);
            let mode = if drafted > 0 { Mode::Eagle } else { Mode::Dense };
            if drafted > 0 {
                stats.steps = forwards.min(stats.tokens);
                stats.tree = self.tree;
            }
            shared.answer(&request, &events, mode, generation, stats, &holdback);
        }
        self.release(reserve, reserved);
        let fed = kv.seq_len();
        // A failed forward may have left the cache's layers uneven: never reused.
        if self.config.prefix_cache > 0 && fed >= PREFIX_BLOCK && !failed {
            prefix.insert(history[..fed].to_vec(), kv);
            shared.metrics.prefix_cache_tokens.store(prefix.tokens(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_with(tokens: &[u32]) -> KvCache {
        let m = model::testing::tiny_model("llama", None, 1, 64);
        let mut kv = m.new_cache(tokens.len() + 4);
        let mut ws = Workspace::new(1);
        m.forward(tokens, &mut kv, &mut ws, &mut Vec::new(), model::Logits::None).unwrap();
        kv
    }

    #[test]
    fn prefix_cache_reuses_whole_blocks_supersedes_and_evicts_least_recently_used() {
        let a: Vec<u32> = (0..40).map(|i| i % 60).collect();
        let mut cache = PrefixCache::new(100);
        assert!(cache.lookup(&a).is_none());
        cache.insert(a.clone(), cache_with(&a));
        assert_eq!(cache.tokens(), 40);
        // A prompt sharing 37 tokens reuses two whole blocks; one equal to the entry leaves its last token.
        let mut b = a[..37].to_vec();
        b.extend([61, 62, 63]);
        assert_eq!(cache.lookup(&b).map(|(n, kv)| (n, kv.seq_len())), Some((32, 40)));
        assert_eq!(cache.lookup(&a[..33]).map(|(n, _)| n), Some(32));
        assert_eq!(cache.lookup(&a[..32]).map(|(n, _)| n), Some(16));
        assert!(cache.lookup(&[5, 5, 5]).is_none());
        // A longer sequence extending the entry replaces it; a prefix of an entry adds nothing.
        let mut c = a.clone();
        c.extend(0..20);
        cache.insert(c.clone(), cache_with(&c));
        assert_eq!(cache.tokens(), 60);
        cache.insert(a[..20].to_vec(), cache_with(&a[..20]));
        assert_eq!(cache.tokens(), 60);
        // Too short or too large: not kept.
        cache.insert(vec![1; 8], cache_with(&[1; 8]));
        cache.insert(vec![2; 101], cache_with(&[2; 101]));
        assert_eq!(cache.tokens(), 60);
        // Past the bound the least recently used goes.
        let d: Vec<u32> = (0..30).map(|i| 63 - i).collect();
        cache.insert(d.clone(), cache_with(&d));
        assert_eq!(cache.tokens(), 90);
        assert!(cache.lookup(&c).is_some());
        let e: Vec<u32> = (0..30).map(|i| (i * 7) % 64).collect();
        cache.insert(e.clone(), cache_with(&e));
        assert_eq!(cache.tokens(), 90, "d was the least recently used");
        assert!(cache.lookup(&d).is_none());
        assert!(cache.lookup(&c).is_some() && cache.lookup(&e).is_some());
        // A zero limit holds nothing.
        let mut off = PrefixCache::new(0);
        off.insert(a.clone(), cache_with(&a));
        assert_eq!(off.tokens(), 0);
    }
}
