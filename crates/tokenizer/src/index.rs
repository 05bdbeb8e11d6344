//! [`TokenIndex`]: every token's text stored back to back, with a text → id hash index that needs no
//! allocation per token (a vocabulary of 262k tokens builds in a few milliseconds).

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;
use std::hash::BuildHasher;

/// Byte strings stored back to back, indexed by position.
#[derive(Default)]
pub struct Packed {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl Packed {
    /// An empty store with room for `n` strings.
    pub fn with_capacity(n: usize) -> Packed {
        Packed { bytes: Vec::with_capacity(n * 8), ends: Vec::with_capacity(n) }
    }

    /// Appends a string.
    pub fn push(&mut self, item: &[u8]) {
        self.bytes.extend_from_slice(item);
        self.ends.push(self.bytes.len() as u32);
    }

    /// Appends a string written by `write` into the store's buffer.
    pub fn push_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        write(&mut self.bytes);
        self.ends.push(self.bytes.len() as u32);
    }

    /// String `i` (empty if out of range).
    pub fn get(&self, i: usize) -> &[u8] {
        let Some(&end) = self.ends.get(i) else {
            return &[];
        };
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        self.bytes.get(start as usize..end as usize).unwrap_or_default()
    }

    /// Number of strings.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are no strings.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
}

/// Token texts by id, and ids by text.
pub struct TokenIndex {
    texts: Packed,
    table: HashTable<u32>,
    hasher: FxBuildHasher,
}

impl TokenIndex {
    /// Indexes `texts` (position = token id). For duplicate texts the last id wins, as in llama.cpp.
    pub fn new(texts: Packed) -> TokenIndex {
        let hasher = FxBuildHasher;
        let mut table: HashTable<u32> = HashTable::with_capacity(texts.len());
        for id in 0..texts.len() {
            let text = texts.get(id);
            let hash = hasher.hash_one(text);
            match table.find_mut(hash, |&other| texts.get(other as usize) == text) {
                Some(slot) => *slot = id as u32,
                None => {
                    table.insert_unique(hash, id as u32, |&other| hasher.hash_one(texts.get(other as usize)));
                }
            }
        }
        TokenIndex { texts, table, hasher }
    }

    /// Builds the index from string slices.
    pub fn from_texts<'a>(texts: impl IntoIterator<Item = &'a str>) -> TokenIndex {
        let mut packed = Packed::default();
        for text in texts {
            packed.push(text.as_bytes());
        }
        TokenIndex::new(packed)
    }

    /// The id of the token whose text is exactly `text`.
    #[inline]
    pub fn get(&self, text: &str) -> Option<u32> {
        self.get_bytes(text.as_bytes())
    }

    /// The id of the token whose text is exactly `bytes`.
    #[inline]
    pub fn get_bytes(&self, bytes: &[u8]) -> Option<u32> {
        let hash = self.hasher.hash_one(bytes);
        self.table.find(hash, |&id| self.texts.get(id as usize) == bytes).copied()
    }

    /// The text of token `id` (empty if out of range).
    pub fn text(&self, id: u32) -> &str {
        std::str::from_utf8(self.texts.get(id as usize)).unwrap_or_default()
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.texts.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_both_ways_and_last_duplicate_wins() {
        let index = TokenIndex::from_texts(["a", "bc", "", "a"]);
        assert_eq!(index.get("a"), Some(3));
        assert_eq!(index.get("bc"), Some(1));
        assert_eq!(index.get("b"), None);
        assert_eq!(index.text(1), "bc");
        assert_eq!(index.text(9), "");
        assert_eq!(index.len(), 4);
    }
}
