//! [`GgufWriter`]: builds small GGUF v3 files (test fixtures, tiny random-weight models).
//!
//! Metadata is written in insertion order, tensors in insertion order, each tensor's data padded to the
//! alignment (`general.alignment` if added, else 32). The writer enforces the reader's limits, so
//! everything it writes reads back. Errors (wrong data length, duplicate names…) surface from
//! [`to_bytes`](GgufWriter::to_bytes) / [`write`](GgufWriter::write).

use std::path::Path;

use crate::reader::MAGIC;
use crate::value::Value;
use crate::{
    GgmlType, GgufError, DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_DIMS, MAX_KEYS,
    MAX_STRING_LEN, MAX_TENSORS,
};

struct PendingTensor {
    name: String,
    dims: Vec<usize>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builder for a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata key/value (written in insertion order).
    pub fn add(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        self.metadata.push((key.into(), value.into()));
        self
    }

    /// Adds a tensor with dims in ggml order (`dims[0]` = row length) and its raw encoded bytes, which must
    /// be exactly `ty.row_bytes(dims[0]) * rows` long (checked when writing).
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[usize], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push(PendingTensor { name: name.into(), dims: dims.to_vec(), ty, data });
        self
    }

    /// Serializes the file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        check_count("tensor count", self.tensors.len(), MAX_TENSORS)?;
        check_count("key/value count", self.metadata.len(), MAX_KEYS)?;
        let alignment = self.alignment()?;
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());

        let mut keys = std::collections::HashSet::new();
        for (key, value) in &self.metadata {
            if !keys.insert(key.as_str()) {
                return Err(GgufError::DuplicateKey(key.clone()));
            }
            put_string(&mut out, key, key)?;
            out.extend_from_slice(&value.type_tag().to_le_bytes());
            put_value(&mut out, key, value, 0)?;
        }

        let mut names = std::collections::HashSet::new();
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            if !names.insert(tensor.name.as_str()) {
                return Err(GgufError::DuplicateTensor(tensor.name.clone()));
            }
            check_tensor(tensor)?;
            put_string(&mut out, &tensor.name, &tensor.name)?;
            out.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
            for &d in &tensor.dims {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&tensor.ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + tensor.data.len()).next_multiple_of(alignment);
        }

        if self.tensors.is_empty() {
            return Ok(out);
        }
        out.resize(out.len().next_multiple_of(alignment), 0);
        let data_start = out.len();
        for (tensor, offset) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + offset, 0);
            out.extend_from_slice(&tensor.data);
        }
        out.resize(out.len().next_multiple_of(alignment), 0);
        Ok(out)
    }

    /// Serializes the file and writes it to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| GgufError::Io { path: path.to_owned(), source })
    }

    fn alignment(&self) -> Result<usize, GgufError> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((key, value)) => {
                let a = value.as_u64().ok_or_else(|| GgufError::WrongType {
                    key: key.clone(),
                    expected: "u32",
                    found: value.type_name(),
                })?;
                if !a.is_power_of_two() || a > MAX_ALIGNMENT as u64 {
                    return Err(GgufError::BadAlignment(a));
                }
                Ok(a as usize)
            }
        }
    }
}

fn check_count(what: &str, value: usize, limit: u64) -> Result<(), GgufError> {
    if value as u64 > limit {
        return Err(GgufError::LimitExceeded { what: what.to_owned(), value: value as u64, limit });
    }
    Ok(())
}

fn check_tensor(tensor: &PendingTensor) -> Result<(), GgufError> {
    let bad = |reason: String| GgufError::BadTensor { tensor: tensor.name.clone(), reason };
    let dims = &tensor.dims;
    if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
        return Err(bad(format!("dims {dims:?} invalid (1 to {MAX_DIMS} dims, each at least 1)")));
    }
    let rows = dims[1..].iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    let expected = tensor.ty.row_bytes(dims[0]).zip(rows).and_then(|(row, rows)| row.checked_mul(rows));
    match expected {
        None => Err(bad(format!(
            "dims {dims:?} do not fit {} (row length must be a multiple of {}, size must not overflow)",
            tensor.ty.name(),
            tensor.ty.block_size()
        ))),
        Some(n) if n != tensor.data.len() => {
            Err(bad(format!("{} dims {dims:?} need {n} bytes of data, got {}", tensor.ty.name(), tensor.data.len())))
        }
        Some(_) => Ok(()),
    }
}

fn put_string(out: &mut Vec<u8>, key: &str, s: &str) -> Result<(), GgufError> {
    if s.len() as u64 > MAX_STRING_LEN {
        return Err(GgufError::LimitExceeded {
            what: format!("string length in '{key}'"),
            value: s.len() as u64,
            limit: MAX_STRING_LEN,
        });
    }
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Writes a value's payload (its type tag is written by the caller); `depth` = enclosing arrays.
fn put_value(out: &mut Vec<u8>, key: &str, value: &Value, depth: usize) -> Result<(), GgufError> {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, key, s)?,
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Array(items) => {
            if depth + 1 > MAX_ARRAY_DEPTH {
                return Err(GgufError::LimitExceeded {
                    what: format!("array nesting depth of key '{key}'"),
                    value: depth as u64 + 1,
                    limit: MAX_ARRAY_DEPTH as u64,
                });
            }
            check_count(&format!("array length of key '{key}'"), items.len(), MAX_ARRAY_LEN)?;
            // An empty array's element type is irrelevant; u8 is what ggml writes too.
            let elem_tag = items.first().map_or(0, Value::type_tag);
            out.extend_from_slice(&elem_tag.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for (i, item) in items.iter().enumerate() {
                if item.type_tag() != elem_tag {
                    return Err(GgufError::WrongType {
                        key: format!("{key}[{i}]"),
                        expected: crate::value::tag_name(elem_tag),
                        found: item.type_name(),
                    });
                }
                put_value(out, key, item, depth + 1)?;
            }
        }
    }
    Ok(())
}
