//! Step 1 of encoding: cut special-token text out of the input before anything else, as llama.cpp's
//! `tokenizer_st_partition`.
//!
//! The candidates are every token whose type is CONTROL, USER_DEFINED or UNKNOWN, taken **longest text
//! first** (ties by id). For each candidate in that order, every remaining text fragment is split at
//! all of the candidate's non-overlapping occurrences, left to right. With `parse_special = false`,
//! CONTROL and UNKNOWN tokens are skipped but USER_DEFINED tokens are still cut out (Gemma's whitespace
//! runs such as `"\n\n"` and `"  "` are USER_DEFINED, so they become single tokens even in plain text).
//!
//! An Aho-Corasick pass first finds which candidates occur in the input at all, so only those are
//! tried; that changes nothing in the result, since a candidate absent from the input is absent from
//! every fragment of it.

use aho_corasick::{AhoCorasick, MatchKind};
use std::ops::Range;

/// A piece of the input after special-token splitting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fragment {
    /// Raw text still to tokenize (a byte range of the input).
    Text(Range<usize>),
    /// A special token, already decided.
    Token(u32),
}

/// One special-token candidate.
struct Candidate {
    id: u32,
    text: Box<str>,
    /// CONTROL or UNKNOWN: only cut out when `parse_special` is set.
    needs_parse_special: bool,
}

/// The special-token candidates of a vocabulary, longest first.
pub struct SpecialTokens {
    candidates: Vec<Candidate>,
    finder: Option<AhoCorasick>,
}

impl SpecialTokens {
    /// `tokens` yields (id, text, needs_parse_special) for every CONTROL / USER_DEFINED / UNKNOWN token.
    pub fn new(tokens: impl Iterator<Item = (u32, Box<str>, bool)>) -> SpecialTokens {
        let mut candidates: Vec<Candidate> = tokens
            .filter(|(_, text, _)| !text.is_empty())
            .map(|(id, text, needs_parse_special)| Candidate { id, text, needs_parse_special })
            .collect();
        candidates.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        let finder = if candidates.is_empty() {
            None
        } else {
            AhoCorasick::builder()
                .match_kind(MatchKind::Standard)
                .build(candidates.iter().map(|c| c.text.as_bytes()))
                .ok()
        };
        SpecialTokens { candidates, finder }
    }

    /// Splits `text` into raw-text fragments and special tokens.
    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text(0..text.len())];
        let mut present = vec![false; self.candidates.len()];
        match &self.finder {
            Some(finder) => {
                for m in finder.find_overlapping_iter(text) {
                    present[m.pattern().as_usize()] = true;
                }
            }
            // no automaton (none built): try every candidate
            None => present.iter_mut().for_each(|p| *p = true),
        }
        for (candidate, _) in self.candidates.iter().zip(&present).filter(|(_, &p)| p) {
            if candidate.needs_parse_special && !parse_special {
                continue;
            }
            let needle = &*candidate.text;
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text(range) = fragment else {
                    next.push(fragment);
                    continue;
                };
                let mut start = range.start;
                // matches of a valid UTF-8 needle fall on character boundaries
                while let Some(found) = text.get(start..range.end).and_then(|rest| rest.find(needle)) {
                    let at = start + found;
                    if at > start {
                        next.push(Fragment::Text(start..at));
                    }
                    next.push(Fragment::Token(candidate.id));
                    start = at + needle.len();
                }
                if start < range.end {
                    next.push(Fragment::Text(start..range.end));
                }
            }
            fragments = next;
        }
        fragments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> SpecialTokens {
        let tokens: Vec<(u32, Box<str>, bool)> = vec![
            (1, "<s>".into(), true),
            (2, "<|im_start|>".into(), true),
            (3, "\n".into(), false),
            (4, "\n\n".into(), false),
            (5, "<|im".into(), true),
        ];
        SpecialTokens::new(tokens.into_iter())
    }

    #[test]
    fn longest_candidates_first() {
        use Fragment::*;
        let text = "<|im_start|>user\n\n\nhi<s>";
        assert_eq!(
            specials().partition(text, true),
            [Token(2), Text(12..16), Token(4), Token(3), Text(19..21), Token(1)]
        );
        // without parse_special only the user-defined "\n" tokens are cut out
        assert_eq!(specials().partition(text, false), [Text(0..16), Token(4), Token(3), Text(19..24)]);
        assert_eq!(specials().partition("", true), []);
        assert_eq!(specials().partition("<|im_x", true), [Token(5), Text(4..6)]);
    }
}
