//! Drafting with a published head: its one decoder layer over a batch of rows with its own KV cache, and the
//! [`Proposer`] that grows EAGLE-2 dynamic trees with it.
//!
//! Row `i` of the committed sequence pairs the target's feature of token `i` with token `i + 1`, at position
//! `i`; its keys stay cached while the committed tokens do ([`DraftContext::stable_prefix`]). The first expansion
//! of each tree runs the rows committed since the last call (the last of them is the root's row); each later
//! depth runs the frontier nodes, a node at depth `k` at position `root_row + k`, attending to every committed
//! row, its ancestors' rows and itself.

use super::{EagleVersion, PublishedHead, PublishedHeadError};
use crate::speculative::eagle::top_k_log_probs;
use crate::speculative::ngram::LookupChain;
use crate::speculative::proposer::{DraftContext, FeatureSource, Proposer};
use crate::speculative::tree::{build_dynamic_tree, DraftTree, TreeConfig};
use crate::speculative::SpeculativeError;
use kernels::{matmul, matmul_many, MatmulScratch, ThreadPool};
use model::blocks::{glu_in_place, rms_norm, rope_angles, rope_apply, softmax_in_place};
use model::{Model, RopeStyle};

/// Where a batch's input features come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Input {
    /// The target's feature rows (EAGLE-3: the fused layer inputs, `3d` wide).
    Target,
    /// A parent node's output `h` (`d` wide).
    Draft,
}

/// Buffers of one batch.
#[derive(Default)]
struct Scratch {
    emb: Vec<f32>,
    cat: Vec<f32>,
    g: Vec<f32>,
    a: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    normed: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    scores: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    mm: MatmulScratch,
}

/// The head's KV cache: committed rows first, then the current tree's node rows.
#[derive(Default)]
struct DraftCache {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Committed rows held (their keys are valid while the committed tokens are).
    committed: usize,
}

/// One batch: `rows` rows, each with a token, an input feature, a position and the cache slots it attends to
/// (`keys[key_start[r]..key_start[r + 1]]`, its own slot included). The rows' keys go to the cache's end.
struct Batch<'a> {
    input: Input,
    tokens: &'a [u32],
    features: &'a [f32],
    positions: &'a [u32],
    keys: &'a [u32],
    key_start: &'a [usize],
}

