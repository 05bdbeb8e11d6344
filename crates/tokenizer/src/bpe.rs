//! Step 3 for `tokenizer.ggml.model = gpt2`: byte-level BPE with ranked merges, as llama.cpp's
//! `llm_tokenizer_bpe_session`.
//!
//! Each pre-tokenized word starts as one symbol per byte. The adjacent pair with the lowest merge rank
//! (ties: the leftmost) is merged, again and again, until no adjacent pair has a merge; each final
//! symbol is then looked up in the vocabulary. The vocabulary and merges are stored in GPT-2's byte
//! alphabet (`Ġ` for a space); this module decodes them once to raw bytes and works on bytes, which is
//! the same computation because the alphabet is a bijection. Strings are interned: every vocabulary
//! token, merge part and merge result gets a number, so a merge is a lookup of a pair of numbers.
//!
//! Quirk kept: when a final symbol is not in the vocabulary, llama.cpp looks up each byte of its
//! *byte-alphabet* spelling as a one-byte token and drops the bytes that have none.

use crate::unicode::{byte_to_char, decode_byte_level};
use rustc_hash::FxHashMap as HashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A mergeable adjacent pair in the work queue, ordered by (rank, left index): the queue pops the
/// best rank, then the leftmost pair. The ids of both sides detect entries made stale by later merges.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct QueuedPair {
    rank: u32,
    left: u32,
    right: u32,
    left_id: u32,
    right_id: u32,
}

/// The merge table and interned strings of a byte-level BPE vocabulary.
pub struct BytePairModel {
    /// Interned string (raw bytes) → number. Numbers below `n_vocab` are token ids.
    strings: HashMap<Box<[u8]>, u32>,
    /// Number of each single raw byte.
    byte_symbol: [u32; 256],
    /// (left, right) → (rank, merged).
    merges: HashMap<(u32, u32), (u32, u32)>,
    n_vocab: u32,
    /// For each raw byte: the tokens llama.cpp's fallback emits for it (see the module header).
    byte_fallback: Vec<Vec<u32>>,
    ignore_merges: bool,
}

