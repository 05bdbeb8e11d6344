//! [`SpeculativeDecoder`]: the propose → verify → accept → compact loop over one sequence, shaped like
//! [`crate::DenseDecoder`] (feed a prompt, then step), with [`SpeculativeStats`] (acceptance length τ, target
//! forwards, time drafting vs verifying).
//!
//! State invariant: `tokens` holds every committed token; the KV cache holds all of them but the last (the
//! *root*), which the next step's verification runs together with the draft tree. So a step's first logits row
//! (the root's) gives the same next-token distribution dense decoding would sample from.

use super::acceptance::{
    accept_greedy, accept_greedy_tokens, accept_sampled, Acceptance, AcceptanceScratch, NodeLogits,
};
use super::proposer::{DraftContext, FeatureSource, Proposer};
use super::tree::{DraftSource, DraftTree, ROOT};
use super::verify::Verifier;
use super::SpeculativeError;
use crate::constraint::{constrained_argmax, TokenConstraint};
use crate::sampling::{Rng, SamplingParams};
use model::{KvCache, Model, ModelError, Workspace};
use std::time::{Duration, Instant};

/// Counters of a [`SpeculativeDecoder`] since it was built (or since [`SpeculativeDecoder::reset_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeculativeStats {
    /// Steps, i.e. batched target forwards over a draft tree.
    pub target_forwards: usize,
    /// Tokens committed by those steps (accepted draft tokens plus one bonus token per step).
    pub committed_tokens: usize,
    /// Draft nodes sent to verification (roots not counted).
    pub drafted_nodes: usize,
    /// Draft tokens accepted.
    pub accepted_drafts: usize,
    /// Time inside the proposer.
    pub draft_time: Duration,
    /// Time in the target forward over the tree, acceptance and cache compaction.
    pub verify_time: Duration,
    /// Time prefilling fed tokens.
    pub prefill_time: Duration,
}

impl SpeculativeStats {
    /// Adds another run's counters (prefill time included).
    pub fn add(&mut self, o: &SpeculativeStats) {
        self.target_forwards += o.target_forwards;
        self.committed_tokens += o.committed_tokens;
        self.drafted_nodes += o.drafted_nodes;
        self.accepted_drafts += o.accepted_drafts;
        self.draft_time += o.draft_time;
        self.verify_time += o.verify_time;
        self.prefill_time += o.prefill_time;
    }

    /// τ: mean tokens committed per target forward, bonus token included (1.0 = no speed-up from drafting).
    pub fn acceptance_length(&self) -> f64 {
        if self.target_forwards == 0 {
            0.0
        } else {
            self.committed_tokens as f64 / self.target_forwards as f64
        }
    }

    /// Share of drafting in the decode time (drafting + verification).
    pub fn draft_share(&self) -> f64 {
        let total = (self.draft_time + self.verify_time).as_secs_f64();
        if total > 0.0 {
            self.draft_time.as_secs_f64() / total
        } else {
            0.0
        }
    }
}

/// Lossless tree speculative decoding of one sequence with a [`Proposer`].
pub struct SpeculativeDecoder<'m, P: Proposer> {
    model: &'m Model,
    kv: KvCache,
    ws: Workspace,
    proposer: P,
    params: SamplingParams,
    rng: Rng,
    feature_source: FeatureSource,
    feature_width: usize,
    /// Committed tokens; all but the last are in the cache.
    tokens: Vec<u32>,
    /// Feature rows of `tokens[..len - 1]`.
    features: Vec<f32>,
    /// Leading tokens unchanged since the proposer last saw the context.
    stable_prefix: usize,
    tree: DraftTree,
    verifier: Verifier,
    acceptance: Acceptance,
    scratch: AcceptanceScratch,
    stats: SpeculativeStats,
    /// Logits of one row when the grammar forbids its argmax ([`SpeculativeDecoder::step_constrained`]).
    constrained_logits: Vec<f32>,
    /// The drafted tree's rows while a step verified by the caller is pending
    /// ([`SpeculativeDecoder::draft_rows`]): the cache length before it, when drafting ended, and the rows.
    pending: Option<(usize, Instant)>,
    rows: TreeRows,
}

/// The rows of a drafted tree, as the target runs them ([`SpeculativeDecoder::draft_rows`]): node `i`'s token at
/// its position (the root's at the cache's end), seeing the cache and its own ancestors (`mask[i * n + m]`).
#[derive(Debug, Default)]
pub struct TreeRows {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub mask: Vec<bool>,
}

