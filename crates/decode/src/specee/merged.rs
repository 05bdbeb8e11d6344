//! [`MergedDecoder`]: `--mode specee-eagle`, SpecEE's early exit *inside* EAGLE tree verification ("merged
//! mapping", ../shared/DESIGN.md §4).
//!
//! One step, root `r` (the last committed token, not yet in the cache):
//! 1. the EAGLE head drafts a tree under `r` and, for **every** node (leaves included), its [`CANDIDATES`] best
//!    next tokens ([`EagleProposer::propose_with_candidates`]);
//! 2. the target runs the whole tree layer by layer (ancestor mask, one batch); after each active layer
//!    ([`Scheduler`]), every node not yet decided gets its 16 predictor features from its own hidden state
//!    against its own candidates' head rows — all nodes in **one grouped product**
//!    ([`model::Model::head_rows_grouped`]) — and a node whose predictor fires is *decided*: its next token is
//!    its best candidate at that layer ([`Verify::Candidates`]) or, as published, the full head's top-1 when
//!    that is a candidate ([`Verify::Full`]);
//! 3. the forward stops at the first layer where the path acceptance would take is settled: walking from the
//!    root into the child whose token is the node's decision, every node on the walk is decided and the last
//!    decision is not a child (it becomes the bonus token). This is the published "a path exits at the latest
//!    exit layer of its tokens", applied to the one path that can be accepted, so undecided siblings do not
//!    hold the batch back. Without such a layer the last layer decides, with one batched full head over the
//!    nodes still undecided (eagle's verification, less the nodes the predictors settled);
//! 4. the cache keeps the root and the accepted nodes (rolled back per layer, as the tree's KV is everywhere
//!    else); the layers they skipped follow the [`KvPolicy`] — under `Deferred` (the default) they ride along
//!    with the next step's batch through those layers, so deeper layers see exact K/V.
//!
//! With a predictor that never fires this is lossless tree speculative decoding (tested against dense greedy);
//! with a tree of only the root it is exactly [`super::SpecEeDecoder`] (tested token for token). Greedy only.
//! Under a grammar ([`MergedDecoder::step_constrained`]) forbidden drafts are dropped, forbidden predictor decisions
//! refused, and the last layer's decisions walked through the grammar (best allowed token where its top-1 is not).

use super::decoder::{KvPolicy, Pending, SpecEeConfig, Verify};
use super::predictor::{features, layer_update, ExitPredictors, CANDIDATES, DRAFT_FEATURES};
use super::schedule::Scheduler;
use crate::constraint::{constrained_argmax, TokenConstraint};
use crate::speculative::tree::ROOT;
use crate::speculative::{
    DraftContext, DraftHead, DraftTree, EagleProposer, FeatureSource, SpeculativeError, SpeculativeStats, TreeConfig,
};
use model::{KvCache, Mask, Model, ModelError, Workspace};
use std::sync::Arc;
use std::time::Instant;

/// Counters of a [`MergedDecoder`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MergedStats {
    /// Tree speculative counters (τ, drafted and accepted nodes, time drafting and verifying).
    pub speculative: SpeculativeStats,
    /// Layers run by the tree forwards, summed over forwards.
    pub layers: usize,
    /// Tree forwards settled by predictors (before the last layer, or at it without a full head).
    pub early_stops: usize,
    /// Predictor evaluations (one per node per evaluated layer).
    pub predictor_calls: usize,
    /// `Verify::Full` checks whose full-head top-1 was not a candidate.
    pub verify_failures: usize,
    /// Full-vocabulary head rows computed.
    pub full_head_rows: usize,
    /// Predictor decisions refused because the grammar forbids their token (the node stayed undecided).
    pub grammar_vetoes: usize,
}

impl MergedStats {
    /// Adds another run's counters.
    pub fn add(&mut self, o: &MergedStats) {
        self.speculative.add(&o.speculative);
        self.layers += o.layers;
        self.early_stops += o.early_stops;
        self.predictor_calls += o.predictor_calls;
        self.verify_failures += o.verify_failures;
        self.full_head_rows += o.full_head_rows;
        self.grammar_vetoes += o.grammar_vetoes;
    }

    /// Mean layers run per target forward (each forward runs the whole tree to that depth).
    pub fn avg_layers(&self) -> f64 {
        ratio(self.layers, self.speculative.target_forwards)
    }

    /// `x` per committed token.
    pub fn per_token(&self, x: usize) -> f64 {
        ratio(x, self.speculative.committed_tokens)
    }

    /// Share of target forwards settled by predictors.
    pub fn early_stop_rate(&self) -> f64 {
        ratio(self.early_stops, self.speculative.target_forwards)
    }
}

fn ratio(x: usize, n: usize) -> f64 {
    if n == 0 {
        0.0
    } else {
        x as f64 / n as f64
    }
}

/// What is known of one tree node during a forward.
#[derive(Clone, Copy, Debug, Default)]
struct NodeState {
    /// `(layer, next token)` once decided.
    decided: Option<(usize, u32)>,
    /// Whether a predictor decided it (rather than the full head at the last layer).
    by_predictor: bool,
    /// Candidate probabilities at the node's previous evaluated layer.
    p_prev: Option<[f32; CANDIDATES]>,
}

