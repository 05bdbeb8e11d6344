//! [`SpecEeDecoder`]: autoregressive decoding that stops running layers as soon as a per-layer predictor says
//! the answer is settled (../shared/DESIGN.md §4), shaped like [`crate::DenseDecoder`]: feed a prompt, then
//! step one token at a time.
//!
//! One step for token `t` at position `p` (the previous step's output):
//! 1. the draft head reads `(feature of p − 1, t)` and proposes [`CANDIDATES`] tokens `C` for position `p + 1`
//!    (its reduced vocabulary: no full-vocabulary product);
//! 2. layers run in order; after each *active* layer ([`Scheduler`]) the 12 features of `C` feed that layer's
//!    predictor; above the threshold the token exits — [`Verify::Full`]: the full head's top-1 at that layer is
//!    emitted if it is a candidate (else we go on: a *failed verification*); [`Verify::Candidates`]: the best
//!    candidate is emitted without any full-vocabulary product. Under `Candidates` the last layer has a
//!    predictor too (beyond the published design): it decides whether the full head can be skipped, which on a
//!    small model is most of the saving (SmolLM2's head is ~30% of the bytes a token reads);
//! 3. the skipped layers' KV follow the [`KvPolicy`]; the exit layer's normed hidden state becomes the feature
//!    the draft head reads next.
//!
//! Greedy only (an early exit has no full distribution to sample from under `Verify::Candidates`). Under a grammar
//! ([`SpecEeDecoder::step_constrained`]) an exit whose token the grammar forbids is refused and the step goes on;
//! a token that reaches the last layer is the best allowed one.

use super::predictor::{features, layer_update, ExitPredictors, CANDIDATES, DRAFT_FEATURES, UPDATE_FEATURES};
use super::schedule::Scheduler;
use crate::constraint::{constrained_argmax, TokenConstraint};
use crate::sampling::argmax;
use crate::speculative::eagle::{top_k_indices, DraftScratch};
use crate::speculative::verify::Verifier;
use crate::speculative::{DraftHead, FeatureSource, SpeculativeError};
use model::{KvCache, Mask, Model, Workspace};
use std::time::{Duration, Instant};

/// What the layers an exited token skipped get in their KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPolicy {
    /// Nothing (as published): deeper layers never see an exited token.
    Missing,
    /// K/V computed from the exit hidden state for every skipped layer (CALM-style state propagation).
    Propagate,
    /// The exited token's hidden state waits; the next token that runs its skipped layers carries it through
    /// them in the same batched pass (FREE/DEED-style deferred completion), so deeper layers see exact K/V.
    /// The default: on SmolLM2 it kept teacher-forced agreement at 0.985 where `Missing` gave 0.948.
    #[default]
    Deferred,
}

impl std::str::FromStr for KvPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<KvPolicy, String> {
        match s {
            "missing" => Ok(KvPolicy::Missing),
            "propagate" => Ok(KvPolicy::Propagate),
            "deferred" => Ok(KvPolicy::Deferred),
            other => Err(format!("unknown KV policy `{other}` (missing, propagate or deferred)")),
        }
    }
}

/// How an exit decision is checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verify {
    /// As published: the full head at the exit layer; exit only if its top-1 is a candidate.
    Full,
    /// No full head: emit the best candidate (with the file's higher `threshold_unverified`).
    #[default]
    Candidates,
}

impl std::str::FromStr for Verify {
    type Err = String;
    fn from_str(s: &str) -> Result<Verify, String> {
        match s {
            "full" => Ok(Verify::Full),
            "candidates" => Ok(Verify::Candidates),
            other => Err(format!("unknown verification `{other}` (full or candidates)")),
        }
    }
}

/// Settings of a [`SpecEeDecoder`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecEeConfig {
    pub policy: KvPolicy,
    pub verify: Verify,
    /// Exit threshold (default: the predictor file's, for the chosen verification).
    pub threshold: Option<f32>,
    /// Disable the online scheduling level (offline layers only).
    pub offline_only: bool,
}

impl SpecEeConfig {
    /// The exit threshold in use with `predictors`: the explicit one, else the file's for the chosen verification.
    pub fn threshold_for(&self, predictors: &ExitPredictors) -> f32 {
        self.threshold.unwrap_or(match self.verify {
            Verify::Full => predictors.threshold,
            Verify::Candidates => predictors.threshold_unverified,
        })
    }
}

/// Counters since the decoder was built.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecEeStats {
    /// Tokens stepped.
    pub tokens: usize,
    /// Layers run, summed over tokens.
    pub layers: usize,
    /// Tokens emitted by a predictor's exit: before the last layer, or after it without the full head.
    pub exits: usize,
    /// Predictor evaluations.
    pub predictor_calls: usize,
    /// Verifications whose full-head top-1 was not a candidate.
    pub verify_failures: usize,
    /// Full-vocabulary head products (final layer, verifications, requested logits).
    pub full_heads: usize,
    /// Exits refused because the grammar forbids their token (the step went on).
    pub grammar_vetoes: usize,
    /// Time in the draft head.
    pub draft_time: Duration,
}