impl PublishedHead {
    /// Runs one batch; appends its keys and values to `cache`; leaves each row's output `h` in `out` (`m × d`)
    /// and its draft logits in `logits` (`m ×` [`PublishedHead::draft_vocab`]).
    fn run(
        &self,
        model: &Model,
        pool: &ThreadPool,
        batch: &Batch<'_>,
        cache: &mut DraftCache,
        s: &mut Scratch,
        out: &mut Vec<f32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), SpeculativeError> {
        let m = batch.tokens.len();
        let d = self.n_embd;
        let (hd, nh, nkv) = (self.head_dim, self.n_head, self.n_head_kv);
        let (qd, kvd) = (nh * hd, nkv * hd);
        s.emb.resize(m * d, 0.0);
        model.embed(batch.tokens, &mut s.emb)?;

        // g: the layer's residual input; a: its attention input.
        s.g.resize(m * d, 0.0);
        let fw = batch.features.len() / m.max(1);
        match (self.version, batch.input) {
            (EagleVersion::Eagle1, _) => {
                s.cat.resize(m * 2 * d, 0.0);
                for r in 0..m {
                    let row = &mut s.cat[r * 2 * d..(r + 1) * 2 * d];
                    row[..d].copy_from_slice(&s.emb[r * d..(r + 1) * d]);
                    row[d..].copy_from_slice(&batch.features[r * fw..(r + 1) * fw]);
                }
                matmul(pool, &self.fc.view(), &s.cat, m, &mut s.g, &mut s.mm);
            }
            (EagleVersion::Eagle3, Input::Target) => {
                matmul(pool, &self.fc.view(), &batch.features[..m * fw], m, &mut s.g, &mut s.mm);
            }
            (EagleVersion::Eagle3, Input::Draft) => s.g.copy_from_slice(&batch.features[..m * d]),
        }
        if let (Some(b), true) = (&self.fc_bias, self.version == EagleVersion::Eagle1 || batch.input == Input::Target) {
            s.g.chunks_exact_mut(d).for_each(|row| row.iter_mut().zip(b).for_each(|(x, b)| *x += b));
        }
        // EAGLE-1 attends from g itself; EAGLE-3 from [norm(emb); norm(g)] built in `s.a`.
        let a_width = match self.version {
            EagleVersion::Eagle1 => d,
            EagleVersion::Eagle3 => {
                s.a.resize(m * 2 * d, 0.0);
                for r in 0..m {
                    let row = &mut s.a[r * 2 * d..(r + 1) * 2 * d];
                    let (e, h) = row.split_at_mut(d);
                    rms_norm(&s.emb[r * d..(r + 1) * d], &self.input_norm, self.rms_eps, e);
                    rms_norm(&s.g[r * d..(r + 1) * d], &self.hidden_norm, self.rms_eps, h);
                }
                2 * d
            }
        };

        // Q, K, V, RoPE (Hugging Face rotate-half layout), then into the cache.
        s.q.resize(m * qd, 0.0);
        s.k.resize(m * kvd, 0.0);
        s.v.resize(m * kvd, 0.0);
        let (wq, wk, wv) = (self.q.view(), self.k.view(), self.v.view());
        let a = if self.version == EagleVersion::Eagle1 { &s.g[..] } else { &s.a[..m * a_width] };
        matmul_many(pool, &mut [(&wq, &mut s.q[..]), (&wk, &mut s.k[..]), (&wv, &mut s.v[..])], a, m, &mut s.mm);
        if let Some([bq, bk, bv]) = &self.qkv_bias {
            for (buf, b) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                buf.chunks_exact_mut(b.len()).for_each(|row| row.iter_mut().zip(b).for_each(|(x, b)| *x += b));
            }
        }
        s.cos.resize(hd / 2, 0.0);
        s.sin.resize(hd / 2, 0.0);
        for r in 0..m {
            rope_angles(batch.positions[r], &self.inv_freq, &mut s.cos, &mut s.sin);
            for h in s.q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                rope_apply(h, &s.cos, &s.sin, RopeStyle::Neox);
            }
            for h in s.k[r * kvd..(r + 1) * kvd].chunks_exact_mut(hd) {
                rope_apply(h, &s.cos, &s.sin, RopeStyle::Neox);
            }
        }
        cache.k.extend_from_slice(&s.k);
        cache.v.extend_from_slice(&s.v);

        // Attention over each row's own slots.
        s.att.resize(m * qd, 0.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        for r in 0..m {
            let slots = &batch.keys[batch.key_start[r]..batch.key_start[r + 1]];
            for h in 0..nh {
                let q = &s.q[r * qd + h * hd..r * qd + (h + 1) * hd];
                let kvh = h / group;
                s.scores.clear();
                s.scores.extend(slots.iter().map(|&j| {
                    let k = &cache.k[j as usize * kvd + kvh * hd..j as usize * kvd + (kvh + 1) * hd];
                    q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale
                }));
                softmax_in_place(&mut s.scores);
                let o = &mut s.att[r * qd + h * hd..r * qd + (h + 1) * hd];
                o.fill(0.0);
                for (&j, &p) in slots.iter().zip(&s.scores) {
                    let v = &cache.v[j as usize * kvd + kvh * hd..j as usize * kvd + (kvh + 1) * hd];
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
                }
            }
        }
        s.o.resize(m * d, 0.0);
        matmul(pool, &self.o.view(), &s.att, m, &mut s.o, &mut s.mm);
        out.clear();
        out.extend(s.g.iter().zip(&s.o).map(|(g, o)| g + o));

        // Feed-forward block.
        s.normed.resize(m * d, 0.0);
        for r in 0..m {
            rms_norm(&out[r * d..(r + 1) * d], &self.post_norm, self.rms_eps, &mut s.normed[r * d..(r + 1) * d]);
        }
        let f = self.n_ff;
        s.gate.resize(m * f, 0.0);
        s.up.resize(m * f, 0.0);
        let (gate, up) = (self.gate.view(), self.up.view());
        matmul_many(pool, &mut [(&gate, &mut s.gate[..]), (&up, &mut s.up[..])], &s.normed, m, &mut s.mm);
        glu_in_place(model::Activation::Silu, &mut s.gate, &s.up);
        s.o.resize(m * d, 0.0);
        matmul(pool, &self.down.view(), &s.gate, m, &mut s.o, &mut s.mm);
        out.iter_mut().zip(&s.o).for_each(|(x, o)| *x += o);

        // Draft logits.
        match (&self.lm_head, self.version) {
            (Some(head), EagleVersion::Eagle3) => {
                for r in 0..m {
                    rms_norm(&out[r * d..(r + 1) * d], &self.norm, self.rms_eps, &mut s.normed[r * d..(r + 1) * d]);
                }
                logits.resize(m * head.rows, 0.0);
                matmul(pool, &head.view(), &s.normed, m, logits, &mut s.mm);
            }
            _ => {
                let head = model.output_matrix();
                logits.resize(m * head.rows, 0.0);
                matmul(pool, &head, out, m, logits, &mut s.mm);
            }
        }
        Ok(())
    }
}

