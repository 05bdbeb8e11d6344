//! The error type of the crate, [`GgufError`]. Every message is one line naming the offending key,
//! tensor, offset or value.

use std::path::PathBuf;

/// Everything that can go wrong reading, querying or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, mapped or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file (magic {}, expected \"GGUF\")", show_magic(found))]
    NotGguf {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The file has zero bytes.
    #[error("not a GGUF file: the file is empty")]
    Empty,
    /// A version other than 2 or 3 (version 1 predates 64-bit counts).
    #[error("unsupported GGUF version {0} (only versions 2 and 3 are supported)")]
    UnsupportedVersion(u32),
    /// The file ends in the middle of something.
    #[error("GGUF file truncated at byte offset {offset} while reading {what}")]
    Truncated {
        /// Byte offset at which the read started.
        offset: u64,
        /// What was being read.
        what: String,
    },
    /// A count or length exceeds a hard limit or what the remaining file could hold.
    #[error("GGUF {what} is {value}, above the limit of {limit}")]
    LimitExceeded {
        /// What was being counted.
        what: String,
        /// The value found.
        value: u64,
        /// The largest value allowed.
        limit: u64,
    },
    /// A string is not valid UTF-8.
    #[error("GGUF string at byte offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Byte offset of the string's bytes.
        offset: u64,
    },
    /// A metadata value (or array element) has an unknown type tag.
    #[error("GGUF key '{key}' has unknown value type {ty}")]
    UnknownValueType {
        /// The key.
        key: String,
        /// The type tag found.
        ty: u32,
    },
    /// A tensor has an unknown ggml type id.
    #[error("GGUF tensor '{tensor}' has unknown ggml type {ty}")]
    UnknownTensorType {
        /// The tensor name.
        tensor: String,
        /// The type id found.
        ty: u32,
    },
    /// A tensor's shape, size or placement is invalid.
    #[error("GGUF tensor '{tensor}': {reason}")]
    BadTensor {
        /// The tensor name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same metadata key appears twice.
    #[error("GGUF key '{0}' appears more than once")]
    DuplicateKey(String),
    /// The same tensor name appears twice.
    #[error("GGUF tensor '{0}' appears more than once")]
    DuplicateTensor(String),
    /// `general.alignment` is zero, not a power of two, or absurdly large.
    #[error("GGUF general.alignment is {0}; it must be a power of two between 1 and 2^30")]
    BadAlignment(u64),
    /// A required metadata key is absent.
    #[error("GGUF metadata key '{0}' is missing")]
    MissingKey(String),
    /// A metadata value has a type the caller cannot use.
    #[error("GGUF key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key (with `[index]` for an array element).
        key: String,
        /// What the caller wanted.
        expected: &'static str,
        /// What the file holds.
        found: &'static str,
    },
}

fn show_magic(found: &[u8; 4]) -> String {
    let text: String = found.iter().flat_map(|b| std::ascii::escape_default(*b)).map(char::from).collect();
    format!("\"{text}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_line_and_name_the_value() {
        let e = GgufError::NotGguf { found: *b"PK\x03\x04" };
        assert_eq!(e.to_string(), "not a GGUF file (magic \"PK\\x03\\x04\", expected \"GGUF\")");
        let e = GgufError::WrongType { key: "a.b".into(), expected: "u32", found: "string" };
        assert_eq!(e.to_string(), "GGUF key 'a.b' has type string, expected u32");
    }
}