impl<'m, P: Proposer> SpeculativeDecoder<'m, P> {
    /// A decoder with a context of `ctx` tokens and `threads` threads, drafting with `proposer` and committing
    /// tokens as `sampling` would (greedy: exactly dense greedy decoding; otherwise the same distribution).
    pub fn new(model: &'m Model, ctx: usize, threads: usize, proposer: P, sampling: SamplingParams) -> Self {
        let feature_source = proposer.feature_source();
        let feature_width = feature_source.width(model.config.n_embd);
        SpeculativeDecoder {
            model,
            kv: model.new_cache(ctx),
            ws: Workspace::new(threads),
            proposer,
            rng: Rng::new(sampling.seed),
            params: sampling,
            feature_source,
            feature_width,
            tokens: Vec::new(),
            features: Vec::new(),
            stable_prefix: 0,
            tree: DraftTree::new(0),
            verifier: Verifier::default(),
            acceptance: Acceptance::default(),
            scratch: AcceptanceScratch::default(),
            stats: SpeculativeStats::default(),
            constrained_logits: Vec::new(),
            pending: None,
            rows: TreeRows::default(),
        }
    }

    /// A decoder that goes on with a sequence another decoder ran: `kv` holds every token of `tokens` but the
    /// last (the root of the next step), `ws` is the workspace (and thread pool) to run on, and `root_feature` is
    /// the feature row of `tokens[len - 2]` (for [`FeatureSource::FinalNorm`], the final-normed state of the row
    /// that produced the root) — all a proposer that does not [`Proposer::needs_feature_history`] reads; earlier
    /// rows stay zero. The batching server continues a request this way when it is left alone. An error when
    /// the proposer needs more, or the cache, tokens and feature row do not agree.
    pub fn resume(
        model: &'m Model,
        kv: KvCache,
        ws: Workspace,
        proposer: P,
        sampling: SamplingParams,
        tokens: Vec<u32>,
        root_feature: &[f32],
    ) -> Result<Self, SpeculativeError> {
        let mut dec = SpeculativeDecoder::new(model, 0, 1, proposer, sampling);
        let width = dec.feature_width;
        let refuse = |why: String| Err(SpeculativeError::Proposer(why.into()));
        if dec.proposer.needs_feature_history() {
            return refuse("this proposer needs the features of the whole context".into());
        }
        if tokens.len() < 2 || kv.seq_len() + 1 != tokens.len() || root_feature.len() != width {
            return refuse(format!(
                "cannot resume: {} tokens, {} of them cached, a feature row of {} floats (expected {width})",
                tokens.len(),
                kv.seq_len(),
                root_feature.len()
            ));
        }
        dec.features = vec![0.0; (tokens.len() - 2) * width];
        dec.features.extend_from_slice(root_feature);
        (dec.kv, dec.ws, dec.tokens) = (kv, ws, tokens);
        Ok(dec)
    }

    /// The cache (every committed token but the last) and the workspace, for another decoder to go on with.
    pub fn into_parts(self) -> (KvCache, Workspace) {
        (self.kv, self.ws)
    }

    /// The model.
    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// Every committed token (fed and generated).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Feature rows (the proposer's [`FeatureSource`]) of every committed token but the last.
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    /// Context capacity.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Counters so far.
    pub fn stats(&self) -> &SpeculativeStats {
        &self.stats
    }

    /// Zeroes the counters.
    pub fn reset_stats(&mut self) {
        self.stats = SpeculativeStats::default();
    }

    /// The proposer.
    pub fn proposer(&self) -> &P {
        &self.proposer
    }

    /// The proposer, mutably (e.g. to change its settings between steps).
    pub fn proposer_mut(&mut self) -> &mut P {
        &mut self.proposer
    }

    /// The last draft tree that was verified.
    pub fn last_tree(&self) -> &DraftTree {
        &self.tree
    }