impl SpecEeStats {
    /// Adds another run's counters.
    pub fn add(&mut self, o: &SpecEeStats) {
        self.tokens += o.tokens;
        self.layers += o.layers;
        self.exits += o.exits;
        self.predictor_calls += o.predictor_calls;
        self.verify_failures += o.verify_failures;
        self.full_heads += o.full_heads;
        self.grammar_vetoes += o.grammar_vetoes;
        self.draft_time += o.draft_time;
    }

    fn per_token(&self, x: usize) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            x as f64 / self.tokens as f64
        }
    }
    /// Mean layers run per token.
    pub fn avg_layers(&self) -> f64 {
        self.per_token(self.layers)
    }
    pub fn predictor_calls_per_token(&self) -> f64 {
        self.per_token(self.predictor_calls)
    }
    pub fn verify_failures_per_token(&self) -> f64 {
        self.per_token(self.verify_failures)
    }
    pub fn exit_rate(&self) -> f64 {
        self.per_token(self.exits)
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// The next token.
    pub token: u32,
    /// Layers run (the model's depth when the token did not exit).
    pub layers: usize,
    /// The draft candidates of this step.
    pub candidates: [u32; CANDIDATES],
    /// The draft head's log-probabilities of the candidates.
    pub draft_log_probs: [f32; CANDIDATES],
}

/// How a step runs its layers.
enum Run<'a> {
    /// Predictors decide (inference); under a grammar an exit whose token it forbids is refused (the step goes
    /// on, as after a failed verification) and the last layer's token is the best allowed one.
    Exit { want_logits: bool, constraint: Option<&'a mut dyn TokenConstraint> },
    /// Every layer runs; the candidates' logits after each layer are appended to the first trace (`4` floats
    /// per layer) and the layer's [`layer_update`] to the second (`2` per layer) — training data for the
    /// predictors, exactly the inference features' inputs.
    Trace(&'a mut Vec<f32>, &'a mut Vec<f32>),
}

/// An exited token waiting for its skipped layers ([`KvPolicy::Deferred`]).
#[derive(Clone, Debug)]
pub(super) struct Pending {
    /// Hidden state entering layer `next`.
    pub(super) hidden: Vec<f32>,
    pub(super) pos: u32,
    pub(super) next: usize,
}

/// Early-exit decoding of one sequence.
pub struct SpecEeDecoder<'m> {
    model: &'m Model,
    kv: KvCache,
    ws: Workspace,
    head: &'m DraftHead,
    predictors: &'m ExitPredictors,
    scheduler: Scheduler,
    config: SpecEeConfig,
    threshold: f32,
    draft_scratch: DraftScratch,
    draft_out: Vec<f32>,
    draft_logits: Vec<f32>,
    order: Vec<u32>,
    hidden: Vec<f32>,
    /// The residual stream entering the layer being run (for [`layer_update`]).
    h_in: Vec<f32>,
    normed: Vec<f32>,
    logits: Vec<f32>,
    /// The draft head's feature row ([`DraftHead::feature_source`]) of the last token run: the normed hidden
    /// state at its exit layer (and a fused head's layer inputs; a layer the token never reached gets the exit
    /// state).
    feature: Vec<f32>,
    /// The row being filled by the running step.
    feature_next: Vec<f32>,
    /// The head's first-step input made from `feature`.
    draft_in: Vec<f32>,
    source: FeatureSource,
    /// Runs prompts (all layers), capturing the feature rows.
    verifier: Verifier,
    tokens: Vec<u32>,
    stats: SpecEeStats,
    pending: Vec<Pending>,
    batch: Vec<f32>,
    batch_pos: Vec<u32>,
    /// A token the next step's candidates must include ([`SpecEeDecoder::force_candidate`]).
    forced: Option<u32>,
    /// Traced steps keep the normed state after every layer from this one on ([`SpecEeDecoder::keep_states`]).
    keep_states_from: Option<usize>,
    /// The kept states, in f16: per traced step, per kept layer, `n_embd` values.
    kept_states: Vec<half::f16>,
}

impl<'m> SpecEeDecoder<'m> {
    /// A decoder with a context of `ctx` tokens on `threads` threads. The head and predictors must fit the
    /// model (checked by the caller: [`DraftHead::check_fits`], [`ExitPredictors::check_fits`]).
    pub fn new(
        model: &'m Model,
        ctx: usize,
        threads: usize,
        head: &'m DraftHead,
        predictors: &'m ExitPredictors,
        config: SpecEeConfig,
    ) -> Self {
        let available = predictors.layers.iter().map(Option::is_some).collect();
        let scheduler = Scheduler::new(predictors.schedule.clone(), available, !config.offline_only);
        let threshold = config.threshold_for(predictors);
        SpecEeDecoder {
            model,
            kv: model.new_cache(ctx),
            ws: Workspace::new(threads),
            head,
            predictors,
            scheduler,
            config,
            threshold,
            draft_scratch: DraftScratch::default(),
            draft_out: Vec::new(),
            draft_logits: Vec::new(),
            order: Vec::new(),
            hidden: Vec::new(),
            h_in: Vec::new(),
            normed: Vec::new(),
            logits: Vec::new(),
            feature: Vec::new(),
            feature_next: Vec::new(),
            draft_in: Vec::new(),
            source: head.feature_source(),
            verifier: Verifier::default(),
            tokens: Vec::new(),
            stats: SpecEeStats::default(),
            pending: Vec::new(),
            batch: Vec::new(),
            batch_pos: Vec::new(),
            forced: None,
            keep_states_from: None,
            kept_states: Vec::new(),
        }
    }

