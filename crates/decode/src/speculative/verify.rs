//! The verifier role: runs the target model over a whole draft tree in one batched forward through the per-layer
//! step API — rows `[root, nodes…]`, node `i` at position `root + depth(i)`, attending to the cache and to its own
//! ancestors only ([`model::Mask::Allowed`] with [`DraftTree::ancestor_mask`]) — and returns full-vocabulary
//! logits for every row. Also runs plain causal prefills the same way, so the feature rows a proposer asks for
//! ([`FeatureSource`]) are captured on both paths.

use super::proposer::FeatureSource;
use super::tree::DraftTree;
use model::{KvCache, Mask, Model, ModelError, Workspace};

/// Buffers of the target forward (they grow to the largest batch and are reused).
#[derive(Debug, Default)]
pub struct Verifier {
    mask: Vec<bool>,
    positions: Vec<u32>,
    tokens: Vec<u32>,
    hidden: Vec<f32>,
    normed: Vec<f32>,
    logits: Vec<f32>,
    /// Greedy tokens of the rows of the last greedy verification.
    greedy: Vec<u32>,
    /// Feature rows of the last forward (`rows × feature_width`).
    features: Vec<f32>,
}

/// What the head computes after a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Head {
    None,
    Logits,
    Greedy,
}

impl Verifier {
    /// Runs `tree` (root at position `kv.seq_len()`) through the target, appending one KV slot per node after
    /// the cache's current end, and returns `tree.len() × vocab` logits. Feature rows of every node are then in
    /// [`Verifier::features`].
    pub fn verify_tree(
        &mut self,
        model: &Model,
        tree: &DraftTree,
        kv: &mut KvCache,
        ws: &mut Workspace,
        features: &FeatureSource,
    ) -> Result<&[f32], ModelError> {
        self.run_tree(model, tree, kv, ws, features, Head::Logits)?;
        Ok(&self.logits)
    }

    /// [`Verifier::verify_tree`] for greedy settings without a repetition penalty: returns the target's greedy
    /// token after every node (`tree.len()` ids, from [`Model::head_argmax`]: the argmax of the logits
    /// `verify_tree` would return, without computing them).
    pub fn verify_tree_greedy(
        &mut self,
        model: &Model,
        tree: &DraftTree,
        kv: &mut KvCache,
        ws: &mut Workspace,
        features: &FeatureSource,
    ) -> Result<&[u32], ModelError> {
        self.run_tree(model, tree, kv, ws, features, Head::Greedy)?;
        Ok(&self.greedy)
    }

    fn run_tree(
        &mut self,
        model: &Model,
        tree: &DraftTree,
        kv: &mut KvCache,
        ws: &mut Workspace,
        features: &FeatureSource,
        head: Head,
    ) -> Result<(), ModelError> {
        tree.ancestor_mask(&mut self.mask);
        tree.positions(kv.seq_len() as u32, &mut self.positions);
        self.tokens.clear();
        self.tokens.extend(tree.nodes().iter().map(|n| n.token));
        let mask = std::mem::take(&mut self.mask);
        let result = self.run(model, Mask::Allowed(&mask), kv, ws, features, head);
        self.mask = mask;
        result
    }

    /// Runs `tokens` causally after the cache's current end (a prompt), computing no logits; their feature rows
    /// are then in [`Verifier::features`].
    pub fn prefill(
        &mut self,
        model: &Model,
        tokens: &[u32],
        kv: &mut KvCache,
        ws: &mut Workspace,
        features: &FeatureSource,
    ) -> Result<(), ModelError> {
        let start = kv.seq_len() as u32;
        self.positions.clear();
        self.positions.extend((0..tokens.len() as u32).map(|i| start + i));
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.run(model, Mask::Causal, kv, ws, features, Head::None)
    }

    /// Full-vocabulary logits of row `i` of the last tree verification (after a greedy one, which computed only
    /// each row's argmax) into `out`.
    pub fn row_logits(&self, model: &Model, i: usize, ws: &mut Workspace, out: &mut Vec<f32>) {
        let d = model.config.n_embd;
        out.resize(model.config.vocab_size, 0.0);
        model.head_full(&self.normed[i * d..(i + 1) * d], 1, out, ws);
    }

    /// Feature rows of the rows of the last forward.
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    fn run(
        &mut self,
        model: &Model,
        mask: Mask<'_>,
        kv: &mut KvCache,
        ws: &mut Workspace,
        features: &FeatureSource,
        head: Head,
    ) -> Result<(), ModelError> {
        let n = self.tokens.len();
        let c = &model.config;
        let d = c.n_embd;
        if n == 0 {
            self.features.clear();
            self.logits.clear();
            return Ok(());
        }
        let needed = kv.seq_len() + n;
        if needed > kv.capacity() {
            return Err(ModelError::ContextFull { needed, capacity: kv.capacity() });
        }
        self.features.clear();
        self.features.resize(n * features.width(d), 0.0);
        self.hidden.resize(n * d, 0.0);
        model.embed(&self.tokens, &mut self.hidden)?;
        for il in 0..=c.n_layers {
            features.capture_layer_input(il, &self.hidden, &mut self.features, d);
            if il < c.n_layers {
                model.layer(il, &mut self.hidden, &self.positions, mask, kv, ws)?;
            }
        }
        if head == Head::None && features.final_norm_slot().is_none() {
            return Ok(());
        }
        self.normed.resize(n * d, 0.0);
        model.final_norm(&self.hidden, &mut self.normed);
        features.put_final_norm(&self.normed, &mut self.features, d);
        match head {
            Head::None => {}
            Head::Logits => {
                self.logits.resize(n * c.vocab_size, 0.0);
                model.head_full(&self.normed, n, &mut self.logits, ws);
            }
            Head::Greedy => {
                self.greedy.resize(n, 0);
                model.head_argmax(&self.normed, n, &mut self.greedy, ws);
            }
        }
        Ok(())
    }
}
