//! Code-point classes and the GPT-2 byte-to-character alphabet, as llama.cpp's `unicode.cpp` uses them.
//!
//! - [`class_of`] gives the flags the pre-tokenizers test: letter (`\p{L}`), number (`\p{N}`),
//!   punctuation (`\p{P}`) and whitespace (`\s`). Whitespace is the Unicode `White_Space` set that
//!   llama.cpp's `unicode_set_whitespace` holds (so U+001C..U+001F are *not* whitespace, unlike
//!   Python's `str.isspace`). The general categories come from the Unicode tables inside
//!   `regex-syntax`, expanded once into a flat per-code-point table.
//! - [`byte_to_char`] / [`char_to_byte`] are GPT-2's `bytes_to_unicode` bijection: the 188 printable
//!   Latin-1 bytes stand for themselves, the other 68 are moved to U+0100.. in byte order. Byte-level
//!   BPE vocabularies (`tokenizer.ggml.model = gpt2`) store every token in this alphabet.

use std::sync::OnceLock;

/// The code point is a letter (`\p{L}`).
pub const LETTER: u8 = 1;
/// The code point is a number (`\p{N}`).
pub const NUMBER: u8 = 2;
/// The code point is whitespace (`\s`, Unicode `White_Space`).
pub const WHITESPACE: u8 = 4;
/// The code point is punctuation (`\p{P}`).
pub const PUNCTUATION: u8 = 8;

/// Unicode `White_Space`, the set llama.cpp's `unicode_set_whitespace` holds.
const WHITESPACE_CODE_POINTS: &[u32] = &[
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006,
    0x2007, 0x2008, 0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
];

const CODE_POINTS: usize = 0x11_0000;

fn table() -> &'static [u8] {
    static TABLE: OnceLock<Vec<u8>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = vec![0u8; CODE_POINTS];
        for (pattern, flag) in [(r"\p{L}", LETTER), (r"\p{N}", NUMBER), (r"\p{P}", PUNCTUATION)] {
            for (start, end) in unicode_class_ranges(pattern) {
                for entry in &mut table[start as usize..=end as usize] {
                    *entry |= flag;
                }
            }
        }
        for &cp in WHITESPACE_CODE_POINTS {
            table[cp as usize] |= WHITESPACE;
        }
        table
    })
}

/// The inclusive code-point ranges of a Unicode class such as `\p{L}`, from regex-syntax's tables.
fn unicode_class_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let Ok(hir) = regex_syntax::Parser::new().parse(pattern) else {
        debug_assert!(false, "static class pattern {pattern} must parse");
        return Vec::new();
    };
    match hir.kind() {
        HirKind::Class(Class::Unicode(class)) => {
            class.ranges().iter().map(|r| (u32::from(r.start()), u32::from(r.end()))).collect()
        }
        _ => Vec::new(),
    }
}

/// The class flags ([`LETTER`], [`NUMBER`], [`WHITESPACE`], [`PUNCTUATION`]) of a character.
#[inline]
pub fn class_of(c: char) -> u8 {
    table()[c as usize]
}

/// Forces the class table to be built now (it is otherwise built on first use).
pub fn warm_up() {
    let _ = table();
}

/// The GPT-2 alphabet has code points below U+0144.
const ALPHABET_END: usize = 0x144;

fn byte_maps() -> &'static ([char; 256], [Option<u8>; ALPHABET_END]) {
    static MAPS: OnceLock<([char; 256], [Option<u8>; ALPHABET_END])> = OnceLock::new();
    MAPS.get_or_init(|| {
        let mut to_char = ['\0'; 256];
        let mut to_byte = [None; ALPHABET_END];
        let mut next = 256u32;
        for byte in 0..=255u8 {
            let printable = matches!(byte, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            let cp = if printable {
                u32::from(byte)
            } else {
                next += 1;
                next - 1
            };
            to_char[byte as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
            if let Some(slot) = to_byte.get_mut(cp as usize) {
                *slot = Some(byte);
            }
        }
        (to_char, to_byte)
    })
}

/// GPT-2's character for a raw byte (`' '` → `'Ġ'`, `'\n'` → `'Ċ'`, `'a'` → `'a'`).
#[inline]
pub fn byte_to_char(byte: u8) -> char {
    byte_maps().0[byte as usize]
}

/// The raw byte a GPT-2 alphabet character stands for, or `None` outside the alphabet.
#[inline]
pub fn char_to_byte(c: char) -> Option<u8> {
    byte_maps().1.get(c as usize).copied().flatten()
}

/// Decodes a string written in the GPT-2 byte alphabet to raw bytes; `None` if any character is
/// outside the alphabet.
pub fn decode_byte_level(text: &str) -> Option<Vec<u8>> {
    text.chars().map(char_to_byte).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(class_of('a'), LETTER);
        assert_eq!(class_of('Ж'), LETTER);
        assert_eq!(class_of('日'), LETTER);
        assert_eq!(class_of('7'), NUMBER);
        assert_eq!(class_of('²'), NUMBER);
        assert_eq!(class_of('٣'), NUMBER);
        assert_eq!(class_of(' '), WHITESPACE);
        assert_eq!(class_of('\u{a0}'), WHITESPACE);
        assert_eq!(class_of('\u{2009}'), WHITESPACE);
        assert_eq!(class_of('\u{200b}'), 0, "zero-width space is a format character, not whitespace");
        assert_eq!(class_of('\u{1c}'), 0);
        assert_eq!(class_of('!'), PUNCTUATION);
        assert_eq!(class_of('$'), 0, "$ is a symbol, not punctuation");
        assert_eq!(class_of('😀'), 0);
        assert_eq!(class_of('\u{301}'), 0, "combining marks are not letters");
    }

    #[test]
    fn byte_alphabet_is_a_bijection() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xAD), 'Ń');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte(' '), None);
        assert_eq!(decode_byte_level("ĠHello"), Some(b" Hello".to_vec()));
    }
}