    /// Who drafted each accepted draft token of the last step, in order (the step committed these, then the
    /// verifier's own bonus token).
    pub fn accepted_sources(&self) -> impl Iterator<Item = super::DraftSource> + '_ {
        self.acceptance.path.iter().skip(1).map(|&i| self.tree.source(i))
    }

    /// The target's full logits before the `i`-th token the last step committed (the verification row of its
    /// parent: the root for the first, then the accepted drafts), into `out` — what dense decoding computes for
    /// the same token. An error when the last step committed fewer than `i + 1` tokens.
    pub fn committed_logits(&mut self, i: usize, out: &mut Vec<f32>) -> Result<(), SpeculativeError> {
        let row = *self
            .acceptance
            .path
            .get(i)
            .ok_or_else(|| SpeculativeError::Proposer(format!("the last step committed no token {i}").into()))?;
        self.verifier.row_logits(self.model, row, &mut self.ws, out);
        Ok(())
    }

    /// Forgets everything but the counters.
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Rolls the sequence back to its first `len` committed tokens.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(len);
        self.kv.truncate(len.saturating_sub(1));
        self.features.truncate(len.saturating_sub(1) * self.feature_width);
        self.stable_prefix = self.stable_prefix.min(len);
    }

    /// Appends `tokens` (a prompt, or a user's next turn) to the committed context. The target runs all of them
    /// but the last now; the last becomes the root of the next step.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<(), SpeculativeError> {
        let Some((&last, rest)) = tokens.split_last() else { return Ok(()) };
        let needed = self.tokens.len() + tokens.len();
        if needed > self.kv.capacity() {
            return Err(ModelError::ContextFull { needed, capacity: self.kv.capacity() }.into());
        }
        let t0 = Instant::now();
        // The previous root (if any) has not been run yet: it goes first.
        let mut batch = Vec::with_capacity(tokens.len());
        batch.extend(self.tokens.last().copied());
        batch.extend_from_slice(rest);
        let cached = self.kv.seq_len();
        if let Err(e) = self.verifier.prefill(self.model, &batch, &mut self.kv, &mut self.ws, &self.feature_source) {
            self.kv.truncate(cached);
            return Err(e.into());
        }
        self.features.extend_from_slice(self.verifier.features());
        self.tokens.extend_from_slice(rest);
        self.tokens.push(last);
        self.stats.prefill_time += t0.elapsed();
        Ok(())
    }

    /// One speculative step: drafts a tree, verifies it in one target forward and commits 1 to `depth + 1` tokens,
    /// which it returns.
    pub fn step(&mut self) -> Result<&[u32], SpeculativeError> {
        self.step_at_most(usize::MAX)
    }

    /// [`SpeculativeDecoder::step`], committing at most `max_tokens` tokens (at least 1): the tree is cut below
    /// depth `max_tokens - 1`. Use it to stop exactly at a length limit.
    pub fn step_at_most(&mut self, max_tokens: usize) -> Result<&[u32], SpeculativeError> {
        let (start, t1) = self.draft(None, max_tokens, usize::MAX)?;
        let vocab = self.model.config.vocab_size;
        // 2. Verify and 3. accept. Greedy settings without a penalty need only each node's greedy token (the
        // head screen); everything else needs the logits.
        let greedy_only = self.params.is_greedy();
        let (model, tree, fs) = (self.model, &self.tree, &self.feature_source);
        let verified = if greedy_only {
            self.verifier
                .verify_tree_greedy(model, tree, &mut self.kv, &mut self.ws, fs)
                .map(|choices| accept_greedy_tokens(tree, choices, &mut self.acceptance))
        } else {
            self.verifier.verify_tree(model, tree, &mut self.kv, &mut self.ws, fs).map(|data| {
                let logits = NodeLogits { data, vocab };
                if self.params.temperature <= 0.0 {
                    accept_greedy(tree, logits, &self.params, &self.tokens, &mut self.scratch, &mut self.acceptance);
                } else {
                    let (params, tokens) = (&self.params, &self.tokens);
                    accept_sampled(
                        tree,
                        logits,
                        params,
                        tokens,
                        &mut self.rng,
                        &mut self.scratch,
                        &mut self.acceptance,
                    );
                }
            })
        };
        if let Err(e) = verified {
            self.kv.truncate(start);
            return Err(e.into());
        }

        Ok(self.commit(start, t1, None))
    }

    /// Step 1 of a greedy step whose target forward the caller runs, batched with other sequences' rows (the
    /// batching server's): drafts a tree below the root on `pool`, committing at most `max_tokens` and verifying at
    /// most `max_rows` rows (root included; 1: no drafts, a dense step); [`SpeculativeDecoder::pending_rows`]
    /// then gives its rows and the cache they go into. The caller runs them through the target (e.g.
    /// [`model::Model::forward_rows`]) — which appends one cache slot per row — and hands the greedy token after each row and the rows' final-normed states to
    /// [`SpeculativeDecoder::commit_rows`]. The result is exactly [`SpeculativeDecoder::step_at_most`]'s when the
    /// tree is the same. Greedy settings without a penalty only, and proposers that read no layer inputs
    /// ([`FeatureSource::None`] or [`FeatureSource::FinalNorm`]).
    pub fn draft_rows(
        &mut self,
        pool: &kernels::ThreadPool,
        max_tokens: usize,
        max_rows: usize,
    ) -> Result<(), SpeculativeError> {
        if !self.params.is_greedy() || !matches!(self.feature_source, FeatureSource::None | FeatureSource::FinalNorm) {
            return Err(SpeculativeError::Proposer(
                "a step verified by the caller needs greedy settings and a proposer reading the final-normed state"
                    .into(),
            ));
        }
        self.pending = None;
        let (start, t1) = self.draft(Some(pool), max_tokens, max_rows)?;
        self.tree.ancestor_mask(&mut self.rows.mask);
        self.tree.positions(start as u32, &mut self.rows.positions);
        self.rows.tokens.clear();
        self.rows.tokens.extend(self.tree.nodes().iter().map(|n| n.token));
        self.pending = Some((start, t1));
        Ok(())
    }

    /// The rows of the step [`SpeculativeDecoder::draft_rows`] drafted and the cache they go into, while it is
    /// pending.
    pub fn pending_rows(&mut self) -> Option<(&TreeRows, &mut KvCache)> {
        self.pending.map(|_| (&self.rows, &mut self.kv))
    }

    /// Steps 3 and 4 of a step begun by [`SpeculativeDecoder::draft_rows`]: `choices[i]` is the target's greedy
    /// token after row `i`, `normed` the rows' final-normed states (`rows × n_embd`). Commits and returns 1 to
    /// `depth + 1` tokens; the cache keeps the root and the accepted path. An error when no step is pending or the
    /// rows do not match the tree (the cache is then cut back to where the step began).
    pub fn commit_rows(&mut self, choices: &[u32], normed: &[f32]) -> Result<&[u32], SpeculativeError> {
        let (start, t1) = self.pending.take().ok_or(SpeculativeError::Proposer("no drafted step to commit".into()))?;
        let (n, d) = (self.tree.len(), self.model.config.n_embd);
        if choices.len() != n || normed.len() != n * d || self.kv.seq_len() != start + n {
            let why = format!(
                "{} choices and {} normed rows for a tree of {n} rows ({} cached, {start} before the step)",
                choices.len(),
                normed.len() / d.max(1),
                self.kv.seq_len()
            );
            self.kv.truncate(start);
            return Err(SpeculativeError::Proposer(why.into()));
        }
        accept_greedy_tokens(&self.tree, choices, &mut self.acceptance);
        let features = (self.feature_source == FeatureSource::FinalNorm).then_some(normed);
        Ok(self.commit(start, t1, Some(features.unwrap_or(&[]))))
    }

    /// [`SpeculativeDecoder::step_at_most`] under a grammar: drafts the grammar forbids are dropped before the
    /// verification, and every committed token is the target's best *allowed* token, so the output is exactly
    /// what constrained dense greedy decoding commits ([`crate::constraint::constrained_argmax`]); `constraint`
    /// follows every committed token (the root already in it). Greedy settings without a penalty only.
    pub fn step_constrained(
        &mut self,
        max_tokens: usize,
        constraint: &mut dyn TokenConstraint,
    ) -> Result<&[u32], SpeculativeError> {
        if !self.params.is_greedy() {
            return Err(SpeculativeError::ConstrainedSampling);
        }
        let (start, t1) = self.draft(None, max_tokens, usize::MAX)?;
        // Draft what the grammar forces (a chain below the root, merged with the proposer's nodes), within the
        // step's token and cache limits.
        let room = self.kv.capacity().saturating_sub(start);
        let mut node = ROOT;
        for (depth, token) in constraint.forced().into_iter().enumerate() {
            if depth + 1 >= max_tokens {
                break;
            }
            let existing = self.tree.children(node).find(|&c| self.tree.node(c).token == token);
            node = match existing {
                Some(c) => c,
                None if self.tree.len() < room => self.tree.push_from(node, token, 0.0, DraftSource::Lookup),
                None => break,
            };
        }
        // Drop the drafts the grammar forbids: a node survives when its whole path is valid.
        self.tree.retain_allowed(constraint);

        let (model, tree, fs) = (self.model, &self.tree, &self.feature_source);
        let verified =
            self.verifier.verify_tree_greedy(model, tree, &mut self.kv, &mut self.ws, fs).map(|c| c.to_vec());
        let choices = match verified {
            Ok(c) => c,
            Err(e) => {
                self.kv.truncate(start);
                return Err(e.into());
            }
        };
        // The greedy walk, each choice the best allowed token (full logits of a row only where the grammar
        // forbids its argmax).
        let acceptance = &mut self.acceptance;
        acceptance.path.clear();
        acceptance.path.push(ROOT);
        let mut node = ROOT;
        let mut scratch = std::mem::take(&mut self.constrained_logits);
        let walked = loop {
            let (verifier, ws) = (&self.verifier, &mut self.ws);
            let full = |out: &mut Vec<f32>| verifier.row_logits(model, node, ws, out);
            let token = match constrained_argmax(choices[node], constraint, full, &mut scratch) {
                Ok(t) => t,
                Err(e) => break Err(e),
            };
            if let Err(e) = constraint.commit(token) {
                break Err(e);
            }
            // At the grammar's end the step ends too: its last token becomes the bonus (the next root).
            let child = tree.children(node).find(|&c| tree.node(c).token == token);
            match child.filter(|_| !constraint.is_finished()) {
                Some(child) => {
                    node = child;
                    acceptance.path.push(child);
                }
                None => {
                    acceptance.bonus = token;
                    break Ok(());
                }
            }
        };
        self.constrained_logits = scratch;
        if let Err(e) = walked {
            self.kv.truncate(start);
            return Err(e.into());
        }
        Ok(self.commit(start, t1, None))
    }

    /// Step 1: drafts a tree below the root (none when only the root fits, or `max_rows` is 1) on `pool`
    /// (default: the decoder's own), cut to `max_rows` rows, and checks its tokens; returns the cache length
    /// before the step and when drafting ended.
    fn draft(
        &mut self,
        pool: Option<&kernels::ThreadPool>,
        max_tokens: usize,
        max_rows: usize,
    ) -> Result<(usize, Instant), SpeculativeError> {
        let root = *self.tokens.last().ok_or(SpeculativeError::EmptyContext)?;
        let start = self.kv.seq_len();
        let room = self.kv.capacity().saturating_sub(start);
        if room == 0 {
            return Err(ModelError::ContextFull { needed: start + 1, capacity: self.kv.capacity() }.into());
        }

        // 1. Propose (unless only the root could be verified anyway).
        let t0 = Instant::now();
        self.tree.reset(root);
        if max_tokens > 1 && room > 1 && max_rows > 1 {
            let context = DraftContext {
                model: self.model,
                pool: pool.unwrap_or(self.ws.pool()),
                tokens: &self.tokens,
                features: &self.features,
                feature_width: self.feature_width,
                stable_prefix: self.stable_prefix,
            };
            self.proposer.propose(&context, &mut self.tree)?;
            self.stable_prefix = self.tokens.len();
        }
        self.tree.prune_deeper_than(max_tokens.max(1) - 1);
        self.tree.truncate(room.min(max_rows));
        let vocab = self.model.config.vocab_size;
        if let Some((node, n)) = self.tree.nodes().iter().enumerate().find(|(_, n)| n.token as usize >= vocab) {
            return Err(SpeculativeError::BadDraftToken { node, token: n.token, vocab });
        }
        let t1 = Instant::now();
        self.stats.draft_time += t1 - t0;
        Ok((start, t1))
    }

    /// Step 4: compacts the cache to root + accepted path and commits the path's tokens and the bonus; the
    /// feature rows of the tree's nodes are `features`, or the verifier's.
    fn commit(&mut self, start: usize, t1: Instant, features: Option<&[f32]>) -> &[u32] {
        let path = &self.acceptance.path;
        self.kv.compact(start, path);
        let width = self.feature_width;
        if width > 0 {
            let rows = features.unwrap_or(self.verifier.features());
            for &i in path {
                self.features.extend_from_slice(&rows[i * width..(i + 1) * width]);
            }
        }
        let first_new = self.tokens.len();
        self.tokens.extend(path[1..].iter().map(|&i| self.tree.node(i).token));
        self.tokens.push(self.acceptance.bonus);
        self.stats.verify_time += t1.elapsed();
        self.stats.target_forwards += 1;
        self.stats.committed_tokens += self.tokens.len() - first_new;
        self.stats.drafted_nodes += self.tree.len() - 1;
        self.stats.accepted_drafts += path.len() - 1;
        &self.tokens[first_new..]
    }
}
