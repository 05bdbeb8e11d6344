//! # decode — decoding strategies on top of the model's per-layer step API
//!
//! - [`sampling`]: turning logits into the next token (greedy, temperature, top-k, top-p, min-p, repetition
//!   penalty), seeded and reproducible.
//! - [`dense`]: plain autoregressive decoding through every layer — the reference every other strategy is
//!   measured against.
//! - [`speculative`]: lossless tree speculative decoding (EAGLE-2 style trees, batched tree verification, greedy
//!   and rejection-sampling acceptance, KV-cache compaction) behind a [`speculative::Proposer`] trait.
//! - [`specee`]: speculative early exit — per-layer exit predictors over a draft head's candidates.
//! - [`constraint`]: grammar constraints on the committed tokens ([`constraint::TokenConstraint`]), which dense
//!   and tree speculative decoding follow.

pub mod constraint;
pub mod dense;
pub mod sampling;
pub mod specee;
pub mod speculative;

#[cfg(test)]
pub(crate) mod test_util;

pub use constraint::{ConstraintError, TokenConstraint};
pub use dense::DenseDecoder;
pub use sampling::{Sampler, SamplingParams};
pub use speculative::SpeculativeDecoder;