    /// Tokens in the cache so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The KV cache (per-layer lengths show what the KV policy kept).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Counters.
    pub fn stats(&self) -> &SpecEeStats {
        &self.stats
    }

    /// The exit threshold in use.
    pub fn threshold(&self) -> f32 {
        self.threshold
    }

    /// Changes the exit threshold from the next step on.
    pub fn set_threshold(&mut self, threshold: f32) {
        self.threshold = threshold;
    }

    /// Context capacity.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Forgets the sequence (and the online schedule's history).
    pub fn reset(&mut self) {
        self.kv.clear();
        self.tokens.clear();
        self.feature.clear();
        self.pending.clear();
        self.scheduler.reset();
        self.forced = None;
    }

    /// Makes the next step's candidates include `token`: in the last slot, with its draft log-probability (or,
    /// outside the draft vocabulary, one below the others'), when the head did not propose it. Given the dense
    /// top-1 this is a perfect draft head, for measuring what early exit could reach with one
    /// (`specee train-exit --perfect-head`).
    pub fn force_candidate(&mut self, token: u32) {
        self.forced = Some(token);
    }

    /// Full-vocabulary logits of the last [`SpecEeDecoder::feed`], or of the last step run with `want_logits`
    /// (at its exit layer, divided by that layer's exit temperature: [`ExitPredictors::calibrate`]).
    pub fn logits(&self) -> &[f32] {
        &self.logits[..self.model.config.vocab_size]
    }

    /// Runs `tokens` (a prompt) through every layer and returns the greedy next token
    /// ([`model::Model::head_argmax`]: no logits are left behind).
    pub fn feed(&mut self, tokens: &[u32]) -> Result<u32, SpeculativeError> {
        if tokens.is_empty() {
            return Err(SpeculativeError::EmptyContext);
        }
        let d = self.model.config.n_embd;
        // Every layer, capturing the head's feature rows; the last row's final-normed state (its slot 0) gives
        // the logits.
        let (n, width) = (tokens.len(), self.source.width(d));
        self.verifier.prefill(self.model, tokens, &mut self.kv, &mut self.ws, &self.source)?;
        self.feature.clear();
        self.feature.extend_from_slice(&self.verifier.features()[(n - 1) * width..n * width]);
        debug_assert_eq!(self.source.final_norm_slot(), Some(0));
        self.normed.clear();
        self.normed.extend_from_slice(&self.feature[..d]);
        let mut next = [0u32];
        self.model.head_argmax(&self.normed, 1, &mut next, &mut self.ws);
        self.tokens.extend_from_slice(tokens);
        Ok(next[0])
    }

    /// Runs `token` (appended at the next position) with early exit and returns the next token. With
    /// `want_logits`, the exit layer's full-vocabulary logits are left in [`SpecEeDecoder::logits`] (used by
    /// quality evaluation; costs a full head when the exit did not compute one).
    pub fn step(&mut self, token: u32, want_logits: bool) -> Result<Step, SpeculativeError> {
        self.run(token, Run::Exit { want_logits, constraint: None })
    }

    /// [`SpecEeDecoder::step`] under a grammar: the next token is one `constraint` allows (it is not committed
    /// to `constraint`: the caller does that). An exit whose token the grammar forbids does not happen (counted
    /// in [`SpecEeStats::grammar_vetoes`]); a token that runs every layer is the best allowed one of the full
    /// logits ([`constrained_argmax`]), so a step that never exits is constrained dense greedy decoding.
    pub fn step_constrained(
        &mut self,
        token: u32,
        constraint: &mut dyn TokenConstraint,
    ) -> Result<Step, SpeculativeError> {
        self.run(token, Run::Exit { want_logits: false, constraint: Some(constraint) })
    }

    /// The best token `constraint` allows for the current final-normed row (after [`SpecEeDecoder::feed`], or a
    /// step that ran every layer): `greedy`, that row's top-1, when allowed, else the argmax of the row's full
    /// logits, masked.
    pub fn constrain_fed(
        &mut self,
        greedy: u32,
        constraint: &mut dyn TokenConstraint,
    ) -> Result<u32, SpeculativeError> {
        let (model, v) = (self.model, self.model.config.vocab_size);
        let (normed, ws, stats) = (&self.normed, &mut self.ws, &mut self.stats);
        let full = |out: &mut Vec<f32>| {
            out.resize(v, 0.0);
            model.head_full(normed, 1, out, ws);
            stats.full_heads += 1;
        };
        constrained_argmax(greedy, constraint, full, &mut self.logits).map_err(SpeculativeError::from)
    }

