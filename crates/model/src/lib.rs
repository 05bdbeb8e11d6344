//! # model — transformer forward pass over GGUF weights
//!
//! Loads a decoder-only transformer from a GGUF file ([`Model::load`]) and exposes the **per-layer step API**
//! ([`Model::embed`], [`Model::layer`], [`Model::final_norm`], [`Model::head_full`], [`Model::head_rows`]) that
//! every decoding strategy (dense, early exit, draft trees) is built on, together with a [`KvCache`] whose layers
//! keep their own lengths and can be truncated or compacted.
//!
//! Architectures (one file each in `arch/`): `llama` (also Mistral), `qwen2`, `qwen3`, `gemma3`.
//!
//! ```no_run
//! use model::{Model, Workspace, Logits};
//! let m = Model::load("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! let mut kv = m.new_cache(512);
//! let mut ws = Workspace::new(2);
//! let mut hidden = Vec::new();
//! let logits = m.forward(&[504, 3575, 282], &mut kv, &mut ws, &mut hidden, Logits::Last).unwrap();
//! assert_eq!(logits.len(), m.config.vocab_size);
//! ```

mod arch;
mod attention;
pub mod blocks;
pub mod config;
pub mod error;
pub mod kv_cache;
mod model;
pub mod sparsity;
pub mod testing;
pub mod weights;
mod workspace;

#[cfg(test)]
mod tests;

pub use config::{Activation, Arch, Config, RopeStyle};
pub use error::ModelError;
pub use kv_cache::KvCache;
pub use model::{Logits, Mask, Model, Rows, Sequence, SCREEN_AFTER_CALLS, SCREEN_MIN_BYTES, X8_AFTER_ROWS};
pub use sparsity::{ActCounts, ActHistograms, ActThresholds, BlockSparsity, Site};
pub use workspace::Workspace;
