//! Errors of the engine layer, wrapping those of the crates below with messages a user can act on.

use std::path::PathBuf;

/// What can go wrong while loading a model or generating.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model file not found: {} (or a default model: smollm2, gemma3, qwen-coder)", .0.display())]
    ModelNotFound(PathBuf),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error(transparent)]
    Fetch(#[from] crate::fetch::FetchError),
    #[error("this model has no chat template (tokenizer.chat_template); use a raw prompt without --chat")]
    NoChatTemplate,
    #[error("the prompt is empty (it tokenizes to no tokens)")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the context holds {ctx} (raise -c/--ctx-size)")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error("the text has {tokens} tokens, fewer than the {needed} needed for one chunk of {ctx}")]
    TextTooShort { tokens: usize, needed: usize, ctx: usize },
    #[error("no draft head at {} (train one with `specee train-draft`, or pass --draft FILE)", .0.display())]
    NoDraftHead(PathBuf),
    #[error("draft head {}: {source}", path.display())]
    DraftHead { path: PathBuf, source: decode::speculative::DraftHeadError },
    #[error("datastore {}: {source}", path.display())]
    Datastore { path: PathBuf, source: decode::speculative::DatastoreError },
    #[error("published EAGLE head {}: {source}", path.display())]
    PublishedHead { path: PathBuf, source: decode::speculative::PublishedHeadError },
    #[error("no exit predictors at {} (train them with `specee train-exit`, or pass --exit FILE)", .0.display())]
    NoExitPredictors(PathBuf),
    #[error("exit predictors {}: {source}", path.display())]
    ExitPredictors { path: PathBuf, source: decode::specee::PredictorError },
    #[error("{what} {}: {source}", path.display())]
    OtherModel { what: &'static str, path: PathBuf, source: crate::identity::OtherModel },
    #[error("{0}")]
    Unsupported(String),
    #[error("speculative decoding: {0}")]
    Speculative(String),
    #[error("cannot read {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{}:{line}: {why}", path.display())]
    PromptFile { path: PathBuf, line: usize, why: String },
    #[error("{} has no prompts", .0.display())]
    NoPrompts(PathBuf),
    /// A grammar or JSON schema that cannot be compiled or followed (llguidance's message).
    #[error("grammar: {0}")]
    Grammar(String),
    /// A reasoning profile that cannot be used (the message names it and why).
    #[error("{0}")]
    Profile(String),
}

impl From<decode::ConstraintError> for EngineError {
    fn from(e: decode::ConstraintError) -> Self {
        EngineError::Grammar(e.0)
    }
}