    /// Makes traced steps ([`SpecEeDecoder::step_trace`]) keep the normed hidden state (the head's input) after
    /// every layer from `from_layer` on, in f16, for studying predictors that read it (`specee train-exit
    /// --keep-states`); `None` stops keeping them.
    pub fn keep_states(&mut self, from_layer: Option<usize>) {
        self.keep_states_from = from_layer;
    }

    /// The states kept so far (per traced step, per kept layer, `n_embd` values; kept across
    /// [`SpecEeDecoder::reset`], so one call after tracing many records), leaving none.
    pub fn take_states(&mut self) -> Vec<half::f16> {
        std::mem::take(&mut self.kept_states)
    }

    /// Runs `token` through every layer (dense greedy), appending the candidates' logits after every layer to
    /// `trace` (`CANDIDATES` floats per layer) and each layer's [`layer_update`] to `updates` (`UPDATE_FEATURES`
    /// per layer). Training data for the predictors.
    pub fn step_trace(
        &mut self,
        token: u32,
        trace: &mut Vec<f32>,
        updates: &mut Vec<f32>,
    ) -> Result<Step, SpeculativeError> {
        self.run(token, Run::Trace(trace, updates))
    }

    /// The draft head's candidates for the token after `token`, with their draft log-probabilities.
    fn candidates(&mut self, token: u32) -> Result<([u32; CANDIDATES], [f32; CANDIDATES]), SpeculativeError> {
        if self.feature.is_empty() {
            return Err(SpeculativeError::EmptyContext);
        }
        let t0 = Instant::now();
        let pool = self.ws.pool();
        self.head.first_input(&self.feature, 1, pool, &mut self.draft_scratch, &mut self.draft_in);
        self.head.forward(
            self.model,
            &[token],
            &self.draft_in,
            pool,
            &mut self.draft_scratch,
            &mut self.draft_out,
            &mut self.draft_logits,
        )?;
        let logits = &self.draft_logits[..self.head.vocab];
        top_k_indices(logits, CANDIDATES, &mut self.order);
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let log_sum = max + logits.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
        let (mut cand, mut lp) = ([0u32; CANDIDATES], [0f32; CANDIDATES]);
        for (k, &j) in self.order.iter().enumerate() {
            cand[k] = self.head.d2t[j as usize];
            lp[k] = logits[j as usize] - log_sum;
        }
        // A head with fewer than 4 draft tokens repeats its best one (harmless: the features see equal logits).
        for j in self.order.len().min(CANDIDATES)..CANDIDATES {
            (cand[j], lp[j]) = (cand[0], lp[0]);
        }
        if let Some(f) = self.forced.take().filter(|f| !cand.contains(f)) {
            let own = self.head.d2t.iter().position(|&t| t == f).map(|j| logits[j] - log_sum);
            let lowest = lp.iter().fold(f32::INFINITY, |m, &v| m.min(v));
            (cand[CANDIDATES - 1], lp[CANDIDATES - 1]) = (f, own.unwrap_or(lowest - 1.0));
        }
        self.stats.draft_time += t0.elapsed();
        Ok((cand, lp))
    }

    fn full_head(&mut self) {
        let v = self.model.config.vocab_size;
        self.logits.resize(v, 0.0);
        self.model.head_full(&self.normed, 1, &mut self.logits, &mut self.ws);
        self.stats.full_heads += 1;
    }

    /// The full head's greedy token for the current normed row: from its logits (kept in
    /// [`SpecEeDecoder::logits`]) when `keep_logits`, else from [`model::Model::head_argmax`] (the same token,
    /// through the head screen where it is on).
    fn head_token(&mut self, keep_logits: bool) -> u32 {
        if keep_logits {
            self.full_head();
            return argmax(self.logits());
        }
        let mut t = [0u32];
        self.model.head_argmax(&self.normed, 1, &mut t, &mut self.ws);
        self.stats.full_heads += 1;
        t[0]
    }

    /// Layer `il` over the carried pending rows (earlier positions first) and the current row, in one batch.
    fn layer_with_pending(&mut self, il: usize, pos: u32, carried: &mut [usize]) -> Result<(), SpeculativeError> {
        let d = self.model.config.n_embd;
        carried.sort_by_key(|&i| self.pending[i].pos);
        self.batch.clear();
        self.batch_pos.clear();
        for &i in carried.iter() {
            self.batch.extend_from_slice(&self.pending[i].hidden);
            self.batch_pos.push(self.pending[i].pos);
        }
        self.batch.extend_from_slice(&self.hidden);
        self.batch_pos.push(pos);
        self.model.layer(il, &mut self.batch, &self.batch_pos, Mask::Causal, &mut self.kv, &mut self.ws)?;
        for (r, &i) in carried.iter().enumerate() {
            let p = &mut self.pending[i];
            p.hidden.copy_from_slice(&self.batch[r * d..(r + 1) * d]);
            p.next = il + 1;
        }
        let r = carried.len();
        self.hidden.copy_from_slice(&self.batch[r * d..(r + 1) * d]);
        Ok(())
    }

