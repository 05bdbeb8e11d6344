//! Errors raised while loading a model or running it: every message names the offending key, tensor or value.

use gguf::GgufError;

/// What can go wrong when loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture '{0}' (supported: llama, qwen2, qwen3, gemma3)")]
    UnsupportedArchitecture(String),
    #[error("tensor '{name}' is missing from the model file")]
    MissingTensor { name: String },
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    BadShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor '{name}' has type {ty}, which specee cannot compute with yet")]
    UnsupportedTensorType { name: String, ty: &'static str },
    #[error("bad hyperparameter {key} = {value}: {reason}")]
    BadHyperparameter { key: String, value: String, reason: String },
    #[error("context full: {needed} positions needed but the context holds {capacity} (raise -c/--ctx-size)")]
    ContextFull { needed: usize, capacity: usize },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    BadToken { id: u32, vocab: usize },
    #[error("no tokens to run (a greedy step needs at least one input token)")]
    EmptyInput,
    #[error("activation-sparsity thresholds for {found} layers, but the model has {layers}")]
    ActLayers { found: usize, layers: usize },
}
