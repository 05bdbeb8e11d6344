//! Step 2 of encoding: split a text fragment into words before byte-level BPE, exactly as llama.cpp's
//! `unicode_regex_split` does for each `tokenizer.ggml.pre` value.
//!
//! llama.cpp applies a *list* of regexes in turn: each one refines every chunk the previous one made,
//! and both its matches and the unmatched gaps between them become chunks. The lists reproduced here
//! (names are `tokenizer.ggml.pre` values):
//!
//! | pre-tokenizer | regexes, in order |
//! | --- | --- |
//! | `gpt-2` ([`PreTokenizer::Gpt2`]) | GPT-2: `'s\|'t\|'re\|'ve\|'m\|'ll\|'d\| ?\p{L}+\| ?\p{N}+\| ?[^\s\p{L}\p{N}]+\|\s+(?!\S)` |
//! | `smollm`, `starcoder`, … ([`PreTokenizer::Smollm`]) | `\p{N}` (every digit alone), then GPT-2 |
//! | `default` ([`PreTokenizer::Default`]) | `[\p{P}\$\+<=>\^~\|]+`, GPT-2, `\p{N}+`, `[0-9][0-9][0-9]` |
//! | `llama3`, `llama-bpe` ([`PreTokenizer::Llama3`]) | `(?i:'s\|'t\|'re\|'ve\|'m\|'ll\|'d)\|[^\r\n\p{L}\p{N}]?\p{L}+\|\p{N}{1,3}\| ?[^\s\p{L}\p{N}]+[\r\n]*\|\s*[\r\n]+\|\s+(?!\S)\|\s+` |
//! | `qwen2` ([`PreTokenizer::Qwen2`]) | the Llama 3 regex with `\p{N}` instead of `\p{N}{1,3}` |
//!
//! The GPT-2 and Llama 3 regexes are hand-written scanners in llama.cpp (`unicode_regex_split_custom_*`)
//! and here; the others go through `std::regex` there and are simple class runs here. Quirk kept on
//! purpose: the GPT-2 scanner has no trailing `|\s+`, so a run of whitespace before a non-space keeps
//! its last character for the next word (`"a  b"` → `a`, ` `, ` b`), and a run at the end of a chunk
//! stays whole.

use crate::unicode::{class_of, LETTER, NUMBER, PUNCTUATION, WHITESPACE};
use std::ops::Range;

/// The pre-tokenizer of a byte-level BPE vocabulary, chosen by `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `default` (and a missing key): punctuation runs, GPT-2, number runs, ASCII digit triples.
    Default,
    /// `gpt-2`, `phi-2`, `mpt`, `olmo`, …: the GPT-2 regex alone.
    Gpt2,
    /// `smollm`, `starcoder`, `refact`, `command-r`, …: every digit alone, then GPT-2.
    Smollm,
    /// `llama3`, `llama-v3`, `llama-bpe`, …: the Llama 3 regex (digits in groups of up to three).
    Llama3,
    /// `qwen2`, `deepseek-r1-qwen`, `stablelm2`: the Llama 3 regex with every digit alone.
    Qwen2,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value, or `None` if unsupported.
    pub fn from_name(pre: &str) -> Option<PreTokenizer> {
        Some(match pre {
            "default" => PreTokenizer::Default,
            "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion" | "jina-es" | "jina-de" | "gigachat"
            | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum" => PreTokenizer::Gpt2,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
                PreTokenizer::Smollm
            }
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
                PreTokenizer::Llama3
            }
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "hunyuan" => PreTokenizer::Qwen2,
            _ => return None,
        })
    }

    /// Whether llama.cpp sets `ignore_merges` for this pre-tokenizer: a word that is already a
    /// token is emitted whole, without running the merges.
    pub fn ignores_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    fn steps(self) -> &'static [Step] {
        match self {
            PreTokenizer::Default => &[Step::PunctuationRuns, Step::Gpt2, Step::NumberRuns, Step::AsciiDigitTriples],
            PreTokenizer::Gpt2 => &[Step::Gpt2],
            PreTokenizer::Smollm => &[Step::EachNumber, Step::Gpt2],
            PreTokenizer::Llama3 => &[Step::Llama3 { max_digits: 3 }],
            PreTokenizer::Qwen2 => &[Step::Llama3 { max_digits: 1 }],
        }
    }

    /// Splits `text` into words; returns their byte ranges, in order, covering all of `text`.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let mut offsets: Vec<usize> = Vec::with_capacity(text.len() + 1);
        let mut chars: Vec<char> = Vec::with_capacity(text.len());
        for (i, c) in text.char_indices() {
            offsets.push(i);
            chars.push(c);
        }
        offsets.push(text.len());
        let mut chunks = if chars.is_empty() { Vec::new() } else { vec![chars.len()] };
        for step in self.steps() {
            chunks = step.apply(&chars, &chunks);
        }
        let mut start = 0;
        chunks
            .into_iter()
            .map(|len| {
                let range = offsets[start]..offsets[start + len];
                start += len;
                range
            })
            .collect()
    }
}

