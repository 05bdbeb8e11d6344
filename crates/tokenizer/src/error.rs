//! The crate's error type, [`TokenizerError`]; every message carries the offending value.

/// Everything that can go wrong building a tokenizer or rendering a chat template.
#[derive(thiserror::Error, Debug)]
pub enum TokenizerError {
    /// A metadata key the tokenizer needs is absent.
    #[error("GGUF metadata key '{0}' is missing (needed by the tokenizer)")]
    MissingKey(String),
    /// Reading the GGUF metadata failed (wrong type, bad file…).
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unsupported tokenizer model '{0}' (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error(
        "unsupported pre-tokenizer '{0}' (supported: default, gpt-2, smollm, starcoder, llama3, llama-bpe, qwen2 and aliases)"
    )]
    UnsupportedPre(String),
    /// The vocabulary is inconsistent (array lengths, empty vocabulary, too many tokens…).
    #[error("bad vocabulary: {0}")]
    BadVocab(String),
    /// A chat template failed to parse or render.
    #[error("chat template error: {0}")]
    Template(String),
    /// The model has no `tokenizer.chat_template`.
    #[error("the model has no chat template (tokenizer.chat_template)")]
    NoTemplate,
}
