//! The bounded parser: turns the bytes of a GGUF file into metadata, tensor infos and the data offset.
//!
//! Layout (little-endian): magic `GGUF`, version u32, tensor count u64, key/value count u64; then each
//! key/value (key string, type u32, value); then each tensor info (name string, n_dims u32, dims u64 ×
//! n_dims, ggml type u32, offset u64 relative to the data section); then padding up to the alignment; then
//! the data section. Strings are a u64 length followed by UTF-8 bytes.
//!
//! Every count and length is checked against the hard limits in the crate root *and* against the bytes
//! left in the file before anything is allocated, so a crafted file can neither exhaust memory nor panic.

use crate::value::{tag, tag_name, Value};
use crate::{
    GgmlType, GgufError, TensorInfo, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_DIMS,
    MAX_KEYS, MAX_STRING_LEN, MAX_TENSORS,
};

/// The parsed header of a GGUF file.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: usize,
    /// Absolute offset of the data section (may exceed the file length when there are no tensors).
    pub data_offset: usize,
}

pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// Smallest encoding of one key/value: key length (8) + type (4) + a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Smallest encoding of one tensor info: name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;

/// A forward-only reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn truncated(&self, what: &str) -> GgufError {
        GgufError::Truncated { offset: self.pos as u64, what: what.to_owned() }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what));
        }
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Checks that `count` items of at least `min_bytes` each can fit in what is left of the file.
    fn check_fits(&self, count: u64, min_bytes: usize, what: &str) -> Result<(), GgufError> {
        let needed = count.checked_mul(min_bytes as u64);
        if needed.is_none_or(|needed| needed > self.remaining() as u64) {
            return Err(self.truncated(&format!("{what} ({count} claimed, only {} bytes left)", self.remaining())));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING_LEN {
            return Err(GgufError::LimitExceeded {
                what: format!("string length of {what}"),
                value: len,
                limit: MAX_STRING_LEN,
            });
        }
        let offset = self.pos as u64;
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { offset }),
        }
    }

    /// Reads one value of type `ty`; `depth` is the number of arrays enclosing it.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("value of key '{key}'");
        Ok(match ty {
            tag::U8 => Value::U8(self.array::<1>(&what())?[0]),
            tag::I8 => Value::I8(i8::from_le_bytes(self.array(&what())?)),
            tag::U16 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            tag::I16 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            tag::U32 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            tag::I32 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            tag::F32 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            tag::BOOL => Value::Bool(self.array::<1>(&what())?[0] != 0),
            tag::STRING => Value::String(self.string(&what())?),
            tag::U64 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            tag::I64 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            tag::F64 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            tag::ARRAY => Value::Array(self.array_value(key, depth + 1)?),
            _ => return Err(GgufError::UnknownValueType { key: key.to_owned(), ty }),
        })
    }

    /// Reads an array's element type, length and elements; `depth` counts this array.
    fn array_value(&mut self, key: &str, depth: usize) -> Result<Vec<Value>, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::LimitExceeded {
                what: format!("array nesting depth of key '{key}'"),
                value: depth as u64,
                limit: MAX_ARRAY_DEPTH as u64,
            });
        }
        let what = format!("array of key '{key}'");
        let elem_ty = self.u32(&what)?;
        let len = self.u64(&what)?;
        let elem_size = match min_encoded_size(elem_ty) {
            Some(size) => size,
            None => return Err(GgufError::UnknownValueType { key: key.to_owned(), ty: elem_ty }),
        };
        if len > MAX_ARRAY_LEN {
            return Err(GgufError::LimitExceeded {
                what: format!("array length of key '{key}'"),
                value: len,
                limit: MAX_ARRAY_LEN,
            });
        }
        self.check_fits(len, elem_size, &format!("{} elements of {what}", tag_name(elem_ty)))?;
        let len = len as usize;
        if elem_ty == tag::STRING {
            let mut items = Vec::with_capacity(len);
            for _ in 0..len {
                items.push(Value::String(self.string(&what)?));
            }
            return Ok(items);
        }
        if elem_ty == tag::ARRAY {
            let mut items = Vec::with_capacity(len);
            for _ in 0..len {
                items.push(Value::Array(self.array_value(key, depth + 1)?));
            }
            return Ok(items);
        }
        // Fixed-size elements: one bounds check, then decode the chunk.
        let bytes = self.take(len * elem_size, &what)?;
        let items = bytes.chunks_exact(elem_size).map(|chunk| decode_fixed(elem_ty, chunk)).collect();
        Ok(items)
    }
}

/// Bytes taken at least by one encoded value of type `ty`, or `None` for an unknown type.
fn min_encoded_size(ty: u32) -> Option<usize> {
    Some(match ty {
        tag::U8 | tag::I8 | tag::BOOL => 1,
        tag::U16 | tag::I16 => 2,
        tag::U32 | tag::I32 | tag::F32 => 4,
        tag::U64 | tag::I64 | tag::F64 | tag::STRING => 8,
        tag::ARRAY => 12,
        _ => return None,
    })
}

/// Decodes a fixed-size value from a chunk of exactly `min_encoded_size(ty)` bytes.
fn decode_fixed(ty: u32, chunk: &[u8]) -> Value {
    let mut buf = [0u8; 8];
    let n = chunk.len().min(8);
    buf[..n].copy_from_slice(&chunk[..n]);
    let b2 = [buf[0], buf[1]];
    let b4 = [buf[0], buf[1], buf[2], buf[3]];
    match ty {
        tag::U8 => Value::U8(buf[0]),
        tag::I8 => Value::I8(buf[0] as i8),
        tag::BOOL => Value::Bool(buf[0] != 0),
        tag::U16 => Value::U16(u16::from_le_bytes(b2)),
        tag::I16 => Value::I16(i16::from_le_bytes(b2)),
        tag::U32 => Value::U32(u32::from_le_bytes(b4)),
        tag::I32 => Value::I32(i32::from_le_bytes(b4)),
        tag::F32 => Value::F32(f32::from_le_bytes(b4)),
        tag::U64 => Value::U64(u64::from_le_bytes(buf)),
        tag::I64 => Value::I64(i64::from_le_bytes(buf)),
        _ => Value::F64(f64::from_le_bytes(buf)),
    }
}