/// One regex of a pre-tokenizer's list.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// `\p{N}`: every number character alone.
    EachNumber,
    /// `\p{N}+`.
    NumberRuns,
    /// `[0-9][0-9][0-9]`.
    AsciiDigitTriples,
    /// `[\p{P}\$\+<=>\^~\|]+`.
    PunctuationRuns,
    /// The GPT-2 regex.
    Gpt2,
    /// The Llama 3 regex, with `\p{N}{1,max_digits}`.
    Llama3 { max_digits: usize },
}

impl Step {
    /// Refines chunks (given as lengths in characters) into smaller chunks.
    fn apply(self, chars: &[char], chunks: &[usize]) -> Vec<usize> {
        let mut out = Vec::with_capacity(chunks.len() * 2);
        let mut start = 0;
        for &len in chunks {
            let chunk = &chars[start..start + len];
            start += len;
            let mut words = Words { out: &mut out, prev_end: 0 };
            match self {
                Step::EachNumber => split_runs(chunk, &mut words, |c| class_of(c) & NUMBER != 0, true),
                Step::NumberRuns => split_runs(chunk, &mut words, |c| class_of(c) & NUMBER != 0, false),
                Step::PunctuationRuns => split_runs(
                    chunk,
                    &mut words,
                    |c| class_of(c) & PUNCTUATION != 0 || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|'),
                    false,
                ),
                Step::AsciiDigitTriples => split_ascii_digit_triples(chunk, &mut words),
                Step::Gpt2 => split_gpt2(chunk, &mut words),
                Step::Llama3 { max_digits } => split_llama3(chunk, &mut words, max_digits),
            }
            words.end_at(chunk.len());
        }
        out
    }
}

/// Collects word lengths: `end_at(pos)` closes the word that started where the previous one ended.
struct Words<'a> {
    out: &'a mut Vec<usize>,
    prev_end: usize,
}

impl Words<'_> {
    fn end_at(&mut self, end: usize) {
        if end > self.prev_end {
            self.out.push(end - self.prev_end);
        }
        self.prev_end = end;
    }
}

/// A regex that is one character class, `[class]` (`single`) or `[class]+`: matches and the gaps
/// between them become words.
fn split_runs(chunk: &[char], words: &mut Words, is_in_class: impl Fn(char) -> bool, single: bool) {
    let mut pos = 0;
    while pos < chunk.len() {
        if is_in_class(chunk[pos]) {
            words.end_at(pos);
            pos += 1;
            while !single && pos < chunk.len() && is_in_class(chunk[pos]) {
                pos += 1;
            }
            words.end_at(pos);
        } else {
            pos += 1;
        }
    }
}

fn split_ascii_digit_triples(chunk: &[char], words: &mut Words) {
    let mut pos = 0;
    while pos < chunk.len() {
        if pos + 3 <= chunk.len() && chunk[pos..pos + 3].iter().all(char::is_ascii_digit) {
            words.end_at(pos);
            pos += 3;
            words.end_at(pos);
        } else {
            pos += 1;
        }
    }
}

/// Class flags of the character at `pos`, or 0 past the end of the chunk (llama.cpp's
/// out-of-range flags). `OTHER` marks "some character" so that "not letter, number, space" can be
/// told apart from "no character".
const OTHER: u8 = 0x80;

#[inline]
fn flags_at(chunk: &[char], pos: usize) -> u8 {
    chunk.get(pos).map_or(0, |&c| class_of(c) | OTHER)
}

#[inline]
fn is_other(flags: u8) -> bool {
    flags != 0 && flags & (WHITESPACE | LETTER | NUMBER) == 0
}