/// Drafts EAGLE-2 dynamic trees with a [`PublishedHead`].
pub struct PublishedProposer {
    head: PublishedHead,
    features: FeatureSource,
    /// Tree sizes.
    pub tree: TreeConfig,
    /// The prompt-lookup chain added to each tree (base length 0: none), as `--mode eagle` adds to our own heads'
    /// trees ([`crate::speculative::EagleProposer::with_lookup`]).
    pub lookup: LookupChain,
    cache: DraftCache,
    scratch: Scratch,
    /// Per pool node of the current tree: its cache slot and output `h` (`d` floats).
    node_slot: Vec<u32>,
    node_h: Vec<f32>,
    tokens: Vec<u32>,
    inputs: Vec<f32>,
    positions: Vec<u32>,
    keys: Vec<u32>,
    key_start: Vec<usize>,
    out: Vec<f32>,
    logits: Vec<f32>,
    order: Vec<u32>,
}

impl PublishedProposer {
    /// A proposer drafting with `head` for `model` (checked to fit).
    pub fn new(head: PublishedHead, model: &Model, tree: TreeConfig) -> Result<PublishedProposer, PublishedHeadError> {
        head.check_fits(model)?;
        let features = head.feature_source(model);
        Ok(PublishedProposer {
            head,
            features,
            tree,
            lookup: LookupChain::default(),
            cache: DraftCache::default(),
            scratch: Scratch::default(),
            node_slot: Vec::new(),
            node_h: Vec::new(),
            tokens: Vec::new(),
            inputs: Vec::new(),
            positions: Vec::new(),
            keys: Vec::new(),
            key_start: Vec::new(),
            out: Vec::new(),
            logits: Vec::new(),
            order: Vec::new(),
        })
    }

    /// Also drafts the greedy prompt-lookup chain of `depth` tokens ([`LookupChain`]) beside the head's tree.
    pub fn with_lookup(mut self, depth: usize) -> PublishedProposer {
        self.lookup = LookupChain::new(depth);
        self
    }

    /// Default tree sizes for published heads: EAGLE-2's shape shrunk for a small CPU (depth 4, top-4, 10 nodes).
    /// Not tuned by measurement: no published head exists for the default models.
    pub fn default_tree() -> TreeConfig {
        TreeConfig { depth: 4, top_k: 4, budget: 10, min_prob: 0.0 }
    }

    /// The head.
    pub fn head(&self) -> &PublishedHead {
        &self.head
    }
}

