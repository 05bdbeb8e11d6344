//! The vocabulary as llama.cpp's `llama_vocab::load` sees it: token texts and attributes, special ids,
//! `add_bos`/`add_eos`/`add_space_prefix`, the end-of-generation set and each token's piece.
//!
//! llama.cpp quirks reproduced here:
//! - Defaults before the GGUF keys: SentencePiece (`llama`) has BOS 1, EOS 2, `add_bos`, and
//!   `add_space_prefix`; byte-level BPE (`gpt2`) has BOS = EOS = 11 and no `add_bos`, except the
//!   `llama3` pre-tokenizer which sets `add_bos`. A special-id key out of range is ignored.
//! - Tokens are recognised **by text** as EOT / EOM / FIM tokens (`<|im_end|>`, `<end_of_turn>`,
//!   `<|file_sep|>`, `<reponame>`…) and forced to CONTROL, which also makes them special-token
//!   candidates for the split step. The end-of-generation set is the text list below, the FIM
//!   pad/repo/separator tokens, EOS, EOT and EOM (so SmolLM2's `<reponame>` ends generation there too).
//! - Empty token texts become `[EMPTY_<id>]`; for duplicate texts the last id wins in the text map.

use crate::index::{Packed, TokenIndex};
use crate::spm::SPACE_MARK;
use crate::unicode::char_to_byte;
use crate::{PreTokenizer, TokenizerError};
use std::collections::BTreeSet;

/// Token attribute bits (llama.cpp's `llama_token_attr`).
pub mod attr {
    /// `tokenizer.ggml.token_type` 2.
    pub const UNKNOWN: u16 = 1 << 0;
    /// Type 5, or a control token whose text contains "unused".
    pub const UNUSED: u16 = 1 << 1;
    /// Type 1 (and the default when the GGUF has no types).
    pub const NORMAL: u16 = 1 << 2;
    /// Type 3.
    pub const CONTROL: u16 = 1 << 3;
    /// Type 4.
    pub const USER_DEFINED: u16 = 1 << 4;
    /// Type 6 (`<0xXX>`).
    pub const BYTE: u16 = 1 << 5;
}

/// Which algorithm the vocabulary feeds (decides defaults and how pieces are decoded).
pub enum Kind {
    BytePair { pre: PreTokenizer },
    ScoreBpe,
}

/// Texts found by name as end-of-turn tokens (llama.cpp's EOT detection), in priority of first id.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] =
    &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>", "<|prefix|>"];
const FIM_SUF_TEXTS: &[&str] =
    &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>", "<|suffix|>"];
const FIM_MID_TEXTS: &[&str] =
    &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>", "<|middle|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Texts that end generation (llama.cpp's EOG list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
];
/// gpt-oss tokens llama.cpp always renders (forced to USER_DEFINED).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Vocabulary data shared by every step.
pub struct Vocab {
    /// GGUF texts by id and ids by text.
    pub index: TokenIndex,
    pieces: Packed,
    /// [`attr`] bits per id.
    pub attrs: Vec<u16>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// End-of-generation ids, ascending.
    pub eog: Vec<u32>,
    pub chat_template: Option<String>,
}

impl Vocab {
    pub fn load(
        file: &gguf::GgufFile,
        tokens: &[&str],
        token_types: Option<&[i32]>,
        kind: Kind,
    ) -> Result<Vocab, TokenizerError> {
        let n = tokens.len();
        if let Some(types) = token_types {
            if types.len() != n {
                return Err(TokenizerError::BadVocab(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    types.len()
                )));
            }
        }
        let mut texts = Packed::with_capacity(n);
        let mut attrs = Vec::with_capacity(n);
        for (id, &text) in tokens.iter().enumerate() {
            let owned;
            let text = if text.is_empty() {
                owned = format!("[EMPTY_{id}]");
                owned.as_str()
            } else {
                text
            };
            texts.push(text.as_bytes());
            attrs.push(match token_types.map_or(1, |t| t[id]) {
                1 => attr::NORMAL,
                2 => attr::UNKNOWN,
                3 => attr::CONTROL,
                4 => attr::USER_DEFINED,
                5 => attr::UNUSED,
                6 => attr::BYTE,
                _ => 0,
            });
        }
        let index = TokenIndex::new(texts);

