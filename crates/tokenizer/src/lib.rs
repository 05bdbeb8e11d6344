//! Tokenizers built from a GGUF file's vocabulary, reproducing llama.cpp's `llama_tokenize` exactly,
//! plus streaming detokenization and chat-template rendering.
//!
//! # The pipeline
//!
//! Encoding ([`Tokenizer::encode`], like `llama_tokenize(text, add_special, parse_special)`):
//! 1. **Special-token split** ([`special`]): CONTROL / USER_DEFINED / UNKNOWN token texts are cut out of
//!    the input first, longest first (CONTROL and UNKNOWN only when `parse_special`).
//! 2. **Pre-tokenize** ([`pretokenize`], byte-level BPE only): each remaining text fragment is split into
//!    words by the regex list of `tokenizer.ggml.pre` (`smollm`, `llama3`, `qwen2`, `gpt-2`,
//!    `default`…). SentencePiece vocabularies skip this step; they escape spaces as `▁` and, if
//!    `add_space_prefix`, put a space before a fragment that starts the text or follows a special token.
//! 3. **BPE**: `tokenizer.ggml.model = gpt2` merges bytes by merge rank ([`bpe`]); `llama` merges
//!    characters by token score with `<0xXX>` byte fallback ([`spm`]).
//! 4. **Ids**: BOS is prepended if `add_special` and the model's `add_bos`; EOS appended if `add_special`
//!    and `add_eos`.
//!
//! Decoding: [`Tokenizer::token_bytes`] is llama.cpp's `token_to_piece(special = true)`: GPT-2 alphabet
//! decoded to bytes, `▁` → space and `<0xXX>` → the byte for SentencePiece, the text itself for
//! special tokens. [`Tokenizer::decode`] concatenates pieces (lossy UTF-8); [`StreamDecoder`] emits
//! only whole characters while generating.
//!
//! Chat: [`chat::render`] runs a Hugging Face Jinja chat template with `minijinja`.
//!
//! ```no_run
//! let file = gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tokenizer = tokenizer::Tokenizer::from_gguf(&file)?;
//! let ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n", true, true);
//! assert_eq!(tokenizer.decode(&ids), "<|im_start|>user\nHi<|im_end|>\n");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod bpe;
pub mod chat;
mod error;
pub mod index;
pub mod pretokenize;
pub mod special;
pub mod spm;
mod stream;
pub mod unicode;
mod vocab;

pub use error::TokenizerError;
pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;

use bpe::BytePairModel;
use special::{Fragment, SpecialTokens};
use spm::ScoreBpeModel;
use vocab::{attr, Vocab};

/// The subword algorithm of a vocabulary (`tokenizer.ggml.model`).
enum Model {
    /// `gpt2`: byte-level BPE with ranked merges after a regex pre-tokenizer.
    BytePair { model: Box<BytePairModel>, pre: PreTokenizer },
    /// `llama`: SentencePiece-style BPE merging by token score.
    ScoreBpe { model: Box<ScoreBpeModel> },
}

/// A tokenizer built from a GGUF vocabulary; see the crate documentation for the pipeline.
pub struct Tokenizer {
    model: Model,
    vocab: Vocab,
    specials: SpecialTokens,
}