impl Proposer for PublishedProposer {
    fn feature_source(&self) -> FeatureSource {
        self.features.clone()
    }

    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        let n = context.tokens.len();
        if n < 2 {
            return Ok(());
        }
        let d = self.head.n_embd;
        let (kvd, fw) = (self.head.n_head_kv * self.head.head_dim, context.feature_width);
        // Committed rows whose tokens and features are unchanged keep their keys; the root's row is always rerun
        // (its output starts the tree).
        let keep = self.cache.committed.min(context.stable_prefix.saturating_sub(1)).min(n - 2);
        self.cache.k.truncate(keep * kvd);
        self.cache.v.truncate(keep * kvd);
        self.cache.committed = keep;
        let (model, pool) = (context.model, context.pool);
        let root_row = (n - 2) as u32;
        let PublishedProposer {
            head,
            tree: config,
            cache,
            scratch,
            node_slot,
            node_h,
            tokens,
            inputs,
            positions,
            keys,
            key_start,
            out,
            logits,
            order,
            ..
        } = self;
        let vocab = head.draft_vocab(model);
        build_dynamic_tree(config, tree, |pool_tree, frontier, children| {
            tokens.clear();
            inputs.clear();
            positions.clear();
            keys.clear();
            key_start.clear();
            key_start.push(0);
            let input = if frontier == [0] {
                // The committed rows not cached yet, causally; the last one is the root's.
                cache.k.truncate(cache.committed * kvd);
                cache.v.truncate(cache.committed * kvd);
                for i in cache.committed..n - 1 {
                    tokens.push(context.tokens[i + 1]);
                    inputs.extend_from_slice(&context.features[i * fw..(i + 1) * fw]);
                    positions.push(i as u32);
                    keys.extend(0..=i as u32);
                    key_start.push(keys.len());
                }
                Input::Target
            } else {
                let base = cache.k.len() / kvd;
                for (r, &v) in frontier.iter().enumerate() {
                    let node = pool_tree.node(v);
                    tokens.push(node.token);
                    inputs.extend_from_slice(&node_h[node.parent * d..(node.parent + 1) * d]);
                    positions.push(root_row + node.depth as u32);
                    keys.extend(0..cache.committed as u32);
                    let mut a = node.parent;
                    while a != 0 {
                        keys.push(node_slot[a]);
                        a = pool_tree.node(a).parent;
                    }
                    keys.push((base + r) as u32);
                    key_start.push(keys.len());
                }
                Input::Draft
            };
            let batch = Batch { input, tokens, features: inputs, positions, keys, key_start };
            let first_slot = cache.k.len() / kvd;
            head.run(model, pool, &batch, cache, scratch, out, logits)?;
            let m = tokens.len();
            if input == Input::Target {
                cache.committed = n - 1;
            }
            // Results by pool index: the root's are its row (the batch's last); tree nodes' are theirs.
            let needed = pool_tree.len();
            node_slot.resize(needed.max(node_slot.len()), 0);
            node_h.resize((needed * d).max(node_h.len()), 0.0);
            let rows: Vec<(usize, usize)> =
                if input == Input::Target { vec![(0, m - 1)] } else { frontier.iter().copied().zip(0..m).collect() };
            for &(v, r) in &rows {
                node_slot[v] = (first_slot + r) as u32;
                node_h[v * d..(v + 1) * d].copy_from_slice(&out[r * d..(r + 1) * d]);
                let mut kids = Vec::with_capacity(config.top_k);
                top_k_log_probs(&logits[r * vocab..(r + 1) * vocab], config.top_k, order, &mut kids);
                if head.version == EagleVersion::Eagle3 {
                    kids.iter_mut().for_each(|kid| kid.0 = head.d2t[kid.0 as usize]);
                }
                children.push(kids);
            }
            Ok::<(), SpeculativeError>(())
        })?;
        // The decoder cuts the tree to its room and token limit.
        self.lookup.extend(context.tokens, tree, usize::MAX);
        Ok(())
    }
}