fn limit(what: &str, value: u64, limit: u64) -> Result<(), GgufError> {
    if value > limit {
        return Err(GgufError::LimitExceeded { what: what.to_owned(), value, limit });
    }
    Ok(())
}

/// Parses the header of a GGUF file held in `bytes` and validates every tensor against the file size.
pub(crate) fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
    if bytes.is_empty() {
        return Err(GgufError::Empty);
    }
    let mut cur = Cursor { bytes, pos: 0 };
    if bytes.len() < 4 {
        let mut found = [0u8; 4];
        found[..bytes.len()].copy_from_slice(bytes);
        if !MAGIC.starts_with(bytes) {
            return Err(GgufError::NotGguf { found });
        }
    }
    let magic: [u8; 4] = cur.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::NotGguf { found: magic });
    }
    let version = cur.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = cur.u64("tensor count")?;
    let n_kv = cur.u64("key/value count")?;
    limit("tensor count", n_tensors, MAX_TENSORS)?;
    limit("key/value count", n_kv, MAX_KEYS)?;
    cur.check_fits(n_kv, MIN_KV_BYTES, "key/value pairs")?;

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen_keys = std::collections::HashSet::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = cur.string(&format!("key #{i}"))?;
        let ty = cur.u32(&format!("type of key '{key}'"))?;
        let value = cur.value(ty, &key, 0)?;
        if !seen_keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((key, value)) => {
            let Some(a) = value.as_u64() else {
                return Err(GgufError::WrongType { key: key.clone(), expected: "u32", found: value.type_name() });
            };
            if !a.is_power_of_two() || a > MAX_ALIGNMENT as u64 {
                return Err(GgufError::BadAlignment(a));
            }
            a as usize
        }
    };

    cur.check_fits(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor infos")?;
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut seen_tensors = std::collections::HashSet::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = cur.string(&format!("name of tensor #{i}"))?;
        let info = read_tensor_info(&mut cur, name)?;
        if !seen_tensors.insert(info.name.clone()) {
            return Err(GgufError::DuplicateTensor(info.name));
        }
        tensors.push(info);
    }

    let data_offset = cur.pos.checked_next_multiple_of(alignment).ok_or(GgufError::BadAlignment(alignment as u64))?;
    for info in &tensors {
        check_placement(info, data_offset, alignment, bytes.len())?;
    }
    Ok(Header { version, metadata, tensors, alignment, data_offset })
}

/// Reads the rest of a tensor info (after its name) and computes its element count and byte size.
fn read_tensor_info(cur: &mut Cursor<'_>, name: String) -> Result<TensorInfo, GgufError> {
    let bad = |reason: String| GgufError::BadTensor { tensor: name.clone(), reason };
    let what = format!("info of tensor '{name}'");
    let n_dims = cur.u32(&what)?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(bad(format!("has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        let d = cur.u64(&what)?;
        if d == 0 {
            return Err(bad(format!("has a zero dimension (dims so far {dims:?})")));
        }
        let d = usize::try_from(d).map_err(|_| bad(format!("dimension {d} does not fit in memory")))?;
        dims.push(d);
    }
    let ty_id = cur.u32(&what)?;
    let ty =
        GgmlType::from_u32(ty_id).ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), ty: ty_id })?;
    let offset = cur.u64(&what)?;
    let n_elements = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let n_elements = n_elements.ok_or_else(|| bad(format!("element count of dims {dims:?} overflows")))?;
    if !dims[0].is_multiple_of(ty.block_size()) {
        let (row, name, block) = (dims[0], ty.name(), ty.block_size());
        return Err(bad(format!("row length {row} is not a multiple of the {name} block size {block}")));
    }
    let row = ty
        .row_bytes(dims[0])
        .ok_or_else(|| bad(format!("byte size of a {} row of {} overflows", ty.name(), dims[0])))?;
    let n_bytes = row
        .checked_mul(n_elements / dims[0])
        .ok_or_else(|| bad(format!("byte size of {} dims {dims:?} overflows", ty.name())))?;
    Ok(TensorInfo { name, dims, ty, offset, n_bytes })
}

/// Checks that a tensor's data is aligned and lies inside the file.
fn check_placement(info: &TensorInfo, data_offset: usize, alignment: usize, file_len: usize) -> Result<(), GgufError> {
    let bad = |reason: String| GgufError::BadTensor { tensor: info.name.clone(), reason };
    if !info.offset.is_multiple_of(alignment as u64) {
        return Err(bad(format!("data offset {} is not a multiple of the alignment {alignment}", info.offset)));
    }
    let start = usize::try_from(info.offset).ok().and_then(|o| o.checked_add(data_offset));
    let end = start.and_then(|s| s.checked_add(info.n_bytes));
    match end {
        Some(end) if end <= file_len => Ok(()),
        _ => Err(bad(format!(
            "data at offset {} + {} bytes ({} dims {:?}) lies outside the file ({} bytes, data section at {})",
            info.offset,
            info.n_bytes,
            info.ty.name(),
            info.dims,
            file_len,
            data_offset
        ))),
    }
}
