//! The proposer role: anything that can draft a tree of likely continuations — a prompt-lookup n-gram matcher,
//! an oracle for tests, or a trained EAGLE draft head.
//!
//! An EAGLE head drafts from `(token, feature)` pairs: the feature of the token at position `i` (the target's
//! hidden state there) together with the token at `i + 1` predicts the token at `i + 2`. The decoder therefore
//! keeps, for every committed token the target has already run (all but the root), the feature rows the proposer
//! asks for ([`FeatureSource`]), and hands them over in [`DraftContext`]: the root's draft pairs the last feature
//! row with the root token.

use super::tree::DraftTree;
use super::SpeculativeError;

/// Which of the target's hidden states a proposer needs for every committed token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum FeatureSource {
    /// None (n-gram and oracle proposers): the decoder stores nothing.
    #[default]
    None,
    /// The last layer's output after the final RMS norm (`n_embd` per token): the feature of EAGLE-1/2 heads.
    FinalNorm,
    /// The residual stream entering each listed layer (`n_embd` per layer per token, concatenated in the listed
    /// order); layer index `n_layers` means the last layer's output before the final norm. EAGLE-3 heads fuse
    /// three such rows (low, middle and high layers).
    LayerInputs(Vec<usize>),
    /// The final-normed state first, then the residual stream entering each listed layer (`n_embd` each): the
    /// feature of our own fused heads (EAGLE-3's low/middle-layer fusion on top of the EAGLE-1 feature).
    FinalNormAnd(Vec<usize>),
}

impl FeatureSource {
    /// Floats per token for a model with `n_layers` layers of width `n_embd`.
    pub fn width(&self, n_embd: usize) -> usize {
        match self {
            FeatureSource::None => 0,
            FeatureSource::FinalNorm => n_embd,
            FeatureSource::LayerInputs(layers) => n_embd * layers.len(),
            FeatureSource::FinalNormAnd(layers) => n_embd * (1 + layers.len()),
        }
    }

    /// Where the final-normed state sits in a feature row (`None`: not part of it).
    pub fn final_norm_slot(&self) -> Option<usize> {
        matches!(self, FeatureSource::FinalNorm | FeatureSource::FinalNormAnd(_)).then_some(0)
    }

    /// Copies the residual stream entering layer `il` (`hidden`, `n × n_embd`) into the slots of the rows (`n ×
    /// width`) that hold that layer's input, if any.
    pub fn capture_layer_input(&self, il: usize, hidden: &[f32], rows: &mut [f32], n_embd: usize) {
        for (_, slot) in self.layer_slots().filter(|&(l, _)| l == il) {
            self.put_slot(slot, hidden, rows, n_embd);
        }
    }

    /// Copies the final-normed states (`normed`, `n × n_embd`) into their slot of the rows, if they have one.
    pub fn put_final_norm(&self, normed: &[f32], rows: &mut [f32], n_embd: usize) {
        if let Some(slot) = self.final_norm_slot() {
            self.put_slot(slot, normed, rows, n_embd);
        }
    }

    /// Copies `n × n_embd` values into slot `slot` of `n` feature rows.
    fn put_slot(&self, slot: usize, src: &[f32], rows: &mut [f32], n_embd: usize) {
        let width = self.width(n_embd);
        for (r, h) in src.chunks_exact(n_embd).enumerate() {
            rows[r * width + slot * n_embd..][..n_embd].copy_from_slice(h);
        }
    }

    /// The layers whose input goes into a feature row, each with its slot (row offset in units of `n_embd`).
    pub fn layer_slots(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (layers, first): (&[usize], usize) = match self {
            FeatureSource::LayerInputs(l) => (l, 0),
            FeatureSource::FinalNormAnd(l) => (l, 1),
            _ => (&[], 0),
        };
        layers.iter().enumerate().map(move |(i, &l)| (l, first + i))
    }
}

/// What a proposer sees when asked for a tree.
#[derive(Clone, Copy)]
pub struct DraftContext<'a> {
    /// The target model (a draft head reuses its embeddings).
    pub model: &'a model::Model,
    /// The decoder's thread pool: a proposer that computes should run on it rather than start its own threads
    /// (two pools would spin against each other on a small machine).
    pub pool: &'a kernels::ThreadPool,
    /// Every committed token; the last one is the root of the tree to draft (the target has not run it yet).
    pub tokens: &'a [u32],
    /// Feature rows of `tokens[..tokens.len() - 1]`, `feature_width` floats each (empty for
    /// [`FeatureSource::None`]).
    pub features: &'a [f32],
    /// Floats per feature row.
    pub feature_width: usize,
    /// How many leading tokens (and their feature rows) are unchanged since the previous call: a proposer that
    /// caches work (an EAGLE head's own KV cache) keeps that much and recomputes the rest. 0 after a reset.
    pub stable_prefix: usize,
}

impl<'a> DraftContext<'a> {
    /// The root token (the last committed one).
    pub fn root(&self) -> Option<u32> {
        self.tokens.last().copied()
    }

    /// Feature row of committed token `i` (`i < tokens.len() - 1`).
    pub fn feature(&self, i: usize) -> Option<&'a [f32]> {
        let w = self.feature_width;
        self.features.get(i * w..(i + 1) * w).filter(|_| w > 0)
    }
}

/// Drafts a tree of continuations under the last committed token.
pub trait Proposer {
    /// The target features this proposer needs (asked once, when the decoder is built).
    fn feature_source(&self) -> FeatureSource {
        FeatureSource::None
    }

    /// Whether it reads the feature rows of tokens before the root's parent (an EAGLE-3 head's own attention
    /// does; our MLP heads read only the root's parent's row; by default, any proposer that reads features). A decoder resumed from another's cache
    /// ([`crate::SpeculativeDecoder::resume`]) has only that row.
    fn needs_feature_history(&self) -> bool {
        self.feature_source() != FeatureSource::None
    }

    /// Grows `tree` (which holds only the root, `context`'s last token) with draft nodes. Leaving it empty is
    /// allowed: the step then commits exactly one token, as dense decoding would.
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError>;
}

impl<P: Proposer + ?Sized> Proposer for Box<P> {
    fn feature_source(&self) -> FeatureSource {
        (**self).feature_source()
    }
    fn needs_feature_history(&self) -> bool {
        (**self).needs_feature_history()
    }
    fn propose(&mut self, context: &DraftContext<'_>, tree: &mut DraftTree) -> Result<(), SpeculativeError> {
        (**self).propose(context, tree)
    }
}