/// Tree speculative decoding with SpecEE early exit inside the tree forward (greedy, lossy).
pub struct MergedDecoder<'m> {
    model: &'m Model,
    kv: KvCache,
    ws: Workspace,
    proposer: EagleProposer,
    predictors: &'m ExitPredictors,
    scheduler: Scheduler,
    config: SpecEeConfig,
    threshold: f32,
    /// Committed tokens; all but the last are in the cache (in layer 0, and in the others per the KV policy).
    tokens: Vec<u32>,
    /// Draft feature rows ([`DraftHead::feature_source`]: the normed hidden state at the layer the token's
    /// forward stopped, and a fused head's layer inputs, the stop layer's state standing in for layers never
    /// reached) of `tokens[..len - 1]`.
    features: Vec<f32>,
    source: FeatureSource,
    /// Feature rows of the tree's nodes, filled as the forward goes (`tree.len() × width`).
    node_features: Vec<f32>,
    tree: DraftTree,
    /// `CANDIDATES` `(token, draft log-prob)` per tree node.
    candidates: Vec<(u32, f32)>,
    nodes: Vec<NodeState>,
    pending: Vec<Pending>,
    /// Accepted path of the last forward (tree node indices, root first) and its bonus token.
    path: Vec<usize>,
    bonus: u32,
    hidden: Vec<f32>,
    /// The tree rows entering the layer being run (for [`layer_update`]).
    hidden_in: Vec<f32>,
    positions: Vec<u32>,
    tree_mask: Vec<bool>,
    batch: Vec<f32>,
    batch_pos: Vec<u32>,
    batch_mask: Vec<bool>,
    carried: Vec<usize>,
    live: Vec<usize>,
    lens: Vec<usize>,
    normed: Vec<f32>,
    ids: Vec<u32>,
    scores: Vec<f32>,
    logits: Vec<f32>,
    /// Greedy tokens of the rows the full head decides.
    top: Vec<u32>,
    /// A node's path tokens (grammar checks).
    path_tokens: Vec<u32>,
    /// The root's normed hidden state where it was decided (its logits for quality evaluation).
    root_normed: Vec<f32>,
    stats: MergedStats,
}

impl<'m> MergedDecoder<'m> {
    /// A decoder for `ctx` tokens on `threads` threads, drafting trees of `tree` sizes with `head`. The head
    /// and predictors must fit the model (checked by the caller).
    pub fn new(
        model: &'m Model,
        ctx: usize,
        threads: usize,
        head: impl Into<Arc<DraftHead>>,
        tree: TreeConfig,
        predictors: &'m ExitPredictors,
        config: SpecEeConfig,
    ) -> Self {
        let available = predictors.layers.iter().map(Option::is_some).collect();
        let proposer = EagleProposer::new(head, tree);
        MergedDecoder {
            model,
            kv: model.new_cache(ctx),
            ws: Workspace::new(threads),
            source: proposer.head().feature_source(),
            proposer,
            predictors,
            scheduler: Scheduler::new(predictors.schedule.clone(), available, !config.offline_only),
            threshold: config.threshold_for(predictors),
            config,
            tokens: Vec::new(),
            features: Vec::new(),
            node_features: Vec::new(),
            tree: DraftTree::new(0),
            candidates: Vec::new(),
            nodes: Vec::new(),
            pending: Vec::new(),
            path: Vec::new(),
            bonus: 0,
            hidden: Vec::new(),
            hidden_in: Vec::new(),
            positions: Vec::new(),
            tree_mask: Vec::new(),
            batch: Vec::new(),
            batch_pos: Vec::new(),
            batch_mask: Vec::new(),
            carried: Vec::new(),
            live: Vec::new(),
            lens: Vec::new(),
            normed: Vec::new(),
            ids: Vec::new(),
            scores: Vec::new(),
            logits: Vec::new(),
            top: Vec::new(),
            path_tokens: Vec::new(),
            root_normed: Vec::new(),
            stats: MergedStats::default(),
        }
    }

    /// Also drafts the prompt-lookup chain of up to `depth` tokens beside the head's tree
    /// ([`EagleProposer::with_lookup`]); its nodes get candidates (and so exits) like the head's own.
    pub fn with_lookup(mut self, depth: usize) -> Self {
        self.proposer.lookup = crate::speculative::LookupChain::new(depth);
        self
    }

    /// Lets the lookup chain fall back on `datastore` ([`crate::speculative::LookupChain::with_datastore`]).
    pub fn with_datastore(mut self, datastore: Option<std::sync::Arc<crate::speculative::Datastore>>) -> Self {
        self.proposer.lookup = std::mem::take(&mut self.proposer.lookup).with_datastore(datastore);
        self
    }

    /// Every committed token.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The KV cache (per-layer lengths show what the KV policy kept).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Context capacity.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }

    /// Counters so far.
    pub fn stats(&self) -> &MergedStats {
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

    /// The last tree that was verified.
    pub fn last_tree(&self) -> &DraftTree {
        &self.tree
    }

    /// Forgets the sequence (and the online schedule's history), keeping the counters.
    pub fn reset(&mut self) {
        self.kv.clear();
        self.tokens.clear();
        self.features.clear();
        self.pending.clear();
        self.scheduler.reset();
    }

    /// Appends `tokens` to the committed context; the target runs all of them but the last (through every
    /// layer, carrying any deferred rows along), the last becomes the next step's root.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<(), SpeculativeError> {
        let Some((&last, rest)) = tokens.split_last() else { return Ok(()) };
        let start = self.kv.len(0);
        let needed = self.tokens.len() + tokens.len();
        if needed > self.kv.capacity() {
            return Err(ModelError::ContextFull { needed, capacity: self.kv.capacity() }.into());
        }
        let t0 = Instant::now();
        let (model, d) = (self.model, self.model.config.n_embd);
        let mut run: Vec<u32> = self.tokens.last().copied().into_iter().collect();
        run.extend_from_slice(rest);
        if !run.is_empty() {
            let n = run.len();
            self.hidden.resize(n * d, 0.0);
            model.embed(&run, &mut self.hidden)?;
            self.positions.clear();
            self.positions.extend((0..n as u32).map(|i| start as u32 + i));
            self.carried.clear();
            let at = self.features.len();
            self.features.resize(at + n * self.source.width(d), 0.0);
            for il in 0..model.config.n_layers {
                self.source.capture_layer_input(il, &self.hidden, &mut self.features[at..], d);
                self.layer(il, false)?;
            }
            self.pending.retain(|p| p.next < model.config.n_layers);
            let n_layers = model.config.n_layers;
            self.source.capture_layer_input(n_layers, &self.hidden, &mut self.features[at..], d);
            self.normed.resize(n * d, 0.0);
            model.final_norm(&self.hidden, &mut self.normed);
            self.source.put_final_norm(&self.normed, &mut self.features[at..], d);
        }
        self.tokens.extend_from_slice(rest);
        self.tokens.push(last);
        self.stats.speculative.prefill_time += t0.elapsed();
        Ok(())
    }