impl Tokenizer {
    /// Builds the tokenizer from the `tokenizer.*` metadata of a GGUF file.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        let model_name = file
            .opt_str("tokenizer.ggml.model")?
            .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.model".into()))?;
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize / 2 {
            return Err(TokenizerError::BadVocab(format!("tokenizer.ggml.tokens has {} entries", tokens.len())));
        }
        let token_types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => Some(file.get_i32_array("tokenizer.ggml.token_type")?),
            None => None,
        };
        let (model, vocab) = match model_name {
            "gpt2" => {
                let pre_name = file.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
                let pre = PreTokenizer::from_name(pre_name)
                    .ok_or_else(|| TokenizerError::UnsupportedPre(pre_name.to_owned()))?;
                let merges = match file.get("tokenizer.ggml.merges") {
                    Some(_) => file.get_str_array("tokenizer.ggml.merges")?,
                    None => return Err(TokenizerError::MissingKey("tokenizer.ggml.merges".into())),
                };
                let vocab = Vocab::load(file, &tokens, token_types.as_deref(), vocab::Kind::BytePair { pre })?;
                (
                    Model::BytePair {
                        model: Box::new(BytePairModel::new(&tokens, &merges, pre.ignores_merges())),
                        pre,
                    },
                    vocab,
                )
            }
            "llama" => {
                let scores = match file.get("tokenizer.ggml.scores") {
                    Some(_) => file.get_f32_array("tokenizer.ggml.scores")?,
                    None => Vec::new(),
                };
                if !scores.is_empty() && scores.len() != tokens.len() {
                    return Err(TokenizerError::BadVocab(format!(
                        "tokenizer.ggml.scores has {} entries for {} tokens",
                        scores.len(),
                        tokens.len()
                    )));
                }
                let vocab = Vocab::load(file, &tokens, token_types.as_deref(), vocab::Kind::ScoreBpe)?;
                (Model::ScoreBpe { model: Box::new(ScoreBpeModel::new(&vocab.index, scores)) }, vocab)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };
        let specials = SpecialTokens::new((0..vocab.len() as u32).filter_map(|id| {
            let a = vocab.attrs[id as usize];
            (a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
                .then(|| (id, Box::from(vocab.text(id)), a & (attr::CONTROL | attr::UNKNOWN) != 0))
        }));
        unicode::warm_up();
        Ok(Tokenizer { model, vocab, specials })
    }

    /// Tokenizes `text` like llama.cpp's `llama_tokenize(text, add_special, parse_special)`:
    /// `add_special` adds BOS/EOS as the model asks (`add_bos`/`add_eos`); `parse_special` turns the
    /// text of control tokens (e.g. `<|im_start|>`) into those tokens instead of tokenizing it as text.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.vocab.add_bos {
            out.extend(self.vocab.bos);
        }
        let fragments = self.specials.partition(text, parse_special);
        match &self.model {
            Model::BytePair { model, pre } => {
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(range) => {
                            let piece = &text[range];
                            for word in pre.split(piece) {
                                model.encode_word(&piece.as_bytes()[word], &mut out);
                            }
                        }
                    }
                }
            }
            Model::ScoreBpe { model } => {
                // a fragment at the start or right after a special token gets the space prefix
                let mut after_special = true;
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                        Fragment::Text(range) => {
                            if self.vocab.add_space_prefix && after_special {
                                let prefixed = format!(" {}", &text[range]);
                                model.encode(&self.vocab.index, &prefixed, &mut out);
                            } else {
                                model.encode(&self.vocab.index, &text[range], &mut out);
                            }
                            after_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.vocab.add_eos {
            out.extend(self.vocab.eos);
        }
        out
    }

    /// The bytes token `id` stands for (llama.cpp's `token_to_piece` with `special = true`); empty for
    /// an id outside the vocabulary or an unused token. A piece may be part of a UTF-8 character.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.vocab.piece(id)
    }

    /// The token's text as stored in the GGUF vocabulary (`Ġthe`, `▁the`, `<0x0A>`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        ((id as usize) < self.vocab.len()).then(|| self.vocab.text(id))
    }

    /// Concatenates the pieces of `ids` (special tokens rendered as their text) as lossy UTF-8.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    /// The end-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Whether generation ends at `id` (EOS, EOT, `<|im_end|>`, `<end_of_turn>`, … as llama.cpp decides).
    pub fn is_eog(&self, id: u32) -> bool {
        self.vocab.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation tokens, ascending.
    pub fn eog_tokens(&self) -> &[u32] {
        &self.vocab.eog
    }

    /// Whether [`encode`](Self::encode) with `add_special` prepends BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.vocab.add_bos && self.vocab.bos.is_some()
    }

    /// The Jinja chat template (`tokenizer.chat_template`), if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.vocab.chat_template.as_deref()
    }

    /// Renders `messages` with the model's chat template (see [`chat::render`]), with the model's BOS
    /// and EOS texts as `bos_token` / `eos_token`. As llama.cpp does, a leading BOS text is removed when
    /// the model adds BOS itself (and a trailing EOS text when it adds EOS), so that
    /// `encode(prompt, true, true)` does not double them.
    pub fn render_chat(
        &self,
        messages: &[chat::Message],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self.chat_template().ok_or(TokenizerError::NoTemplate)?;
        let bos = self.vocab.bos.map_or("", |id| self.vocab.text(id));
        let eos = self.vocab.eos.map_or("", |id| self.vocab.text(id));
        let mut prompt = chat::render(template, messages, add_generation_prompt, bos, eos)?;
        if self.add_bos() && !bos.is_empty() && prompt.starts_with(bos) {
            prompt.drain(..bos.len());
        }
        if self.vocab.add_eos && !eos.is_empty() && prompt.ends_with(eos) {
            prompt.truncate(prompt.len() - eos.len());
        }
        Ok(prompt)
    }

    /// The token whose GGUF text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.index.get(text)
    }

    /// Whether `id` is a control or user-defined token.
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab.attrs.get(id as usize).is_some_and(|a| a & (attr::CONTROL | attr::USER_DEFINED) != 0)
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let model = match &self.model {
            Model::BytePair { pre, .. } => format!("gpt2 byte-level BPE, pre-tokenizer {pre:?}"),
            Model::ScoreBpe { .. } => "llama SentencePiece BPE".to_owned(),
        };
        f.debug_struct("Tokenizer")
            .field("model", &model)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos())
            .field("eos", &self.eos())
            .field("add_bos", &self.add_bos())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gguf::{GgufFile, GgufWriter, Value};

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::from(*s)).collect())
    }

    fn build(configure: impl FnOnce(&mut GgufWriter)) -> Result<Tokenizer, TokenizerError> {
        let mut writer = GgufWriter::new();
        writer.add("general.architecture", "llama");
        configure(&mut writer);
        let file = GgufFile::from_bytes(writer.to_bytes().expect("writes")).expect("reads");
        Tokenizer::from_gguf(&file)
    }

    /// A tiny SentencePiece vocabulary: `<sep>` is CONTROL, `"\n\n"` USER_DEFINED, plus byte tokens.
    fn sentencepiece() -> Tokenizer {
        let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "▁b", "<sep>", "\n\n"];
        let mut scores = vec![0.0, 0.0, 0.0, -5.0, -10.0, -10.0, -1.0, -1.0, 0.0, 0.0];
        let mut types = vec![2, 3, 3, 1, 1, 1, 1, 1, 3, 4];
        let hex: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
        tokens.extend(hex.iter().map(String::as_str));
        scores.extend([0.0; 256]);
        types.extend([6; 256]);
        build(|w| {
            w.add("tokenizer.ggml.model", "llama")
                .add("tokenizer.ggml.tokens", strings(&tokens))
                .add("tokenizer.ggml.scores", Value::Array(scores.into_iter().map(Value::F32).collect()))
                .add("tokenizer.ggml.token_type", Value::Array(types.into_iter().map(Value::I32).collect()));
        })
        .expect("valid vocabulary")
    }

    #[test]
    fn sentencepiece_space_prefix_specials_and_byte_fallback() {
        let t = sentencepiece();
        assert_eq!((t.bos(), t.eos(), t.add_bos()), (Some(1), Some(2), true), "llama.cpp's SPM defaults");
        assert_eq!(t.encode("a b", true, false), [1, 6, 7]);
        // after a special token the next fragment gets the space prefix again
        assert_eq!(t.encode("a<sep>b", false, true), [6, 8, 7]);
        // without parse_special, control text is plain text: '<' 's' 'e' 'p' '>' fall back to bytes
        let plain = t.encode("a<sep>", false, false);
        assert_eq!(plain[0], 6);
        assert_eq!(t.decode(&plain), " a<sep>");
        // user-defined tokens are split out even without parse_special
        assert_eq!(t.encode("a\n\nb", false, false), [6, 9, 7]);
        assert_eq!(t.decode(&[1, 6, 9, 7]), "<s> a\n\n b");
        assert_eq!(t.token_bytes(10 + 0xE6), [0xE6]);
        assert!(t.is_eog(2) && !t.is_eog(1));
        assert!(t.is_special(8) && t.is_special(9) && !t.is_special(6));
        assert_eq!(t.token_bytes(99_999), b"");
    }

    #[test]
    fn bad_metadata_is_an_error_not_a_panic() {
        let tokens = strings(&["a", "b", "ab"]);
        let err = build(|w| {
            w.add("tokenizer.ggml.model", "bert").add("tokenizer.ggml.tokens", tokens.clone());
        });
        assert!(matches!(err, Err(TokenizerError::UnsupportedModel(m)) if m == "bert"));
        let err = build(|w| {
            w.add("tokenizer.ggml.model", "gpt2")
                .add("tokenizer.ggml.pre", "klingon")
                .add("tokenizer.ggml.tokens", tokens.clone())
                .add("tokenizer.ggml.merges", strings(&["a b"]));
        });
        assert!(matches!(err, Err(TokenizerError::UnsupportedPre(p)) if p == "klingon"));
        let err = build(|w| {
            w.add("tokenizer.ggml.model", "gpt2").add("tokenizer.ggml.tokens", tokens.clone());
        });
        assert!(matches!(err, Err(TokenizerError::MissingKey(k)) if k == "tokenizer.ggml.merges"));
        let err = build(|w| {
            w.add("tokenizer.ggml.model", "llama")
                .add("tokenizer.ggml.tokens", tokens.clone())
                .add("tokenizer.ggml.scores", Value::Array(vec![Value::F32(0.0)]));
        });
        assert!(matches!(err, Err(TokenizerError::BadVocab(_))));
        let err = build(|w| {
            w.add("tokenizer.ggml.tokens", tokens.clone());
        });
        assert!(matches!(err, Err(TokenizerError::MissingKey(_))));
    }

    #[test]
    fn byte_level_bpe_from_gguf() {
        let t = build(|w| {
            w.add("tokenizer.ggml.model", "gpt2")
                .add("tokenizer.ggml.pre", "gpt-2")
                .add("tokenizer.ggml.tokens", strings(&["<|endoftext|>", "a", "b", "Ġ", "ab", "Ġab"]))
                .add("tokenizer.ggml.token_type", Value::Array([3, 1, 1, 1, 1, 1].map(Value::I32).to_vec()))
                .add("tokenizer.ggml.merges", strings(&["a b", "Ġ ab"]))
                .add("tokenizer.ggml.eos_token_id", Value::U32(0));
        })
        .expect("valid vocabulary");
        assert!(!t.add_bos());
        assert_eq!(t.encode("ab ab<|endoftext|>", true, true), [4, 5, 0]);
        // as text, the special token's characters have no tokens here: llama.cpp drops such bytes
        assert_eq!(t.encode("ab ab<|endoftext|>", true, false), [4, 5]);
        assert_eq!(t.decode(&[4, 5, 0]), "ab ab<|endoftext|>");
        assert!(t.is_eog(0));
    }
}
