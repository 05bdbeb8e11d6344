//! Step 3 for `tokenizer.ggml.model = llama`: SentencePiece-style BPE that merges by token score, as
//! llama.cpp's `llm_tokenizer_spm_session` (used for Llama 1/2, Mistral, Gemma).
//!
//! 1. Spaces become `▁` (U+2581); the text is split into one symbol per UTF-8 character.
//! 2. Every adjacent pair whose concatenation is a vocabulary token is queued with that token's score.
//! 3. The best-scoring pair (ties: the leftmost) is merged and its new neighbours are queued, until the
//!    queue is empty. A queued pair is stale if either side has since changed length.
//! 4. Each final symbol that is a token is emitted; any other symbol (a character missing from the
//!    vocabulary) is emitted byte by byte as the `<0xXX>` byte-fallback tokens.
//!
//! There is no pre-tokenizer: the whole text fragment is one word.

use crate::index::TokenIndex;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// SentencePiece's visible space, U+2581.
pub const SPACE_MARK: &str = "\u{2581}";

/// Scores and byte-fallback tokens for score-ordered BPE; the text → id map is the tokenizer's.
pub struct ScoreBpeModel {
    scores: Vec<f32>,
    /// The token for each raw byte: `<0xXX>`, else the one-byte text, else none.
    byte_tokens: [Option<u32>; 256],
}

#[derive(Clone, Copy)]
struct Pair {
    score: f32,
    left: u32,
    right: u32,
    /// Byte length of the two symbols together when the pair was queued.
    size: u32,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    /// Higher score first, then the smaller left index (llama.cpp compares scores with `<`, so
    /// -0.0 and 0.0 tie).
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.partial_cmp(&other.score).unwrap_or(Ordering::Equal).then_with(|| other.left.cmp(&self.left))
    }
}

impl ScoreBpeModel {
    /// Builds the model from the token scores (index = token id) and the text → id map.
    pub fn new(token_ids: &TokenIndex, scores: Vec<f32>) -> ScoreBpeModel {
        let mut byte_tokens = [None; 256];
        for (byte, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{byte:02X}>");
            let byte = [byte as u8];
            let raw = std::str::from_utf8(&byte).ok();
            *slot = token_ids.get(&hex).or_else(|| raw.and_then(|raw| token_ids.get(raw)));
        }
        ScoreBpeModel { scores, byte_tokens }
    }

    fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Appends the tokens of `text` (spaces not yet escaped). `token_ids` maps every token's text to
    /// its id (the last id for duplicate texts, as llama.cpp's map).
    pub fn encode(&self, token_ids: &TokenIndex, text: &str, out: &mut Vec<u32>) {
        let escaped = text.replace(' ', SPACE_MARK);
        let bytes = escaped.as_bytes();
        if bytes.is_empty() {
            return;
        }
        // symbol i covers bytes[start..start + len]; merged-away symbols have len 0
        struct Symbol {
            start: u32,
            len: u32,
            prev: i32,
            next: i32,
        }
        let mut symbols: Vec<Symbol> = Vec::with_capacity(bytes.len());
        for (i, (start, c)) in escaped.char_indices().enumerate() {
            let end = start + c.len_utf8();
            symbols.push(Symbol {
                start: start as u32,
                len: c.len_utf8() as u32,
                prev: i as i32 - 1,
                next: if end == bytes.len() { -1 } else { i as i32 + 1 },
            });
        }
        let mut queue: BinaryHeap<Pair> = BinaryHeap::new();
        let try_pair = |queue: &mut BinaryHeap<Pair>, symbols: &[Symbol], left: i32, right: i32| {
            if left < 0 || right < 0 {
                return;
            }
            let (l, r) = (&symbols[left as usize], &symbols[right as usize]);
            let size = l.len + r.len;
            // symbols start and end on character boundaries
            let text = escaped.get(l.start as usize..(l.start + size) as usize).unwrap_or_default();
            if let Some(id) = token_ids.get(text) {
                queue.push(Pair { score: self.score(id), left: left as u32, right: right as u32, size });
            }
        };
        for i in 1..symbols.len() {
            try_pair(&mut queue, &symbols, i as i32 - 1, i as i32);
        }
        while let Some(pair) = queue.pop() {
            let (left, right) = (pair.left as usize, pair.right as usize);
            let (l_len, r_len) = (symbols[left].len, symbols[right].len);
            if l_len == 0 || r_len == 0 || l_len + r_len != pair.size {
                continue;
            }
            let r_next = symbols[right].next;
            symbols[left].len += r_len;
            symbols[left].next = r_next;
            symbols[right].len = 0;
            if r_next >= 0 {
                symbols[r_next as usize].prev = left as i32;
            }
            let l_prev = symbols[left].prev;
            try_pair(&mut queue, &symbols, l_prev, left as i32);
            try_pair(&mut queue, &symbols, left as i32, r_next);
        }
        let mut i = 0i32;
        while i >= 0 {
            let s = &symbols[i as usize];
            let text = escaped.get(s.start as usize..(s.start + s.len) as usize).unwrap_or_default();
            match token_ids.get(text) {
                Some(id) => out.push(id),
                None => out.extend(text.bytes().filter_map(|b| self.byte_tokens[b as usize])),
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> (TokenIndex, ScoreBpeModel) {
        let mut tokens: Vec<String> =
            ["<unk>", "▁", "a", "b", "c", "ab", "bc", "▁a", "abc"].iter().map(|s| s.to_string()).collect();
        let mut scores = vec![0.0, -1.0, -2.0, -2.0, -2.0, -5.0, -3.0, -4.0, -6.0];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        scores.extend([0.0; 256]);
        let ids = TokenIndex::from_texts(tokens.iter().map(String::as_str));
        let model = ScoreBpeModel::new(&ids, scores);
        (ids, model)
    }

    #[test]
    fn merges_best_score_first() {
        let (ids, model) = model();
        let mut out = Vec::new();
        // "bc" (-3) beats "ab" (-5); then "a"+"bc" = "abc" is a token
        model.encode(&ids, "abc", &mut out);
        assert_eq!(out, [8]);
        out.clear();
        model.encode(&ids, " ab", &mut out);
        // "▁a" (-4) beats "ab" (-5)
        assert_eq!(out, [7, 3]);
    }

    #[test]
    fn byte_fallback_for_unknown_characters() {
        let (ids, model) = model();
        let mut out = Vec::new();
        model.encode(&ids, "aé", &mut out);
        // é = C3 A9 → <0xC3> <0xA9>, ids 9 + byte
        assert_eq!(out, [2, 9 + 0xC3, 9 + 0xA9]);
    }
}