impl BytePairModel {
    /// Builds the model from the vocabulary (byte-alphabet strings, index = token id) and the merges
    /// (`"left right"`, rank = index). Tokens whose text is not in the byte alphabet (such as special
    /// tokens containing a space) can only be produced by the special-token pass, as in llama.cpp.
    pub fn new(tokens: &[&str], merges: &[&str], ignore_merges: bool) -> BytePairModel {
        let n_vocab = tokens.len() as u32;
        let mut strings: HashMap<Box<[u8]>, u32> = HashMap::default();
        strings.reserve(tokens.len() + merges.len());
        for (id, text) in tokens.iter().enumerate() {
            if let Some(bytes) = decode_byte_level(text) {
                // later duplicates win, as in llama.cpp's token_to_id map
                strings.insert(bytes.into_boxed_slice(), id as u32);
            }
        }
        let mut next = n_vocab;
        let mut intern = |strings: &mut HashMap<Box<[u8]>, u32>, bytes: Vec<u8>| -> u32 {
            *strings.entry(bytes.into_boxed_slice()).or_insert_with(|| {
                next += 1;
                next - 1
            })
        };
        let mut byte_symbol = [0u32; 256];
        for (byte, slot) in byte_symbol.iter_mut().enumerate() {
            *slot = intern(&mut strings, vec![byte as u8]);
        }
        let mut merge_table = HashMap::default();
        merge_table.reserve(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first character
            let Some(split) = merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i) else {
                continue;
            };
            let (Some(left), Some(right)) =
                (decode_byte_level(&merge[..split]), decode_byte_level(&merge[split + 1..]))
            else {
                continue;
            };
            let mut joined = left.clone();
            joined.extend_from_slice(&right);
            let left = intern(&mut strings, left);
            let right = intern(&mut strings, right);
            let joined = intern(&mut strings, joined);
            // the first occurrence of a pair keeps its rank
            merge_table.entry((left, right)).or_insert((rank as u32, joined));
        }
        let single_char_tokens: HashMap<&str, u32> =
            tokens.iter().enumerate().filter(|(_, t)| t.len() == 1).map(|(id, t)| (*t, id as u32)).collect();
        let byte_fallback = (0..=255u8)
            .map(|byte| {
                let mut utf8 = [0u8; 4];
                let spelled = byte_to_char(byte).encode_utf8(&mut utf8);
                spelled
                    .as_bytes()
                    .iter()
                    .filter_map(|b| std::str::from_utf8(std::slice::from_ref(b)).ok())
                    .filter_map(|s| single_char_tokens.get(s).copied())
                    .collect()
            })
            .collect();
        BytePairModel { strings, byte_symbol, merges: merge_table, n_vocab, byte_fallback, ignore_merges }
    }

    /// The token id whose (raw-byte) text is `bytes`, if any.
    fn token(&self, bytes: &[u8]) -> Option<u32> {
        self.strings.get(bytes).copied().filter(|&id| id < self.n_vocab)
    }

    /// Appends the tokens of one pre-tokenized word.
    pub fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            if let Some(id) = self.token(word) {
                out.push(id);
                return;
            }
        }
        // symbol i covers word[start[i]..start[next[i]]]; `id` is its interned string
        #[derive(Clone, Copy)]
        struct Symbol {
            id: u32,
            start: u32,
            len: u32,
            prev: i32,
            next: i32,
        }
        let n = word.len();
        let mut symbols: Vec<Symbol> = word
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.byte_symbol[b as usize],
                start: i as u32,
                len: 1,
                prev: i as i32 - 1,
                next: if i + 1 == n { -1 } else { i as i32 + 1 },
            })
            .collect();
        let mut queue: BinaryHeap<Reverse<QueuedPair>> = BinaryHeap::new();
        let push_pair = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: i32, right: i32| {
            if left < 0 || right < 0 {
                return;
            }
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            if let Some(&(rank, _)) = self.merges.get(&(l.id, r.id)) {
                queue.push(Reverse(QueuedPair {
                    rank,
                    left: left as u32,
                    right: right as u32,
                    left_id: l.id,
                    right_id: r.id,
                }));
            }
        };
        for i in 1..n {
            push_pair(&mut queue, &symbols, i as i32 - 1, i as i32);
        }
        while let Some(Reverse(QueuedPair { left, right, left_id, right_id, .. })) = queue.pop() {
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            if l.len == 0 || r.len == 0 || l.id != left_id || r.id != right_id || l.next != right as i32 {
                continue; // outdated
            }
            let Some(&(_, merged)) = self.merges.get(&(l.id, r.id)) else {
                continue;
            };
            symbols[left as usize].id = merged;
            symbols[left as usize].len += r.len;
            symbols[left as usize].next = r.next;
            symbols[right as usize].len = 0;
            if r.next >= 0 {
                symbols[r.next as usize].prev = left as i32;
            }
            push_pair(&mut queue, &symbols, l.prev, left as i32);
            push_pair(&mut queue, &symbols, left as i32, r.next);
        }
        let mut i = 0i32;
        while i >= 0 {
            let s = symbols[i as usize];
            let bytes = &word[s.start as usize..(s.start + s.len) as usize];
            match self.token(bytes) {
                Some(id) => out.push(id),
                None => {
                    for &b in bytes {
                        out.extend_from_slice(&self.byte_fallback[b as usize]);
                    }
                }
            }
            i = s.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_by_rank_then_leftmost() {
        // vocabulary in the byte alphabet: "Ġ" is a space
        let tokens = ["a", "b", "c", "Ġ", "ab", "bc", "abc", "Ġa"];
        // "b c" has the best rank, so "abc" is built as a + bc, not ab + c
        let merges = ["b c", "a b", "a bc", "Ġ a"];
        let model = BytePairModel::new(&tokens, &merges, false);
        let mut out = Vec::new();
        model.encode_word(b"abc", &mut out);
        assert_eq!(out, [6]);
        out.clear();
        model.encode_word(b"abab", &mut out);
        assert_eq!(out, [4, 4]);
        out.clear();
        model.encode_word(b" ab", &mut out);
        // " a" (rank 3) loses to "a b" (rank 1)
        assert_eq!(out, [3, 4]);
    }

    #[test]
    fn unknown_bytes_fall_back_per_byte() {
        let tokens = ["a", "Ã", "©"];
        let model = BytePairModel::new(&tokens, &[], false);
        let mut out = Vec::new();
        // 'é' is the bytes C3 A9, which the byte alphabet spells "Ã" and "©": both are tokens
        model.encode_word("aé".as_bytes(), &mut out);
        assert_eq!(out, [0, 1, 2]);
        out.clear();
        model.encode_word(b"az", &mut out);
        assert_eq!(out, [0], "a byte with no token is dropped");
    }

    #[test]
    fn ignore_merges_takes_whole_words() {
        let tokens = ["a", "b", "ab", "abab"];
        let merges = ["a b"];
        let mut out = Vec::new();
        BytePairModel::new(&tokens, &merges, true).encode_word(b"abab", &mut out);
        assert_eq!(out, [3]);
        out.clear();
        BytePairModel::new(&tokens, &merges, false).encode_word(b"abab", &mut out);
        assert_eq!(out, [2, 2]);
    }
}