    fn run(&mut self, token: u32, mut mode: Run<'_>) -> Result<Step, SpeculativeError> {
        let model = self.model;
        let (d, n_layers) = (model.config.n_embd, model.config.n_layers);
        let (cand, draft_lp) = self.candidates(token)?;
        let pos = self.tokens.len() as u32;
        self.hidden.resize(d, 0.0);
        self.normed.resize(d, 0.0);
        model.embed(&[token], &mut self.hidden)?;
        let mut s = [0f32; CANDIDATES];
        let mut update = [1f32, 0.0];
        let mut p_prev: Option<[f32; CANDIDATES]> = None;
        let mut exit: Option<(usize, u32)> = None;
        let mut have_logits = false;
        // Pending rows (deferred policy) carried along with this token, by index into `pending`.
        let mut carried: Vec<usize> = Vec::new();
        let width = self.source.width(d);
        self.feature_next.resize(width, 0.0);
        let mut reached = n_layers;
        let keep_logits = !matches!(mode, Run::Exit { want_logits: false, .. });
        for il in 0..n_layers {
            self.source.capture_layer_input(il, &self.hidden, &mut self.feature_next, d);
            for (i, p) in self.pending.iter().enumerate() {
                if p.next == il && !carried.contains(&i) {
                    carried.push(i);
                }
            }
            let last = il + 1 == n_layers;
            // The predictor evaluated after this layer (inference only). The last layer's predictor only
            // replaces the full head, which `Verify::Full` runs anyway.
            let mlp = match &mode {
                Run::Trace(..) => None,
                Run::Exit { .. } => self.predictors.layers[il]
                    .as_ref()
                    .filter(|_| self.scheduler.is_active(il) && !(last && self.config.verify == Verify::Full)),
            };
            // The layer's update is a feature of predictors that read it (and of every traced layer).
            let want_update = matches!(mode, Run::Trace(..)) || mlp.is_some_and(|m| m.n_in > DRAFT_FEATURES);
            if want_update {
                self.h_in.clear();
                self.h_in.extend_from_slice(&self.hidden);
            }
            if carried.is_empty() {
                model.layer(il, &mut self.hidden, &[pos], Mask::Causal, &mut self.kv, &mut self.ws)?;
            } else {
                self.layer_with_pending(il, pos, &mut carried)?;
            }
            if want_update {
                update = layer_update(&self.h_in, &self.hidden);
            }
            match &mut mode {
                Run::Trace(trace, updates) => {
                    model.final_norm(&self.hidden, &mut self.normed);
                    model.head_rows(&self.normed, &cand, &mut s, &mut self.ws);
                    trace.extend_from_slice(&s);
                    updates.extend_from_slice(&update[..UPDATE_FEATURES]);
                    if self.keep_states_from.is_some_and(|from| il >= from) {
                        self.kept_states.extend(self.normed.iter().map(|&v| half::f16::from_f32(v)));
                    }
                }
                Run::Exit { .. } => {
                    let Some(mlp) = mlp else { continue };
                    model.final_norm(&self.hidden, &mut self.normed);
                    model.head_rows(&self.normed, &cand, &mut s, &mut self.ws);
                    let (x, p) = features(&s, p_prev.as_ref(), &draft_lp, &update);
                    p_prev = Some(p);
                    self.stats.predictor_calls += 1;
                    if mlp.predict(&x) <= self.threshold {
                        continue;
                    }
                    match self.config.verify {
                        Verify::Candidates => {
                            let best = (0..CANDIDATES).fold(0, |b, j| if s[j] > s[b] { j } else { b });
                            exit = Some((il, cand[best]));
                        }
                        Verify::Full => {
                            let t = self.head_token(keep_logits);
                            have_logits = keep_logits;
                            if cand.contains(&t) {
                                exit = Some((il, t));
                            } else {
                                self.stats.verify_failures += 1;
                                have_logits = false;
                            }
                        }
                    }
                    if let (Some((_, t)), Run::Exit { constraint: Some(c), .. }) = (exit, &mut mode) {
                        if !c.allows(t)? {
                            self.stats.grammar_vetoes += 1;
                            (exit, have_logits) = (None, false);
                        }
                    }
                    if exit.is_some() {
                        break;
                    }
                }
            }
        }
        let (layers, next) = match exit {
            Some((il, t)) => {
                reached = il + 1;
                self.scheduler.record_exit(il);
                self.stats.exits += 1;
                match self.config.policy {
                    KvPolicy::Missing => {}
                    KvPolicy::Propagate => {
                        let positions = [pos];
                        for j in il + 1..n_layers {
                            model.layer_kv(j, &self.hidden, &positions, &mut self.kv, &mut self.ws)?;
                        }
                    }
                    KvPolicy::Deferred if il + 1 < n_layers => {
                        for &i in &carried {
                            self.pending[i].next = il + 1;
                        }
                        self.pending.push(Pending { hidden: self.hidden.clone(), pos, next: il + 1 });
                    }
                    KvPolicy::Deferred => {}
                }
                if matches!(mode, Run::Exit { want_logits: true, .. }) {
                    if !have_logits {
                        self.full_head();
                    }
                    self.predictors.calibrate(il, &mut self.logits);
                }
                (il + 1, t)
            }
            None => {
                model.final_norm(&self.hidden, &mut self.normed);
                let greedy = self.head_token(keep_logits);
                match &mut mode {
                    Run::Exit { constraint: Some(c), .. } => (n_layers, self.constrain_fed(greedy, &mut **c)?),
                    _ => (n_layers, greedy),
                }
            }
        };
        // Rows carried through the last layer are complete.
        self.pending.retain(|p| p.next < n_layers);
        // The exit layer's normed state (and the layer inputs) is what the draft head reads for the next token.
        for il in reached..=n_layers {
            self.source.capture_layer_input(il, &self.hidden, &mut self.feature_next, d);
        }
        self.source.put_final_norm(&self.normed, &mut self.feature_next, d);
        std::mem::swap(&mut self.feature, &mut self.feature_next);
        self.tokens.push(token);
        self.stats.tokens += 1;
        self.stats.layers += layers;
        Ok(Step { token: next, layers, candidates: cand, draft_log_probs: draft_lp })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::specee::predictor::tests::random_predictors;
    use crate::specee::predictor::MAX_FEATURES;
    use crate::speculative::eagle::tests::random_head_bytes;

    use crate::test_util::{dense_greedy, PROMPT};

    /// The random head and predictors every test decoder uses.
    fn parts(model: &Model) -> (DraftHead, ExitPredictors) {
        let head = DraftHead::from_bytes(&random_head_bytes(32, 64, 32, 5)).unwrap();
        (head, random_predictors(model.config.n_layers, 16, 3))
    }

    #[test]
    fn never_exiting_and_tracing_equal_dense_greedy() {
        for arch in ["llama", "gemma3"] {
            let model = model::testing::tiny_model(arch, None, 11, 64);
            let (head, predictors) = parts(&model);
            let n_layers = model.config.n_layers;
            let want = dense_greedy(&model, 24);
            let mut dec = SpecEeDecoder::new(
                &model,
                128,
                2,
                &head,
                &predictors,
                SpecEeConfig { threshold: Some(2.0), ..Default::default() },
            );
            let mut got = vec![dec.feed(&PROMPT).unwrap()];
            while got.len() < want.len() {
                got.push(dec.step(*got.last().unwrap(), false).unwrap().token);
            }
            assert_eq!(got, want, "{arch}: a decoder that never exits is dense decoding");
            let st = *dec.stats();
            assert_eq!((st.exits, st.layers), (0, st.tokens * n_layers));
            assert!(st.predictor_calls > 0);

            let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, SpecEeConfig::default());
            let (mut trace, mut updates) = (Vec::new(), Vec::new());
            let mut got = vec![dec.feed(&PROMPT).unwrap()];
            while got.len() < want.len() {
                got.push(dec.step_trace(*got.last().unwrap(), &mut trace, &mut updates).unwrap().token);
            }
            assert_eq!(got, want, "{arch}: tracing runs every layer");
            assert_eq!(trace.len(), (want.len() - 1) * n_layers * CANDIDATES);
            assert_eq!(updates.len(), (want.len() - 1) * n_layers * 2);
            for u in updates.chunks_exact(2) {
                assert!((-1.0..=1.0 + 1e-6).contains(&u[0]) && u[1] > 0.0, "{arch}: update {u:?}");
            }
        }
    }

