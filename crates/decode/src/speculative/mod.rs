//! # Tree speculative decoding (lossless), split by role as mistral.rs does
//!
//! One decoding step, in order:
//!
//! 1. **Propose** ([`proposer`]): a [`Proposer`] looks at the committed tokens (and, for EAGLE heads, the target's
//!    feature rows of those tokens) and grows a [`DraftTree`] under the *root* — the last committed token, which
//!    the target has not run yet. [`build_dynamic_tree`] is the EAGLE-2 builder any proposer with a next-token
//!    distribution can reuse: expand the `top_k` best nodes per depth by cumulative log-probability, then rerank
//!    every candidate and keep the best `budget`.
//! 2. **Verify** ([`verify`]): one batched target forward over `[root, nodes…]` through the per-layer step API,
//!    each node at position `parent + 1` and attending only to its ancestors (a tree mask), giving the target's
//!    logits at every node.
//! 3. **Accept** ([`acceptance`]): greedy — walk from the root into the child whose token is the target's choice,
//!    then add the target's own next token (the *bonus*); sampling — recursive rejection sampling over the
//!    children, so the committed tokens are distributed exactly as the target's sampler would draw them.
//! 4. **Compact**: keep only the root and the accepted path in the KV cache ([`model::KvCache::compact`]), so the
//!    cache holds exactly what dense decoding would have put there.
//!
//! [`SpeculativeDecoder`] runs the loop; each [`SpeculativeDecoder::step`] commits between 1 and `depth + 1`
//! tokens for one target forward. Proposers here: [`NgramProposer`] (prompt lookup: what followed the latest
//! n-gram earlier in the context, else in a [`Datastore`] of the model's own answers) and [`OracleProposer`] (replays a known continuation with wrong siblings, for
//! tests and upper bounds). Trained EAGLE heads plug in through the same [`Proposer`] trait.
//!
//! References: EAGLE (Li et al., 2024, arXiv:2401.15077), EAGLE-2 dynamic trees (arXiv:2406.16858), SpecInfer
//! multi-draft verification (Miao et al., 2024), recursive rejection sampling (Jeon et al., 2024,
//! arXiv:2402.14160), prompt lookup decoding (Saxena, 2023).
//!
//! ```no_run
//! use decode::speculative::{NgramProposer, SpeculativeDecoder};
//! use decode::SamplingParams;
//! let model = model::Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! let mut dec = SpeculativeDecoder::new(&model, 512, 2, NgramProposer::default(), SamplingParams::greedy());
//! dec.feed(&[504, 3575, 282, 4649, 314]).unwrap();
//! let mut out = Vec::new();
//! while out.len() < 32 {
//!     out.extend_from_slice(dec.step_at_most(32 - out.len()).unwrap());
//! }
//! println!("τ = {:.2}", dec.stats().acceptance_length());
//! ```

pub mod acceptance;
pub mod datastore;
mod decoder;
pub mod distribution;
pub mod eagle;
pub mod ngram;
pub mod oracle;
pub mod proposer;
pub mod published;
pub mod tree;
pub mod verify;

pub use datastore::{BuildOptions as DatastoreOptions, Datastore, DatastoreError};
pub use decoder::{SpeculativeDecoder, SpeculativeStats, TreeRows};
pub use eagle::{DraftHead, DraftHeadError, EagleProposer};
pub use ngram::{LookupChain, NgramConfig, NgramProposer};
pub use oracle::OracleProposer;
pub use proposer::{DraftContext, FeatureSource, Proposer};
pub use published::{PublishedHead, PublishedHeadError, PublishedProposer};
pub use tree::{build_dynamic_tree, build_dynamic_tree_traced, DraftNode, DraftSource, DraftTree, TreeConfig};

use model::ModelError;

/// What can go wrong in speculative decoding.
#[derive(Debug, thiserror::Error)]
pub enum SpeculativeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("nothing to continue from: feed at least one token before stepping")]
    EmptyContext,
    #[error("draft tree node {node} has token {token}, outside the vocabulary (size {vocab})")]
    BadDraftToken { node: usize, token: u32, vocab: usize },
    #[error("the proposer failed: {0}")]
    Proposer(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
    #[error("grammar-constrained tree decoding needs greedy settings without a repetition penalty")]
    ConstrainedSampling,
}