        let (mut bos, mut eos, mut add_bos, mut add_space_prefix) = match kind {
            Kind::ScoreBpe => (Some(1), Some(2), true, true),
            Kind::BytePair { pre } => (Some(11), Some(11), pre == PreTokenizer::Llama3, false),
        };
        let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < n);
        let special_id = |key: &str| -> Result<Option<u32>, TokenizerError> { Ok(in_range(file.opt_u32(key)?)) };
        if let Some(id) = special_id("tokenizer.ggml.bos_token_id")? {
            bos = Some(id);
        }
        if let Some(id) = special_id("tokenizer.ggml.eos_token_id")? {
            eos = Some(id);
        }
        bos = in_range(bos);
        eos = in_range(eos);
        let mut eot = special_id("tokenizer.ggml.eot_token_id")?;
        let mut eom = special_id("tokenizer.ggml.eom_token_id")?;
        let mut fim_pad = special_id("tokenizer.ggml.fim_pad_token_id")?;
        let mut fim_rep = special_id("tokenizer.ggml.fim_rep_token_id")?;
        let mut fim_sep = special_id("tokenizer.ggml.fim_sep_token_id")?;
        add_bos = file.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(add_bos);
        let add_eos = file.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        add_space_prefix = file.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(add_space_prefix);

        // tokens recognised by text: the smallest id with a listed text fills an unset slot
        let find = |list: &[&str]| -> Option<u32> { list.iter().filter_map(|text| index.get(text)).min() };
        let force_control = |id: Option<u32>, attrs: &mut Vec<u16>| {
            if let Some(id) = id {
                attrs[id as usize] |= attr::CONTROL;
            }
        };
        for (slot, list) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                *slot = find(list);
                force_control(*slot, &mut attrs);
            }
        }
        for list in [FIM_PRE_TEXTS, FIM_SUF_TEXTS, FIM_MID_TEXTS] {
            force_control(find(list), &mut attrs);
        }
        let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for id in EOG_TEXTS.iter().filter_map(|text| index.get(text)) {
            eog.insert(id);
            attrs[id as usize] |= attr::CONTROL;
        }
        for id in ALWAYS_RENDERED.iter().filter_map(|text| index.get(text)) {
            attrs[id as usize] = attr::USER_DEFINED;
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        // harmony-style vocabularies: "<|end|>" is not the end when "<|return|>"/"<|call|>" exist
        let eog_has = |eog: &BTreeSet<u32>, text: &str| eog.iter().find(|&&id| tokens[id as usize] == text).copied();
        if let Some(end) = eog_has(&eog, "<|end|>") {
            let harmony = eog_has(&eog, "<|return|>").is_some() && eog_has(&eog, "<|call|>").is_some();
            let solar = eog_has(&eog, "<|calls|>").is_some() && eog_has(&eog, "<|flush|>").is_some();
            if harmony || solar {
                eog.remove(&end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        if eog_has(&eog, "<|tool_response>").is_some() {
            if let Some(s) = eog_has(&eog, "</s>") {
                eog.remove(&s);
                attrs[s as usize] = attr::NORMAL;
            }
        }

        let mut pieces = Packed::with_capacity(n);
        for (id, text) in tokens.iter().enumerate() {
            pieces.push_with(|out| write_piece(text, attrs[id], &kind, out));
        }
        let chat_template = file.opt_str("tokenizer.chat_template")?.map(str::to_owned);
        Ok(Vocab {
            index,
            pieces,
            attrs,
            bos,
            eos,
            add_bos,
            add_eos,
            add_space_prefix,
            eog: eog.into_iter().collect(),
            chat_template,
        })
    }

    pub fn len(&self) -> usize {
        self.attrs.len()
    }

    /// The GGUF text of `id` (empty outside the vocabulary).
    pub fn text(&self, id: u32) -> &str {
        self.index.text(id)
    }

    /// The piece (bytes) of `id` (empty outside the vocabulary).
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize)
    }
}

/// llama.cpp's `token_to_piece(id, special = true)` for one token, appended to `out`.
fn write_piece(text: &str, attrs: u16, kind: &Kind, out: &mut Vec<u8>) {
    if attrs & (attr::CONTROL | attr::UNKNOWN | attr::USER_DEFINED) != 0 {
        out.extend_from_slice(text.as_bytes());
        return;
    }
    match kind {
        Kind::ScoreBpe if attrs & attr::NORMAL != 0 => {
            let mut parts = text.split(SPACE_MARK);
            out.extend_from_slice(parts.next().unwrap_or_default().as_bytes());
            for part in parts {
                out.push(b' ');
                out.extend_from_slice(part.as_bytes());
            }
        }
        Kind::ScoreBpe if attrs & attr::BYTE != 0 => {
            // "<0xXX>"
            out.extend(text.get(3..5).and_then(|hex| u8::from_str_radix(hex, 16).ok()));
        }
        Kind::BytePair { .. } if attrs & attr::NORMAL != 0 => {
            for c in text.chars() {
                match char_to_byte(c) {
                    Some(b) => out.push(b),
                    None => {
                        // llama.cpp's llama_decode_text marks characters outside the byte alphabet
                        out.extend_from_slice(b"[UNK_BYTE_0x");
                        let mut utf8 = [0u8; 4];
                        for b in c.encode_utf8(&mut utf8).bytes() {
                            out.extend_from_slice(format!("{b:02x}").as_bytes());
                        }
                        out.extend_from_slice(text.as_bytes());
                        out.push(b']');
                    }
                }
            }
        }
        _ => {}
    }
}
