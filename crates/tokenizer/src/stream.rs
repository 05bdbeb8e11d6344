//! [`StreamDecoder`]: detokenize while generating without ever emitting half a UTF-8 character.
//!
//! Byte-level and byte-fallback vocabularies split multi-byte characters (emoji, CJK) across tokens.
//! The decoder buffers the pieces and releases only complete characters; a byte sequence that can
//! never become valid UTF-8 is released as U+FFFD at once rather than held forever.

use crate::Tokenizer;

/// Incremental detokenizer; see the module documentation.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder with nothing buffered.
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds token `id`'s bytes; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Adds raw bytes; returns the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    out.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid_len = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..valid_len]).unwrap_or_default());
                    match e.error_len() {
                        // an invalid sequence: it will never complete
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += valid_len + bad;
                        }
                        // an incomplete character at the end: wait for more bytes
                        None => {
                            consumed += valid_len;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }

    /// Whether bytes of an incomplete character are buffered.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Returns whatever is buffered (lossy) and empties the buffer.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_emits_half_a_character() {
        let text = "a😀b日本語é🚀";
        let bytes = text.as_bytes();
        // every split of the byte stream into 1-, 2- and 3-byte "tokens"
        for step in 1..=3 {
            let mut decoder = StreamDecoder::new();
            let mut out = String::new();
            for chunk in bytes.chunks(step) {
                let emitted = decoder.push_bytes(chunk);
                assert!(!emitted.contains(char::REPLACEMENT_CHARACTER), "step {step}: {emitted:?}");
                out.push_str(&emitted);
                assert!(text.starts_with(&out));
            }
            assert!(!decoder.has_pending());
            assert_eq!(out, text);
        }
        let mut decoder = StreamDecoder::new();
        assert_eq!(decoder.push_bytes(&[0xF0, 0x9F]), "");
        assert_eq!(decoder.push_bytes(&[0x98]), "");
        assert_eq!(decoder.push_bytes(&[0x80, b'!']), "😀!");
    }

    #[test]
    fn invalid_bytes_do_not_block_the_stream() {
        let mut decoder = StreamDecoder::new();
        assert_eq!(decoder.push_bytes(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        // a lead byte followed by a non-continuation byte
        assert_eq!(decoder.push_bytes(&[0xE6, b'x']), "\u{FFFD}x");
        assert_eq!(decoder.push_bytes(&[0xE6, 0x97]), "");
        assert_eq!(decoder.flush(), "\u{FFFD}");
        assert!(!decoder.has_pending());
    }
}