    /// One step: drafts a tree, runs it with early exit, commits 1 to `depth + 1` tokens and returns them.
    pub fn step(&mut self) -> Result<&[u32], SpeculativeError> {
        self.step_at_most(usize::MAX)
    }

    /// Who drafted each accepted draft token of the last step, in order (then comes the bonus token).
    pub fn accepted_sources(&self) -> impl Iterator<Item = crate::speculative::DraftSource> + '_ {
        self.path.iter().skip(1).map(|&i| self.tree.source(i))
    }

    /// [`MergedDecoder::step`] committing at most `max_tokens` tokens (at least 1).
    pub fn step_at_most(&mut self, max_tokens: usize) -> Result<&[u32], SpeculativeError> {
        let first_new = self.tokens.len();
        self.run_step(max_tokens, None, None)?;
        Ok(&self.tokens[first_new..])
    }

    /// [`MergedDecoder::step_at_most`] under a grammar (`constraint` follows every committed token, the root
    /// already in it): drafts whose path the grammar forbids are dropped before the forward, a predictor's
    /// decision the grammar forbids is refused (the node stays undecided: [`MergedStats::grammar_vetoes`]), and
    /// where the last layer's full head decides, a forbidden top-1 is replaced by the best allowed token of that
    /// row's logits; at the grammar's end the step ends (its last token is the bonus). With predictors that
    /// never fire this is constrained eagle, i.e. constrained dense greedy decoding.
    pub fn step_constrained(
        &mut self,
        max_tokens: usize,
        constraint: &mut dyn TokenConstraint,
    ) -> Result<&[u32], SpeculativeError> {
        let first_new = self.tokens.len();
        self.run_step(max_tokens, None, Some(constraint))?;
        Ok(&self.tokens[first_new..])
    }

    /// Teacher forcing, for quality evaluation: one step whose tree is drafted from the context as usual, but
    /// whose commit is `next` alone (the true next token). Returns the token the mode chose after the root —
    /// the first token a free-running step would have committed. [`MergedDecoder::root_logits`] then gives
    /// the full-vocabulary logits at the layer where that choice was made.
    pub fn step_forced(&mut self, next: u32) -> Result<u32, SpeculativeError> {
        self.run_step(usize::MAX, Some(next), None)
    }

    /// Full-vocabulary logits of the last step's root at the layer its next token was decided (divided by that
    /// layer's exit temperature, [`ExitPredictors::calibrate`]).
    pub fn root_logits(&mut self) -> &[f32] {
        let v = self.model.config.vocab_size;
        self.logits.resize(v, 0.0);
        self.model.head_full(&self.root_normed, 1, &mut self.logits, &mut self.ws);
        if let Some((il, _)) = self.nodes.get(ROOT).and_then(|n| n.decided) {
            self.predictors.calibrate(il, &mut self.logits);
        }
        &self.logits
    }

    fn run_step(
        &mut self,
        max_tokens: usize,
        forced: Option<u32>,
        mut constraint: Option<&mut dyn TokenConstraint>,
    ) -> Result<u32, SpeculativeError> {
        let root = *self.tokens.last().ok_or(SpeculativeError::EmptyContext)?;
        let start = self.kv.len(0);
        let room = self.kv.capacity().saturating_sub(start);
        if room == 0 {
            return Err(ModelError::ContextFull { needed: start + 1, capacity: self.kv.capacity() }.into());
        }
        // 1. Draft the tree (cut to the room and the token limit) and every node's candidates.
        let t0 = Instant::now();
        self.tree.reset(root);
        let saved = self.proposer.tree;
        let limit = max_tokens.max(1) - 1;
        let budget = saved.budget.min(room - 1);
        self.proposer.tree = TreeConfig { depth: saved.depth.min(limit), budget, ..saved };
        // The lookup chain keeps its base length here: deep in a grown chain the head's candidates (read from its
        // own predicted features) are poor, and predictors trained on first-step candidates exit wrongly on them
        // (Gemma, plain-heldout: mean matching prefix 35 → 24 of 64 tokens with growth).
        let lookup_cap = limit.min(room - 1 - budget).min(self.proposer.lookup.base);
        let context = DraftContext {
            model: self.model,
            pool: self.ws.pool(),
            tokens: &self.tokens,
            features: &self.features,
            feature_width: self.source.width(self.model.config.n_embd),
            // The EAGLE head reads only the last feature row: it keeps no cache that a stable prefix would save.
            stable_prefix: 0,
        };
        let drafted = self.proposer.propose_with_candidates(
            &context,
            &mut self.tree,
            CANDIDATES,
            lookup_cap,
            &mut self.candidates,
        );
        self.proposer.tree = saved;
        drafted?;
        if let Some(c) = constraint.as_deref_mut() {
            self.retain_allowed(c);
        }
        let t1 = Instant::now();
        self.stats.speculative.draft_time += t1 - t0;

        // 2. The tree forward with early exit (on failure, every layer goes back to where it was).
        self.lens.clear();
        self.lens.extend((0..self.model.config.n_layers).map(|il| self.kv.len(il)));
        let forward = self.forward(start, reborrow(&mut constraint));
        let walked = match (forward, constraint) {
            (Ok(stop), Some(c)) => self.constrained_walk(c).map(|()| stop),
            (forward, _) => forward,
        };
        let stop = match walked {
            Ok(stop) => stop,
            Err(e) => {
                for (il, &n) in self.lens.iter().enumerate() {
                    self.kv.truncate_layer(il, n);
                }
                return Err(e);
            }
        };
        let chosen = self.nodes[ROOT].decided.map_or(self.bonus, |(_, t)| t);
        if let Some(next) = forced {
            self.path.clear();
            self.path.push(ROOT);
            self.bonus = next;
        }

        // 3. Commit: keep the root and the accepted path, handle their skipped layers.
        self.commit(start, stop)?;
        let s = &mut self.stats.speculative;
        s.verify_time += t1.elapsed();
        s.target_forwards += 1;
        s.committed_tokens += self.path.len();
        s.drafted_nodes += self.tree.len() - 1;
        s.accepted_drafts += self.path.len() - 1;
        Ok(chosen)
    }

    /// Runs the tree (root at position `start`) layer by layer until the accepted path is settled; leaves it
    /// in `path`/`bonus` and returns the last layer run.
    fn forward(
        &mut self,
        start: usize,
        mut constraint: Option<&mut dyn TokenConstraint>,
    ) -> Result<usize, SpeculativeError> {
        let model = self.model;
        let (d, n_layers) = (model.config.n_embd, model.config.n_layers);
        let t = self.tree.len();
        self.tree.ancestor_mask(&mut self.tree_mask);
        self.tree.positions(start as u32, &mut self.positions);
        self.ids.clear();
        self.ids.extend(self.tree.nodes().iter().map(|n| n.token));
        self.hidden.resize(t * d, 0.0);
        model.embed(&self.ids, &mut self.hidden)?;
        self.nodes.clear();
        self.nodes.resize(t, NodeState::default());
        let have_candidates = self.candidates.len() == t * CANDIDATES;
        self.carried.clear();
        self.node_features.resize(t * self.source.width(d), 0.0);
        for il in 0..n_layers {
            self.source.capture_layer_input(il, &self.hidden, &mut self.node_features, d);
            let last = il + 1 == n_layers;
            let check = self.scheduler.is_active(il) && !(last && self.config.verify == Verify::Full);
            let mlp = self.predictors.layers[il].as_ref().filter(|_| have_candidates && check);
            if mlp.is_some_and(|m| m.n_in > DRAFT_FEATURES) {
                self.hidden_in.clear();
                self.hidden_in.extend_from_slice(&self.hidden);
            }
            self.layer(il, true)?;
            if mlp.is_some() {
                self.evaluate(il, reborrow(&mut constraint))?;
            }
            if self.walk() {
                self.stats.layers += il + 1;
                self.stats.early_stops += 1;
                return Ok(il);
            }
        }
        self.decide_by_full_head(n_layers - 1);
        self.stats.layers += n_layers;
        Ok(n_layers - 1)
    }

    /// Layer `il` over `hidden` (the tree with its mask when `tree`, else causal rows), with the deferred rows
    /// due at this layer (earlier positions) in front of them in the same batch.
    fn layer(&mut self, il: usize, tree: bool) -> Result<(), ModelError> {
        for (i, p) in self.pending.iter().enumerate() {
            if p.next == il && !self.carried.contains(&i) {
                self.carried.push(i);
            }
        }
        let (model, d) = (self.model, self.model.config.n_embd);
        let mask = if tree { Mask::Allowed(&self.tree_mask) } else { Mask::Causal };
        if self.carried.is_empty() {
            return model.layer(il, &mut self.hidden, &self.positions, mask, &mut self.kv, &mut self.ws);
        }
        let pending = &mut self.pending;
        self.carried.sort_by_key(|&i| pending[i].pos);
        let (p, n) = (self.carried.len(), self.positions.len());
        self.batch.clear();
        self.batch_pos.clear();
        for &i in &self.carried {
            self.batch.extend_from_slice(&pending[i].hidden);
            self.batch_pos.push(pending[i].pos);
        }
        self.batch.extend_from_slice(&self.hidden);
        self.batch_pos.extend_from_slice(&self.positions);
        let mask = if tree {
            // Deferred rows see each other causally; tree rows see every deferred row and their ancestors.
            let m = p + n;
            self.batch_mask.clear();
            self.batch_mask.resize(m * m, false);
            for j in 0..m {
                let row = &mut self.batch_mask[j * m..(j + 1) * m];
                if j < p {
                    row[..=j].fill(true);
                } else {
                    row[..p].fill(true);
                    row[p..].copy_from_slice(&self.tree_mask[(j - p) * n..(j - p + 1) * n]);
                }
            }
            Mask::Allowed(&self.batch_mask)
        } else {
            Mask::Causal
        };
        model.layer(il, &mut self.batch, &self.batch_pos, mask, &mut self.kv, &mut self.ws)?;
        for (r, &i) in self.carried.iter().enumerate() {
            pending[i].hidden.copy_from_slice(&self.batch[r * d..(r + 1) * d]);
            pending[i].next = il + 1;
        }
        self.hidden.copy_from_slice(&self.batch[p * d..]);
        Ok(())
    }

    /// Evaluates layer `il`'s predictor on every undecided node (one grouped head-row product for all of them).
    fn evaluate(
        &mut self,
        il: usize,
        mut constraint: Option<&mut dyn TokenConstraint>,
    ) -> Result<(), SpeculativeError> {
        let Some(mlp) = self.predictors.layers[il].as_ref() else { return Ok(()) };
        let (model, d) = (self.model, self.model.config.n_embd);
        self.live.clear();
        self.live.extend((0..self.nodes.len()).filter(|&i| self.nodes[i].decided.is_none()));
        if self.live.is_empty() {
            return Ok(());
        }
        let k = CANDIDATES;
        self.normed.resize(self.live.len() * d, 0.0);
        self.ids.clear();
        for (r, &i) in self.live.iter().enumerate() {
            model.final_norm(&self.hidden[i * d..(i + 1) * d], &mut self.normed[r * d..(r + 1) * d]);
            self.ids.extend(self.candidates[i * k..(i + 1) * k].iter().map(|c| c.0));
        }
        self.scores.resize(self.ids.len(), 0.0);
        model.head_rows_grouped(&self.normed, &self.ids, k, &mut self.scores, &mut self.ws);
        for r in 0..self.live.len() {
            let i = self.live[r];
            let cand = &self.candidates[i * k..(i + 1) * k];
            let mut s = [0f32; CANDIDATES];
            let mut draft_lp = [0f32; CANDIDATES];
            s.copy_from_slice(&self.scores[r * k..(r + 1) * k]);
            for (lp, c) in draft_lp.iter_mut().zip(cand) {
                *lp = c.1;
            }
            let rows = i * d..(i + 1) * d;
            let update = if mlp.n_in > DRAFT_FEATURES {
                layer_update(&self.hidden_in[rows.clone()], &self.hidden[rows])
            } else {
                [1.0, 0.0]
            };
            let (x, p) = features(&s, self.nodes[i].p_prev.as_ref(), &draft_lp, &update);
            self.nodes[i].p_prev = Some(p);
            self.stats.predictor_calls += 1;
            if mlp.predict(&x) <= self.threshold {
                continue;
            }
            let row = &self.normed[r * d..(r + 1) * d];
            let token = match self.config.verify {
                Verify::Candidates => cand[(0..k).fold(0, |b, j| if s[j] > s[b] { j } else { b })].0,
                Verify::Full => {
                    let top = full_head_top1(model, row, &mut self.ws);
                    self.stats.full_head_rows += 1;
                    if !cand.iter().any(|c| c.0 == top) {
                        self.stats.verify_failures += 1;
                        continue;
                    }
                    top
                }
            };
            if let Some(c) = constraint.as_deref_mut() {
                // The node's path is valid (the tree was cut to the grammar): is its decision?
                self.tree.path_tokens(i, &mut self.path_tokens);
                self.path_tokens.push(token);
                if c.valid_prefix(&self.path_tokens) < self.path_tokens.len() {
                    self.stats.grammar_vetoes += 1;
                    continue;
                }
            }
            self.nodes[i].decided = Some((il, token));
            self.nodes[i].by_predictor = true;
            if i == ROOT {
                self.root_normed.clear();
                self.root_normed.extend_from_slice(row);
            }
        }
        Ok(())
    }

    /// Drops the drafts whose path `constraint` forbids, with their candidates.
    fn retain_allowed(&mut self, constraint: &mut dyn TokenConstraint) {
        let kept = self.tree.retain_allowed(constraint);
        if self.candidates.is_empty() || kept.iter().all(|&k| k) {
            return;
        }
        let mut j = 0;
        for (i, _) in kept.iter().enumerate().filter(|(_, &k)| k) {
            self.candidates.copy_within(i * CANDIDATES..(i + 1) * CANDIDATES, j * CANDIDATES);
            j += 1;
        }
        self.candidates.truncate(j * CANDIDATES);
    }

    /// After a forward under a grammar: the walk again from the root, committing each token to `constraint`;
    /// a decision the grammar forbids (the last layer's full head: predictors' were checked) becomes the best
    /// allowed token of the node's full logits; the walk ends where the grammar does.
    fn constrained_walk(&mut self, constraint: &mut dyn TokenConstraint) -> Result<(), SpeculativeError> {
        let (model, d, v) = (self.model, self.model.config.n_embd, self.model.config.vocab_size);
        self.path.clear();
        let mut i = ROOT;
        loop {
            self.path.push(i);
            let Some((_, decided)) = self.nodes[i].decided else { unreachable!("the walk ended on a decided node") };
            let (hidden, normed, ws, stats) = (&self.hidden, &mut self.normed, &mut self.ws, &mut self.stats);
            let full = |out: &mut Vec<f32>| {
                normed.resize(d, 0.0);
                model.final_norm(&hidden[i * d..(i + 1) * d], &mut normed[..d]);
                out.resize(v, 0.0);
                model.head_full(&normed[..d], 1, out, ws);
                stats.full_head_rows += 1;
            };
            let token = constrained_argmax(decided, constraint, full, &mut self.logits)?;
            constraint.commit(token)?;
            let child = self.tree.children(i).find(|&c| self.tree.node(c).token == token);
            match child.filter(|_| !constraint.is_finished()) {
                Some(c) if self.nodes[c].decided.is_some() => i = c,
                _ => {
                    self.bonus = token;
                    return Ok(());
                }
            }
        }
    }

    /// Walks from the root along decided tokens into matching children, leaving the walk in `path`. Returns
    /// whether it ended with a decision that is not a child (the bonus token, left in `bonus`).
    fn walk(&mut self) -> bool {
        self.path.clear();
        let mut i = ROOT;
        loop {
            self.path.push(i);
            let Some((_, token)) = self.nodes[i].decided else { return false };
            match self.tree.children(i).find(|&c| self.tree.node(c).token == token) {
                Some(c) => i = c,
                None => {
                    self.bonus = token;
                    return true;
                }
            }
        }
    }

    /// At the last layer (`layer`): the full head decides every node still undecided, in one batched product
    /// (the walk needs some of them; a batch of a few rows costs little more than one row, which reads the
    /// whole head), then the walk ends.
    fn decide_by_full_head(&mut self, layer: usize) {
        let (model, d) = (self.model, self.model.config.n_embd);
        self.live.clear();
        self.live.extend((0..self.nodes.len()).filter(|&i| self.nodes[i].decided.is_none()));
        let n = self.live.len();
        self.normed.resize(n * d, 0.0);
        for (r, &i) in self.live.iter().enumerate() {
            model.final_norm(&self.hidden[i * d..(i + 1) * d], &mut self.normed[r * d..(r + 1) * d]);
        }
        self.top.resize(n, 0);
        model.head_argmax(&self.normed, n, &mut self.top, &mut self.ws);
        self.stats.full_head_rows += n;
        for (r, &i) in self.live.iter().enumerate() {
            self.nodes[i].decided = Some((layer, self.top[r]));
            if i == ROOT {
                self.root_normed.clear();
                self.root_normed.extend_from_slice(&self.normed[r * d..(r + 1) * d]);
            }
        }
        let ended = self.walk();
        debug_assert!(ended, "every node is decided");
    }

    /// Keeps the root and the accepted path in the cache (layers `0..=stop` hold the tree as their last
    /// slots), stores their draft features, gives their skipped layers what the KV policy says and commits
    /// the path's tokens and the bonus.
    fn commit(&mut self, start: usize, stop: usize) -> Result<(), SpeculativeError> {
        let model = self.model;
        let (d, n_layers) = (model.config.n_embd, model.config.n_layers);
        let t = self.tree.len();
        for il in 0..=stop {
            let n = self.kv.len(il);
            self.kv.compact_layer(il, n - t, &self.path);
        }
        self.batch.clear();
        self.batch_pos.clear();
        for &i in &self.path {
            self.batch.extend_from_slice(&self.hidden[i * d..(i + 1) * d]);
            self.batch_pos.push((start + self.tree.node(i).depth) as u32);
        }
        let (at, width) = (self.features.len(), self.source.width(d));
        for &i in &self.path {
            self.features.extend_from_slice(&self.node_features[i * width..(i + 1) * width]);
        }
        for il in stop + 1..=n_layers {
            self.source.capture_layer_input(il, &self.batch, &mut self.features[at..], d);
        }
        self.normed.resize(self.path.len() * d, 0.0);
        model.final_norm(&self.batch, &mut self.normed);
        self.source.put_final_norm(&self.normed, &mut self.features[at..], d);
        if stop + 1 < n_layers {
            match self.config.policy {
                KvPolicy::Missing => {}
                KvPolicy::Propagate => {
                    for il in stop + 1..n_layers {
                        model.layer_kv(il, &self.batch, &self.batch_pos, &mut self.kv, &mut self.ws)?;
                    }
                }
                KvPolicy::Deferred => {
                    for (r, &pos) in self.batch_pos.iter().enumerate() {
                        let hidden = self.batch[r * d..(r + 1) * d].to_vec();
                        self.pending.push(Pending { hidden, pos, next: stop + 1 });
                    }
                }
            }
        }
        self.pending.retain(|p| p.next < n_layers);
        for &i in &self.path {
            if let NodeState { decided: Some((layer, _)), by_predictor: true, .. } = self.nodes[i] {
                self.scheduler.record_exit(layer);
            }
        }
        for r in 1..self.path.len() {
            self.tokens.push(self.tree.node(self.path[r]).token);
        }
        self.tokens.push(self.bonus);
        Ok(())
    }
}