/// Length of the whitespace run starting at `pos`.
fn whitespace_run(chunk: &[char], pos: usize) -> usize {
    chunk[pos..].iter().take_while(|&&c| class_of(c) & WHITESPACE != 0).count()
}

/// llama.cpp's `unicode_regex_split_custom_gpt2`.
fn split_gpt2(chunk: &[char], words: &mut Words) {
    let n = chunk.len();
    let mut pos = 0;
    while pos < n {
        let c = chunk[pos];
        // 's|'t|'re|'ve|'m|'ll|'d
        if c == '\'' && pos + 1 < n {
            let next = chunk[pos + 1];
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += 2;
                words.end_at(pos);
                continue;
            }
            if pos + 2 < n && matches!((next, chunk[pos + 2]), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                pos += 3;
                words.end_at(pos);
                continue;
            }
        }
        let space = usize::from(c == ' ');
        let flags = flags_at(chunk, pos + space);
        // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
        let same_kind: Option<fn(u8) -> bool> = if flags & LETTER != 0 {
            Some(|f| f & LETTER != 0)
        } else if flags & NUMBER != 0 {
            Some(|f| f & NUMBER != 0)
        } else if is_other(flags) {
            Some(is_other)
        } else {
            None
        };
        if let Some(same_kind) = same_kind {
            pos += space;
            while same_kind(flags_at(chunk, pos)) {
                pos += 1;
            }
            words.end_at(pos);
            continue;
        }
        let spaces = whitespace_run(chunk, pos);
        if spaces > 1 && pos + spaces < n {
            // \s+(?!\S): leave the last whitespace character for the next word
            pos += spaces - 1;
            words.end_at(pos);
            continue;
        }
        pos += spaces.max(1);
        words.end_at(pos);
    }
}

