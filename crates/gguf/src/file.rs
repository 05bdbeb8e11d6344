//! [`GgufFile`]: an opened GGUF file (memory-mapped or owned bytes) with typed metadata accessors.

use std::collections::HashMap;
use std::path::Path;

use crate::reader::{parse, Header};
use crate::{GgmlType, GgufError, Value};

/// Shape, type and placement of one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The GGUF tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous row length. Never empty, every dim ≥ 1.
    pub dims: Vec<usize>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Number of elements (the product of the dims; checked at open).
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Number of rows: the product of every dim but the first.
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product()
    }
}

/// The bytes behind a [`GgufFile`].
enum Backing {
    Mmap(memmap2::Mmap),
    Owned(AlignedBytes),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(map) => map,
            Backing::Owned(bytes) => bytes.as_slice(),
        }
    }
}

/// One 64-byte, 64-aligned chunk of owned file bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

/// Owned bytes whose start is 64-byte aligned, so that tensor data (at aligned offsets) is aligned in
/// memory exactly as it is in a memory map.
struct AlignedBytes {
    chunks: Vec<Chunk>,
    len: usize,
}

impl AlignedBytes {
    fn new(bytes: &[u8]) -> AlignedBytes {
        let mut chunks = vec![Chunk([0; 64]); bytes.len().div_ceil(64)];
        for (chunk, src) in chunks.iter_mut().zip(bytes.chunks(64)) {
            chunk.0[..src.len()].copy_from_slice(src);
        }
        AlignedBytes { chunks, len: bytes.len() }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `Chunk` is `repr(C)` around `[u8; 64]` (size 64, no padding), so the chunks are
        // `64 * chunks.len() >= len` initialised, contiguous bytes, borrowed for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr().cast::<u8>(), self.len) }
    }
}

/// An opened GGUF file: metadata, tensor infos, and the tensor bytes (memory-mapped).
pub struct GgufFile {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    backing: Backing,
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
    data_offset: usize,
    alignment: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("file_bytes", &self.backing.bytes().len())
            .field("data_offset", &self.data_offset)
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps the file at `path` (read-only) and validates its header and tensor placement.
    ///
    /// The map assumes the file is not modified while open (as every mmap-based loader does).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Err(GgufError::Empty);
        }
        // SAFETY: the map is read-only; like every mmap loader we rely on the file not being truncated or
        // rewritten while it is open. All offsets into it are validated by `parse`.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(Backing::Mmap(map))
    }

    /// Parses a GGUF file held in memory (fixtures, tests). The bytes are copied into 64-byte aligned
    /// storage so that tensor data is aligned as in a memory-mapped file.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        if bytes.is_empty() {
            return Err(GgufError::Empty);
        }
        Self::from_backing(Backing::Owned(AlignedBytes::new(&bytes)))
    }

    fn from_backing(backing: Backing) -> Result<GgufFile, GgufError> {
        let Header { version, metadata, tensors, alignment, data_offset } = parse(backing.bytes())?;
        let key_index = metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile { version, metadata, tensors, backing, key_index, tensor_index, data_offset, alignment })
    }

    /// The alignment of the data section and of every tensor offset (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute byte offset of the data section in the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The whole file's bytes.
    pub fn file_bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).and_then(|&i| self.metadata.get(i)).map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_owned()))
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let value = self.require(key)?;
        convert(value).ok_or_else(|| wrong_type(key, expected, value))
    }

    fn optional<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => convert(value).map(Some).ok_or_else(|| wrong_type(key, expected, value)),
        }
    }

    /// An integer value that fits in a u32 (any integer type is accepted).
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.typed(key, "u32", Value::as_u32)
    }

    /// An integer value that fits in a u64.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "u64", Value::as_u64)
    }

    /// An integer value that fits in an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.typed(key, "i64", Value::as_i64)
    }

    /// A float (f32 or f64) or integer value, as f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.typed(key, "f32", Value::as_f32)
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        self.typed(key, "bool", Value::as_bool)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    /// An array value's elements.
    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        self.typed(key, "array", Value::as_array)
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.array_of(key, "string", Value::as_str)
    }

    /// An array of floats or integers, as f32.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.array_of(key, "f32", Value::as_f32)
    }

    /// An array of integers (any integer type in range) or bools (as 0/1), as i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.array_of(key, "i32", |v| match *v {
            Value::Bool(b) => Some(i32::from(b)),
            _ => v.as_i32(),
        })
    }

    fn array_of<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Vec<T>, GgufError> {
        let items = self.get_array(key)?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| convert(v).ok_or_else(|| wrong_type(&format!("{key}[{i}]"), expected, v)))
            .collect()
    }

    /// Like [`get_u32`](Self::get_u32), but `None` when the key is absent.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.optional(key, "u32", Value::as_u32)
    }

    /// Like [`get_u64`](Self::get_u64), but `None` when the key is absent.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.optional(key, "u64", Value::as_u64)
    }

    /// Like [`get_f32`](Self::get_f32), but `None` when the key is absent.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.optional(key, "f32", Value::as_f32)
    }

    /// Like [`get_bool`](Self::get_bool), but `None` when the key is absent.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.optional(key, "bool", Value::as_bool)
    }

    /// Like [`get_str`](Self::get_str), but `None` when the key is absent.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.optional(key, "string", Value::as_str)
    }

    /// `general.architecture`, e.g. `"llama"` or `"gemma3"`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// The info of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The data of a tensor of this file (validated at open). The slice's address is a multiple of
    /// `min(alignment(), 64)` (memory maps start on a page boundary; owned bytes on 64).
    ///
    /// An info from another file whose range does
    /// not fit in this one yields an empty slice rather than a panic.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let range = usize::try_from(info.offset)
            .ok()
            .and_then(|o| o.checked_add(self.data_offset))
            .and_then(|start| Some(start..start.checked_add(info.n_bytes)?));
        range.and_then(|r| self.backing.bytes().get(r)).unwrap_or(&[])
    }

    /// Tells the OS that the bytes of `info` will not be read again for a while (their pages leave this
    /// process's resident set; a later read faults them back in from the file, unchanged). For tensors the
    /// model converted into its own memory at load. A no-op for files read into memory.
    pub fn release_tensor(&self, info: &TensorInfo) {
        #[cfg(unix)]
        if let Backing::Mmap(map) = &self.backing {
            let start = usize::try_from(info.offset).ok().and_then(|o| o.checked_add(self.data_offset));
            if let Some(start) = start.filter(|s| s.saturating_add(info.n_bytes) <= map.len()) {
                // SAFETY: the map is a read-only file mapping: MADV_DONTNEED only drops pages, which the next
                // access reads again from the file with the same contents; no reference sees other bytes.
                // (The range is widened to whole pages; neighbouring bytes are re-read the same way.)
                let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, info.n_bytes) };
            }
        }
    }

    /// The data of tensor `name`, with its info.
    pub fn tensor_data(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        self.tensor(name).map(|info| (info, self.tensor_bytes(info)))
    }
}

fn wrong_type(key: &str, expected: &'static str, value: &Value) -> GgufError {
    GgufError::WrongType { key: key.to_owned(), expected, found: value.type_name() }
}