    /// Greedy SpecEE under a grammar until it ends; checks that every token is allowed (`commit` errs otherwise).
    pub(crate) fn specee_constrained(dec: &mut SpecEeDecoder<'_>, mut c: crate::constraint::tests::Script) -> Vec<u32> {
        use crate::constraint::TokenConstraint;
        let first = dec.feed(&PROMPT).unwrap();
        let mut next = dec.constrain_fed(first, &mut c).unwrap();
        let mut out = Vec::new();
        loop {
            c.commit(next).unwrap();
            out.push(next);
            if c.is_finished() {
                return out;
            }
            next = dec.step_constrained(next, &mut c).unwrap().token;
        }
    }

    #[test]
    fn under_a_grammar_forbidden_exits_are_refused_and_never_exiting_is_constrained_dense() {
        use crate::constraint::tests::{dense_constrained, modular};
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, predictors) = parts(&model);
        let len = 30;
        let want = dense_constrained(&model, modular(len));
        let never = SpecEeConfig { threshold: Some(2.0), ..Default::default() };
        let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, never);
        assert_eq!(specee_constrained(&mut dec, modular(len)), want, "never exiting: constrained dense");
        assert_eq!((dec.stats().exits, dec.stats().grammar_vetoes), (0, 0));
        for verify in [Verify::Candidates, Verify::Full] {
            // Threshold −1: every evaluated layer wants to exit; the grammar (a third of the vocabulary at most
            // steps) refuses many of them, and what is committed is always allowed.
            let always = SpecEeConfig { threshold: Some(-1.0), verify, ..Default::default() };
            let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, always);
            let got = specee_constrained(&mut dec, modular(len));
            assert_eq!(got.len(), len);
            let st = *dec.stats();
            assert!(st.exits > 0 && st.grammar_vetoes > 0, "{verify:?}: {st:?}");
        }
    }

    #[test]
    fn a_forced_candidate_joins_the_next_steps_candidates_only() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, predictors) = parts(&model);
        let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, SpecEeConfig::default());
        let (mut s, mut u) = (Vec::new(), Vec::new());
        let first = dec.feed(&PROMPT).unwrap();
        let plain = dec.step_trace(first, &mut s, &mut u).unwrap();
        // A token the head did not propose (the tiny vocabulary has more than 4 tokens).
        let outsider = (0..model.config.vocab_size as u32).find(|t| !plain.candidates.contains(t)).unwrap();
        dec.reset();
        assert_eq!(dec.feed(&PROMPT).unwrap(), first);
        dec.force_candidate(outsider);
        let forced = dec.step_trace(first, &mut s, &mut u).unwrap();
        assert_eq!(forced.candidates[..CANDIDATES - 1], plain.candidates[..CANDIDATES - 1]);
        assert_eq!(forced.candidates[CANDIDATES - 1], outsider);
        assert!(forced.draft_log_probs[CANDIDATES - 1] < forced.draft_log_probs[CANDIDATES - 2]);
        assert_eq!(forced.token, plain.token, "forcing changes the candidates, not the dense token");
        // Used once: the step after proposes the head's own candidates again.
        let after = dec.step_trace(forced.token, &mut s, &mut u).unwrap();
        dec.reset();
        dec.feed(&PROMPT).unwrap();
        dec.step_trace(first, &mut s, &mut u).unwrap();
        assert_eq!(after.candidates, dec.step_trace(plain.token, &mut s, &mut u).unwrap().candidates);
        // A candidate the head proposed anyway stays where it is.
        dec.reset();
        dec.feed(&PROMPT).unwrap();
        dec.force_candidate(plain.candidates[1]);
        assert_eq!(dec.step_trace(first, &mut s, &mut u).unwrap().candidates, plain.candidates);
    }

    #[test]
    fn inference_features_are_the_traced_features() {
        // Predictors that read only the layer-update features (`[s, p, d, q]` weights zero): every exit decision
        // at inference must be the one the traced features (what training sees) give for the same step.
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, mut predictors) = parts(&model);
        let n_layers = model.config.n_layers;
        for m in predictors.layers.iter_mut().flatten() {
            m.w1 = vec![0.0; MAX_FEATURES];
            (m.w1[MAX_FEATURES - 2], m.w1[MAX_FEATURES - 1]) = (8.0, -8.0);
            (m.b1, m.w2, m.b2) = (vec![0.0], vec![1.0], 0.0);
        }
        predictors.schedule.offline = (0..n_layers).collect();
        let mut tracer = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, SpecEeConfig::default());
        let mut history = PROMPT.to_vec();
        let mut next = tracer.feed(&PROMPT).unwrap();
        let mut steps = Vec::new();
        for _ in 0..10 {
            let (mut s, mut u) = (Vec::new(), Vec::new());
            let step = tracer.step_trace(next, &mut s, &mut u).unwrap();
            let mut p_prev = None;
            let probs: Vec<f32> = (0..n_layers)
                .map(|l| {
                    let sl: [f32; CANDIDATES] = s[l * CANDIDATES..(l + 1) * CANDIDATES].try_into().unwrap();
                    let ul: [f32; UPDATE_FEATURES] = u[l * 2..l * 2 + 2].try_into().unwrap();
                    let (x, p) = features(&sl, p_prev.as_ref(), &step.draft_log_probs, &ul);
                    p_prev = Some(p);
                    predictors.layers[l].as_ref().unwrap().predict(&x)
                })
                .collect();
            steps.push((history.clone(), next, probs));
            history.push(next);
            next = step.token;
        }
        // A threshold in the widest gap between the middle half of the probabilities (robust to rounding).
        let mut all: Vec<f32> = steps.iter().flat_map(|s| s.2.iter().copied()).collect();
        all.sort_by(f32::total_cmp);
        let k =
            (all.len() / 4..3 * all.len() / 4).max_by(|&a, &b| (all[a + 1] - all[a]).total_cmp(&(all[b + 1] - all[b])));
        let threshold = (all[k.unwrap()] + all[k.unwrap() + 1]) / 2.0;
        let config = SpecEeConfig {
            verify: Verify::Candidates,
            threshold: Some(threshold),
            offline_only: true,
            ..Default::default()
        };
        let mut exits = Vec::new();
        for (history, token, probs) in &steps {
            let want = probs.iter().position(|&p| p > threshold).map_or(n_layers, |l| l + 1);
            let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, config);
            dec.feed(history).unwrap();
            assert_eq!(dec.step(*token, false).unwrap().layers, want, "probabilities {probs:?}, threshold {threshold}");
            exits.push(want);
        }
        assert!(exits.iter().any(|&e| e != exits[0]), "the test needs varied decisions: {exits:?}");
    }

    #[test]
    fn exit_logits_are_divided_by_the_exit_layers_temperature() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, plain) = parts(&model);
        let n_layers = model.config.n_layers;
        let mut hot = plain.clone();
        hot.temperature = (0..n_layers).map(|l| if l + 1 == n_layers { 1.0 } else { 2.0 + l as f32 }).collect();
        // Threshold −1: every token exits at the first offline layer (0); the last step runs dense.
        let config = SpecEeConfig {
            verify: Verify::Candidates,
            threshold: Some(-1.0),
            offline_only: true,
            ..Default::default()
        };
        let mut a = SpecEeDecoder::new(&model, 128, 2, &head, &plain, config);
        let mut b = SpecEeDecoder::new(&model, 128, 2, &head, &hot, config);
        let (mut ta, mut tb) = (a.feed(&PROMPT).unwrap(), b.feed(&PROMPT).unwrap());
        for _ in 0..4 {
            let (sa, sb) = (a.step(ta, true).unwrap(), b.step(tb, true).unwrap());
            assert_eq!((sa.token, sa.layers), (sb.token, sb.layers), "temperatures do not change decisions");
            let t = hot.temperature(sa.layers - 1);
            assert!(t > 1.0);
            for (&x, &y) in a.logits().iter().zip(b.logits()) {
                assert!((x / t - y).abs() <= 1e-6 * x.abs().max(1.0), "{x} / {t} vs {y}");
            }
            (ta, tb) = (sa.token, sb.token);
        }
    }

    #[test]
    fn exits_obey_verification_and_kv_policy() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, predictors) = parts(&model);
        let n_layers = model.config.n_layers;
        for verify in [Verify::Full, Verify::Candidates] {
            for policy in [KvPolicy::Missing, KvPolicy::Propagate, KvPolicy::Deferred] {
                let config = SpecEeConfig { policy, verify, threshold: Some(-1.0), offline_only: true };
                let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, config);
                let mut t = dec.feed(&PROMPT).unwrap();
                for _ in 0..12 {
                    let step = dec.step(t, true).unwrap();
                    if step.layers < n_layers {
                        assert!(step.candidates.contains(&step.token), "an exit emits a candidate");
                        if verify == Verify::Full {
                            assert_eq!(step.token, argmax(dec.logits()), "verified exit emits the full head's top-1");
                        }
                    }
                    t = step.token;
                }
                let st = *dec.stats();
                if verify == Verify::Candidates {
                    // Threshold −1: every token exits at the first offline layer (0) without a full head but
                    // the one asked for.
                    assert_eq!((st.exits, st.layers, st.verify_failures), (12, 12, 0));
                }
                assert!(st.exits + st.verify_failures <= st.predictor_calls, "every exit or failure follows a call");
                let (first, last) = (dec.kv().len(0), dec.kv().len(n_layers - 1));
                assert_eq!(first, PROMPT.len() + 12);
                match policy {
                    KvPolicy::Missing => assert_eq!(last, PROMPT.len() + 12 - st.exits),
                    KvPolicy::Propagate => assert_eq!(last, first),
                    // Every exit here is at layer 0, so nothing ever runs the deeper layers to carry them.
                    KvPolicy::Deferred => assert_eq!(last, PROMPT.len() + 12 - st.exits),
                }
            }
        }
    }

    #[test]
    fn deferred_rows_ride_along_with_the_next_full_token() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let (head, predictors) = parts(&model);
        let n_layers = model.config.n_layers;
        let config = SpecEeConfig { policy: KvPolicy::Deferred, offline_only: true, ..Default::default() };
        let mut dec = SpecEeDecoder::new(&model, 128, 2, &head, &predictors, config);
        let mut t = dec.feed(&PROMPT).unwrap();
        dec.set_threshold(-1.0);
        for _ in 0..3 {
            let step = dec.step(t, false).unwrap();
            assert_eq!(step.layers, 1, "exits after layer 0");
            t = step.token;
        }
        assert_eq!(dec.kv().len(1), PROMPT.len());
        dec.set_threshold(2.0);
        let step = dec.step(t, false).unwrap();
        assert_eq!(step.layers, n_layers);
        for il in 0..n_layers {
            assert_eq!(dec.kv().len(il), PROMPT.len() + 4, "layer {il} has every token after a full step");
        }
        // Positions in the deeper layers are in order (the carried rows went first).
        let pos = dec.kv().positions(n_layers - 1);
        assert!(pos.windows(2).all(|w| w[0] < w[1]), "{pos:?}");
    }
}