/// llama.cpp's `unicode_regex_split_custom_llama3`; with `max_digits = 1` it is the Qwen 2 regex.
fn split_llama3(chunk: &[char], words: &mut Words, max_digits: usize) {
    let n = chunk.len();
    let mut pos = 0;
    while pos < n {
        let c = chunk[pos];
        let flags = flags_at(chunk, pos);
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' && pos + 1 < n {
            let next = chunk[pos + 1].to_ascii_lowercase();
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += 2;
                words.end_at(pos);
                continue;
            }
            if pos + 2 < n
                && matches!((next, chunk[pos + 2].to_ascii_lowercase()), ('r', 'e') | ('v', 'e') | ('l', 'l'))
            {
                pos += 3;
                words.end_at(pos);
                continue;
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || flags & NUMBER != 0)
            && (flags & LETTER != 0 || flags_at(chunk, pos + 1) & LETTER != 0)
        {
            pos += 1;
            while flags_at(chunk, pos) & LETTER != 0 {
                pos += 1;
            }
            words.end_at(pos);
            continue;
        }
        // \p{N}{1,max_digits}
        if flags & NUMBER != 0 {
            let mut group_start = pos;
            while flags_at(chunk, pos) & NUMBER != 0 {
                pos += 1;
                if pos - group_start >= max_digits {
                    words.end_at(pos);
                    group_start = pos;
                }
            }
            words.end_at(pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let space = usize::from(c == ' ');
        if is_other(flags_at(chunk, pos + space)) {
            pos += space;
            while is_other(flags_at(chunk, pos)) {
                pos += 1;
            }
            while pos < n && matches!(chunk[pos], '\r' | '\n') {
                pos += 1;
            }
            words.end_at(pos);
            continue;
        }
        let spaces = whitespace_run(chunk, pos);
        // \s*[\r\n]+: up to the last line break of the whitespace run
        if let Some(last_break) = chunk[pos..pos + spaces].iter().rposition(|&c| c == '\r' || c == '\n') {
            pos += last_break + 1;
            words.end_at(pos);
            continue;
        }
        if spaces > 1 && pos + spaces < n {
            // \s+(?!\S)
            pos += spaces - 1;
            words.end_at(pos);
            continue;
        }
        // \s+, or a lone character nothing matched
        pos += spaces.max(1);
        words.end_at(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::PreTokenizer::{self, *};

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_basic_words_and_contractions() {
        assert_eq!(words(Gpt2, "Hello, world!"), ["Hello", ",", " world", "!"]);
        assert_eq!(words(Gpt2, "I'm sure you'll"), ["I", "'m", " sure", " you", "'ll"]);
        // contractions are case-sensitive in the GPT-2 regex
        assert_eq!(words(Gpt2, "I'M"), ["I", "'", "M"]);
        assert_eq!(words(Gpt2, ""), Vec::<&str>::new());
    }

    #[test]
    fn gpt2_whitespace_runs() {
        // \s+(?!\S) leaves the last space to prefix the next word; a run at the end stays whole
        assert_eq!(words(Gpt2, "a  b"), ["a", " ", " b"]);
        assert_eq!(words(Gpt2, "  two  "), [" ", " two", "  "]);
        assert_eq!(words(Gpt2, "x\n\n\ny"), ["x", "\n\n", "\n", "y"]);
        assert_eq!(words(Gpt2, "a\tb"), ["a", "\t", "b"]);
        assert_eq!(words(Gpt2, "Line one.\r\nLine"), ["Line", " one", ".", "\r", "\n", "Line"]);
        assert_eq!(words(Gpt2, " "), [" "]);
        assert_eq!(words(Gpt2, "\u{a0}non"), ["\u{a0}", "non"]);
    }

    #[test]
    fn gpt2_numbers_and_symbols() {
        assert_eq!(words(Gpt2, "x 12345 3.14"), ["x", " 12345", " 3", ".", "14"]);
        assert_eq!(words(Gpt2, " -42 $100"), [" -", "42", " $", "100"]);
        assert_eq!(words(Gpt2, "😀🚀 ©®"), ["😀🚀", " ©®"]);
    }

    #[test]
    fn smollm_splits_every_digit() {
        assert_eq!(words(Smollm, "Numbers: 12 3.14"), ["Numbers", ":", " ", "1", "2", " ", "3", ".", "1", "4"]);
        assert_eq!(words(Smollm, "1e10"), ["1", "e", "1", "0"]);
        assert_eq!(words(Smollm, "x²"), ["x", "²"]);
    }

    #[test]
    fn llama3_digits_and_newlines() {
        assert_eq!(words(Llama3, "12345 1e10"), ["123", "45", " ", "1", "e", "10"]);
        assert_eq!(words(Llama3, "I'M done"), ["I", "'M", " done"]);
        assert_eq!(words(Llama3, "a\tb"), ["a", "\tb"]);
        assert_eq!(words(Llama3, "a.\r\n\r\nb"), ["a", ".\r\n\r\n", "b"]);
        assert_eq!(words(Llama3, "x  \n  y"), ["x", "  \n", " ", " y"]);
        assert_eq!(words(Llama3, "end  "), ["end", "  "]);
        assert_eq!(words(Llama3, "$100 (ok)"), ["$", "100", " (", "ok", ")"]);
    }

    #[test]
    fn qwen2_splits_every_digit() {
        assert_eq!(words(Qwen2, "2024 年"), ["2", "0", "2", "4", " 年"]);
        assert_eq!(words(Qwen2, "Привет, мир!"), ["Привет", ",", " мир", "!"]);
    }

    #[test]
    fn default_pre_tokenizer() {
        assert_eq!(words(Default, "a+b=c, 12345!"), ["a", "+", "b", "=", "c", ",", " ", "123", "45", "!"]);
    }

    #[test]
    fn unicode_letters_and_marks() {
        // combining marks are neither letters nor numbers: they form their own "other" run
        assert_eq!(words(Gpt2, "cafe\u{301} naïve"), ["cafe", "\u{301}", " naïve"]);
        assert_eq!(words(Gpt2, "日本語のテキスト"), ["日本語のテキスト"]);
        assert_eq!(words(Gpt2, "zero\u{200b}width"), ["zero", "\u{200b}", "width"]);
    }

    #[test]
    fn names() {
        assert_eq!(PreTokenizer::from_name("smollm"), Some(Smollm));
        assert_eq!(PreTokenizer::from_name("llama-bpe"), Some(Llama3));
        assert_eq!(PreTokenizer::from_name("qwen2"), Some(Qwen2));
        assert_eq!(PreTokenizer::from_name("gpt-2"), Some(Gpt2));
        assert_eq!(PreTokenizer::from_name("default"), Some(Default));
        assert_eq!(PreTokenizer::from_name("klingon"), None);
    }
}
