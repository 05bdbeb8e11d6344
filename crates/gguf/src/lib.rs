//! A bounded, memory-mapped reader for GGUF files, and a small writer for test fixtures.
//!
//! GGUF is ggml's single-file model format: a header of typed key/value metadata (architecture,
//! hyperparameters, the tokenizer vocabulary, the chat template…), a table of tensor infos (name, dims,
//! ggml element type, offset), then the aligned tensor data. This crate reads versions 2 and 3
//! (little-endian); version 1 is rejected.
//!
//! Main types:
//! - [`GgufFile`]: [`open`](GgufFile::open) maps the file read-only and validates everything up front;
//!   typed accessors ([`get_u32`](GgufFile::get_u32), [`get_str_array`](GgufFile::get_str_array),
//!   [`opt_f32`](GgufFile::opt_f32)…) fail with the key's name; [`tensor`](GgufFile::tensor) and
//!   [`tensor_bytes`](GgufFile::tensor_bytes) give each tensor's info and raw bytes.
//! - [`TensorInfo`], [`GgmlType`] (block geometry of each quant type), [`Value`] (one metadata value).
//! - [`GgufWriter`]: builds GGUF v3 files for tests and tiny random-weight models.
//! - [`GgufError`]: one-line messages naming the bad key, tensor, offset or value.
//!
//! Hardening: any byte input gives `Ok` or `Err`, never a panic, a hang or a huge allocation. Hard limits
//! ([`MAX_TENSORS`], [`MAX_KEYS`], [`MAX_STRING_LEN`], [`MAX_ARRAY_LEN`], [`MAX_ARRAY_DEPTH`],
//! [`MAX_DIMS`]) are enforced, every count is checked against the bytes left in the file before
//! allocating, sizes use checked arithmetic, and every tensor must be aligned and lie inside the file.
//!
//! ```
//! use gguf::{GgmlType, GgufFile, GgufWriter, Value};
//! let mut w = GgufWriter::new();
//! w.add("general.architecture", "llama").add("llama.block_count", Value::U32(2));
//! w.add_tensor("token_embd.weight", &[4, 3], GgmlType::F32, vec![0u8; 4 * 3 * 4]);
//! let file = GgufFile::from_bytes(w.to_bytes()?)?;
//! assert_eq!(file.architecture()?, "llama");
//! assert_eq!(file.get_u32("llama.block_count")?, 2);
//! let info = file.tensor("token_embd.weight").unwrap();
//! assert_eq!((info.dims.as_slice(), info.ty), (&[4, 3][..], GgmlType::F32));
//! assert_eq!(file.tensor_bytes(info).len(), 48);
//! # Ok::<(), gguf::GgufError>(())
//! ```
#![deny(missing_docs)]

mod error;
mod file;
mod ggml_type;
mod reader;
mod value;
mod writer;

pub use error::GgufError;
pub use file::{GgufFile, TensorInfo};
pub use ggml_type::GgmlType;
pub use value::Value;
pub use writer::GgufWriter;

/// Most tensors a file may declare.
pub const MAX_TENSORS: u64 = 65_536;
/// Most metadata key/value pairs a file may declare.
pub const MAX_KEYS: u64 = 65_536;
/// Longest string (key, value or tensor name), in bytes: 64 MiB.
pub const MAX_STRING_LEN: u64 = 64 << 20;
/// Most elements in one metadata array: 64 Mi.
pub const MAX_ARRAY_LEN: u64 = 64 << 20;
/// Deepest array nesting: an array of arrays (of scalars or strings) is the most allowed.
pub const MAX_ARRAY_DEPTH: usize = 2;
/// Most dimensions per tensor.
pub const MAX_DIMS: usize = 4;
/// Alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Largest `general.alignment` accepted (1 GiB).
pub const MAX_ALIGNMENT: usize = 1 << 30;