/// A shorter-lived borrow of an optional grammar (the trait object's lifetime shortened with it).
fn reborrow<'a>(c: &'a mut Option<&mut dyn TokenConstraint>) -> Option<&'a mut dyn TokenConstraint> {
    match c {
        Some(c) => Some(&mut **c),
        None => None,
    }
}

/// The full head's top-1 for one normed row (through the head screen).
fn full_head_top1(model: &Model, normed: &[f32], ws: &mut Workspace) -> u32 {
    let mut t = [0u32];
    model.head_argmax(normed, 1, &mut t, ws);
    t[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::argmax;
    use crate::specee::predictor::tests::random_predictors;
    use crate::specee::SpecEeDecoder;
    use crate::speculative::eagle::tests::{random_fused_head_bytes, random_head_bytes};
    use crate::test_util::{dense_greedy, PROMPT};

    fn head() -> DraftHead {
        DraftHead::from_bytes(&random_head_bytes(32, 64, 32, 5)).unwrap()
    }

    fn generate(dec: &mut MergedDecoder<'_>, n: usize) -> Vec<u32> {
        dec.feed(&PROMPT).unwrap();
        let mut out = Vec::new();
        while out.len() < n {
            out.extend_from_slice(dec.step_at_most(n - out.len()).unwrap());
        }
        out
    }

    #[test]
    fn never_exiting_is_lossless_tree_decoding() {
        for arch in ["llama", "gemma3"] {
            let model = model::testing::tiny_model(arch, None, 11, 64);
            let predictors = random_predictors(model.config.n_layers, 16, 3);
            let want = dense_greedy(&model, 30);
            let tree = TreeConfig { depth: 3, top_k: 2, budget: 5, min_prob: 0.0 };
            let mut accepted = [0; 2];
            for (verify, lookup) in [(Verify::Candidates, 0), (Verify::Full, 0), (Verify::Candidates, 3)] {
                let config = SpecEeConfig { threshold: Some(2.0), verify, ..Default::default() };
                let mut dec = MergedDecoder::new(&model, 128, 2, head(), tree, &predictors, config).with_lookup(lookup);
                let got = generate(&mut dec, want.len());
                assert_eq!(got, want, "{arch} {verify:?} lookup {lookup}");
                let st = *dec.stats();
                assert!(st.speculative.drafted_nodes > 0 && st.predictor_calls > 0);
                accepted[(lookup > 0) as usize] = st.speculative.accepted_drafts;
                assert_eq!(st.early_stops, 0);
                assert_eq!(st.layers, st.speculative.target_forwards * model.config.n_layers);
                // Nodes decided by a predictor need no full head row.
                assert!(st.full_head_rows <= st.speculative.target_forwards + st.speculative.drafted_nodes);
                assert!(st.full_head_rows >= st.speculative.committed_tokens);
            }
            // The random head is rarely right; the tiny model repeats itself, which the lookup chain catches.
            assert!(accepted[1] > accepted[0], "{arch}: accepted drafts without and with lookup: {accepted:?}");
        }
    }

    #[test]
    fn under_a_grammar_drafts_and_decisions_it_forbids_are_dropped_and_never_exiting_is_constrained_dense() {
        use crate::constraint::tests::{dense_constrained, modular, Script};
        use crate::constraint::TokenConstraint;
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let predictors = random_predictors(model.config.n_layers, 16, 3);
        let len = 30;
        let want = dense_constrained(&model, modular(len));
        let tree = TreeConfig { depth: 3, top_k: 2, budget: 6, min_prob: 0.0 };
        let run = |config: SpecEeConfig, lookup: usize, mut c: Script| {
            let mut dec = MergedDecoder::new(&model, 128, 2, head(), tree, &predictors, config).with_lookup(lookup);
            dec.feed(&PROMPT).unwrap();
            let mut out = Vec::new();
            while !c.is_finished() {
                out.extend_from_slice(dec.step_constrained(usize::MAX, &mut c).unwrap());
            }
            assert_eq!(out, c.committed, "the grammar follows every committed token");
            (out, *dec.stats())
        };
        for lookup in [0, 3] {
            let never = SpecEeConfig { threshold: Some(2.0), ..Default::default() };
            let (got, st) = run(never, lookup, modular(len));
            assert_eq!(got, want, "never exiting: constrained dense (lookup {lookup})");
            assert_eq!((st.early_stops, st.grammar_vetoes), (0, 0));
            assert!(st.speculative.drafted_nodes > 0);
            for verify in [Verify::Candidates, Verify::Full] {
                let always = SpecEeConfig { threshold: Some(-1.0), verify, ..Default::default() };
                let (got, st) = run(always, lookup, modular(len));
                assert_eq!(got.len(), len, "{verify:?} lookup {lookup}: ends with the grammar");
                // (The random head's candidates rarely hold the full head's top-1: `Full` seldom stops early.)
                let stopped = verify == Verify::Full || st.early_stops > 0;
                assert!(st.grammar_vetoes > 0 && stopped, "{verify:?} lookup {lookup}: {st:?}");
            }
        }
        // A root-only tree under a grammar is constrained SpecEE, token for token.
        let root_only = TreeConfig { depth: 0, top_k: 1, budget: 0, min_prob: 0.0 };
        let h = head();
        for threshold in [0.3, 0.5, -1.0] {
            let config = SpecEeConfig { threshold: Some(threshold), ..Default::default() };
            let mut specee = SpecEeDecoder::new(&model, 128, 2, &h, &predictors, config);
            let want = super::super::decoder::tests::specee_constrained(&mut specee, modular(len));
            let mut merged = MergedDecoder::new(&model, 128, 2, h.clone(), root_only, &predictors, config);
            let mut c = modular(len);
            let mut ids = PROMPT.to_vec();
            ids.push(want[0]);
            c.commit(want[0]).unwrap();
            merged.feed(&ids).unwrap();
            let mut got = vec![want[0]];
            while !c.is_finished() {
                got.extend_from_slice(merged.step_constrained(usize::MAX, &mut c).unwrap());
            }
            assert_eq!(got, want, "threshold {threshold}");
            assert_eq!(specee.stats().grammar_vetoes, merged.stats().grammar_vetoes, "threshold {threshold}");
        }
    }

    /// With a tree of only the root, merged mapping is SpecEE: same candidates, features, exits and KV.
    #[test]
    fn root_only_trees_equal_specee_decoding() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let n_layers = model.config.n_layers;
        let predictors = random_predictors(n_layers, 16, 3);
        // The fused head reads layer 1's and 2's inputs: tokens exiting at layer 0 or 1 stand in their exit state.
        let fused = DraftHead::from_bytes(&random_fused_head_bytes(32, 64, 32, 5, &[1, 2])).unwrap();
        let mut checked_exits = 0;
        for (h, verify) in [(head(), Verify::Candidates), (head(), Verify::Full), (fused, Verify::Candidates)] {
            for policy in [KvPolicy::Missing, KvPolicy::Propagate, KvPolicy::Deferred] {
                for threshold in [0.3, 0.5, 0.7] {
                    let config = SpecEeConfig { policy, verify, threshold: Some(threshold), offline_only: false };
                    let mut specee = SpecEeDecoder::new(&model, 128, 2, &h, &predictors, config);
                    let mut want = vec![specee.feed(&PROMPT).unwrap()];
                    for _ in 0..16 {
                        want.push(specee.step(*want.last().unwrap(), false).unwrap().token);
                    }
                    let tree = TreeConfig { depth: 0, top_k: 1, budget: 0, min_prob: 0.0 };
                    let mut merged = MergedDecoder::new(&model, 128, 2, h.clone(), tree, &predictors, config);
                    // SpecEE's `feed` runs the whole prompt and picks the first token densely.
                    let mut ids = PROMPT.to_vec();
                    ids.push(want[0]);
                    merged.feed(&ids).unwrap();
                    let mut got = vec![want[0]];
                    while got.len() < want.len() {
                        got.extend_from_slice(merged.step().unwrap());
                    }
                    let fused = !h.feature_source().eq(&FeatureSource::FinalNorm);
                    let what = format!("{verify:?} {policy:?} threshold {threshold} fused {fused}");
                    assert_eq!(got, want, "{what}");
                    let (a, b) = (specee.stats(), merged.stats());
                    assert_eq!(a.layers, b.layers, "{what}");
                    assert_eq!(a.predictor_calls, b.predictor_calls, "{what}");
                    assert_eq!(a.verify_failures, b.verify_failures, "{what}");
                    for il in 0..n_layers {
                        assert_eq!(specee.kv().len(il), merged.kv().len(il), "{what} layer {il}");
                    }
                    checked_exits += a.exits;
                }
            }
        }
        assert!(checked_exits > 20, "the thresholds should make tokens exit ({checked_exits} exits)");
    }

    #[test]
    fn exits_inside_the_tree_commit_candidates_and_keep_the_cache_consistent() {
        let model = model::testing::tiny_model("gemma3", None, 11, 64);
        let n_layers = model.config.n_layers;
        let predictors = random_predictors(n_layers, 16, 3);
        let tree = TreeConfig { depth: 3, top_k: 2, budget: 6, min_prob: 0.0 };
        let policies = [KvPolicy::Missing, KvPolicy::Propagate, KvPolicy::Deferred];
        // The lookup chain's nodes carry candidates too (else no node could be decided before the last layer).
        for (policy, lookup) in policies.into_iter().map(|p| (p, 0)).chain([(KvPolicy::Deferred, 3)]) {
            let config = SpecEeConfig { policy, threshold: Some(-1.0), offline_only: true, ..Default::default() };
            let mut dec = MergedDecoder::new(&model, 128, 2, head(), tree, &predictors, config).with_lookup(lookup);
            let out = generate(&mut dec, 24);
            let st = *dec.stats();
            // Threshold −1: every node is decided at the first evaluated layer, so every forward stops there.
            assert_eq!(st.early_stops, st.speculative.target_forwards, "{policy:?} lookup {lookup}");
            assert_eq!(st.full_head_rows, 0);
            assert!(st.layers < st.speculative.target_forwards * n_layers);
            assert!(out.len() >= 24);
            let len0 = dec.kv().len(0);
            assert_eq!(len0, dec.tokens().len() - 1, "layer 0 holds every committed token but the root");
            let last = dec.kv().len(n_layers - 1);
            match policy {
                KvPolicy::Propagate => assert_eq!(last, len0),
                _ => assert!(last < len0, "{policy:?}: rows that stopped early are not in the last layer"),
            }
            for il in 0..n_layers {
                let pos = dec.kv().positions(il);
                assert!(pos.windows(2).all(|w| w[0] < w[1]), "{policy:?} layer {il}: {pos:?}");
            }
        }
        // Deferred: once forwards run every layer again, the rows that stopped early are completed.
        let config = SpecEeConfig { threshold: Some(-1.0), offline_only: true, ..Default::default() };
        let mut dec = MergedDecoder::new(&model, 128, 2, head(), tree, &predictors, config);
        generate(&mut dec, 12);
        dec.set_threshold(2.0);
        dec.step().unwrap();
        for il in 0..n_layers {
            assert_eq!(dec.kv().len(il), dec.tokens().len() - 1, "layer {il}");
        }
    }

    #[test]
    fn forced_steps_commit_the_given_token_and_report_the_choice() {
        let model = model::testing::tiny_model("llama", None, 11, 64);
        let predictors = random_predictors(model.config.n_layers, 16, 3);
        let want = dense_greedy(&model, 12);
        let config = SpecEeConfig { threshold: Some(2.0), ..Default::default() };
        let tree = TreeConfig { depth: 2, top_k: 2, budget: 3, min_prob: 0.0 };
        let mut dec = MergedDecoder::new(&model, 128, 2, head(), tree, &predictors, config);
        dec.feed(&PROMPT).unwrap();
        // Feed a wrong token at every step: the choice must still be dense greedy's on the forced context.
        let mut ctx = PROMPT.to_vec();
        for j in 0..6 {
            let chosen = dec.step_forced(j as u32 + 1).unwrap();
            let mut dense = crate::DenseDecoder::new(&model, 128, 2);
            let logits = dense.feed_all_logits(&ctx).unwrap();
            let row = &logits[(ctx.len() - 1) * 64..ctx.len() * 64];
            assert_eq!(chosen, argmax(row), "step {j}");
            let got = dec.root_logits().to_vec();
            assert!(got.iter().zip(row).all(|(a, b)| (a - b).abs() < 1e-3), "step {j}: root logits");
            ctx.push(j as u32 + 1);
            assert_eq!(dec.tokens(), &ctx[..]);
        }
        assert_eq!(want.len(), 12);
    }
}
