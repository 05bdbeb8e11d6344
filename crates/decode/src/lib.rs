//! # decode — decoding strategies on top of the model's per-layer step API
//!
//! - [`sampling`]: turning logits into the next token (greedy, temperature, top-k, top-p, min-p, repetition
//!   penalty), seeded and reproducible.
//! - [`dense`]: plain autoregressive decoding through every layer — the reference every other strategy is
//!   measured against.

pub mod dense;
pub mod sampling;

pub use dense::DenseDecoder;
pub use sampling::{Sampler, SamplingParams};
