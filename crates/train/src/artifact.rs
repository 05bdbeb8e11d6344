//! The safetensors files specee writes (draft heads, exit predictors, datastores, training caches), read and
//! amended without touching their tensors.
//!
//! - [`Header`]: a file's header (tensor index and `__metadata__`), read without reading the tensors.
//! - [`Header::tensor_digest`]: the SHA-256 of every tensor's name, dtype, shape and bytes, in name order: equal
//!   for two files whose tensors are identical, whatever their metadata (`specee inspect` prints it).
//! - [`rewrite_metadata`]: sets or removes metadata entries of a file in place, copying its tensor bytes as
//!   they are (`specee inspect --set`): how manifests were added to heads trained before they existed.

use crate::TrainError;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// The largest header accepted (safetensors' own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor of a file's index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Byte range within the data that follows the header.
    pub offsets: (u64, u64),
}

/// A safetensors file's header.
#[derive(Clone, Debug)]
pub struct Header {
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The `__metadata__` entries.
    pub metadata: HashMap<String, String>,
    /// Where the tensor data starts in the file (8 + the header's length).
    pub data_start: u64,
    /// The file's size.
    pub file_size: u64,
}

impl Header {
    /// Reads the header of the safetensors file at `path`; a clear error for anything else (a GGUF model, a
    /// truncated file, a header that is not safetensors JSON, tensors past the end of the file).
    pub fn read(path: &Path) -> Result<Header, TrainError> {
        let bad = |why: String| TrainError::Format(format!("{}: {why}", path.display()));
        let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
        let file_size = file.metadata().map_err(|e| io_error(path, e))?.len();
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(|_| bad("not a safetensors file (shorter than its header)".into()))?;
        if &len[..4] == b"GGUF" {
            return Err(bad("a GGUF model, not a safetensors file".into()));
        }
        let len = u64::from_le_bytes(len);
        if len > file_size.saturating_sub(8) || len > MAX_HEADER {
            return Err(bad(format!("not a safetensors file (a header of {len} bytes in {file_size})")));
        }
        let mut raw = vec![0u8; len as usize];
        file.read_exact(&mut raw).map_err(|e| io_error(path, e))?;
        let json: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&raw).map_err(|e| bad(format!("not a safetensors header: {e}")))?;
        let data_start = 8 + len;
        let mut header = Header { tensors: BTreeMap::new(), metadata: HashMap::new(), data_start, file_size };
        for (name, value) in json {
            if name == "__metadata__" {
                let entries = value.as_object().ok_or_else(|| bad("`__metadata__` is not an object".into()))?;
                for (k, v) in entries {
                    let v = v.as_str().ok_or_else(|| bad(format!("metadata `{k}` is not a string")))?;
                    header.metadata.insert(k.clone(), v.to_string());
                }
                continue;
            }
            let info: serde_json::Value = value;
            let dtype = info.get("dtype").and_then(|d| d.as_str());
            let shape: Option<Vec<u64>> =
                info.get("shape").and_then(|s| s.as_array()).and_then(|a| a.iter().map(|x| x.as_u64()).collect());
            let offsets: Option<Vec<u64>> = info
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
            let (Some(dtype), Some(shape), Some(&[start, end])) = (dtype, shape, offsets.as_deref()) else {
                return Err(bad(format!("tensor `{name}` lacks dtype, shape or data_offsets")));
            };
            if start > end || data_start.saturating_add(end) > file_size {
                return Err(bad(format!("tensor `{name}` lies past the end of the file")));
            }
            header.tensors.insert(name, TensorInfo { dtype: dtype.to_string(), shape, offsets: (start, end) });
        }
        Ok(header)
    }

    /// Bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.offsets.1 - t.offsets.0).sum()
    }

    /// The SHA-256 (hex) of every tensor's name, dtype, shape and bytes, in name order, read from `path` (the file
    /// this header came from).
    pub fn tensor_digest(&self, path: &Path) -> Result<String, TrainError> {
        let mut file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
        let mut hasher = Sha256::new();
        for (name, t) in &self.tensors {
            hasher.update(format!("{name} {} {:?}\n", t.dtype, t.shape).as_bytes());
            file.seek(SeekFrom::Start(self.data_start + t.offsets.0)).map_err(|e| io_error(path, e))?;
            let mut part = (&mut file).take(t.offsets.1 - t.offsets.0);
            std::io::copy(&mut part, &mut hasher).map_err(|e| io_error(path, e))?;
        }
        Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// Sets (`Some`) or removes (`None`) metadata entries of the safetensors file at `path`, keeping its tensors
/// byte for byte: the header is written anew and the data copied unchanged; the file is replaced atomically.
pub fn rewrite_metadata(path: &Path, edits: &[(String, Option<String>)]) -> Result<(), TrainError> {
    let header = Header::read(path)?;
    let mut metadata: BTreeMap<String, String> = header.metadata.clone().into_iter().collect();
    for (key, value) in edits {
        match value {
            Some(v) => metadata.insert(key.clone(), v.clone()),
            None => metadata.remove(key),
        };
    }
    let mut json = serde_json::Map::new();
    json.insert("__metadata__".into(), serde_json::to_value(&metadata).map_err(|e| TrainError::Format(e.to_string()))?);
    for (name, t) in &header.tensors {
        let entry =
            serde_json::json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [t.offsets.0, t.offsets.1] });
        json.insert(name.clone(), entry);
    }
    let mut raw = serde_json::to_vec(&json).map_err(|e| TrainError::Format(e.to_string()))?;
    // Tensor data stays aligned to 8 bytes, as safetensors pads its headers.
    raw.resize(raw.len().next_multiple_of(8), b' ');
    let tmp = path.with_extension("rewrite.tmp");
    let write = || -> std::io::Result<()> {
        let mut src = std::fs::File::open(path)?;
        src.seek(SeekFrom::Start(header.data_start))?;
        let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        out.write_all(&(raw.len() as u64).to_le_bytes())?;
        out.write_all(&raw)?;
        std::io::copy(&mut src, &mut out)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_error(path, e)
    })
}

fn io_error(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Io(path.display().to_string(), e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    #[test]
    fn metadata_is_rewritten_and_tensors_kept() {
        let dir = std::env::temp_dir().join(format!("specee-artifact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.safetensors");
        let a: Vec<u8> = (0..24u8).collect();
        let b: Vec<u8> = vec![7; 6];
        let views = vec![
            ("a", TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a).unwrap()),
            ("b", TensorView::new(safetensors::Dtype::U8, vec![6], &b).unwrap()),
        ];
        let meta = HashMap::from([("format".to_string(), "test-1".to_string()), ("old".into(), "x".into())]);
        safetensors::serialize_to_file(views, Some(meta), &path).unwrap();
        let before = Header::read(&path).unwrap();
        assert_eq!(before.tensor_bytes(), 30);
        let digest = before.tensor_digest(&path).unwrap();
        let edits = [("date".to_string(), Some("2026-12-03".to_string())), ("old".to_string(), None)];
        rewrite_metadata(&path, &edits).unwrap();
        let after = Header::read(&path).unwrap();
        assert_eq!(after.tensor_digest(&path).unwrap(), digest);
        assert_eq!(after.tensors, before.tensors);
        assert_eq!(after.metadata.get("date").map(String::as_str), Some("2026-12-03"));
        assert!(!after.metadata.contains_key("old"));
        // The rewritten file is still a safetensors file to the crate that reads heads.
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("a").unwrap().data(), &a[..]);
        // Other tensor bytes give another digest.
        let y = dir.join("y.safetensors");
        let mut changed = bytes.clone();
        *changed.last_mut().unwrap() ^= 1;
        std::fs::write(&y, changed).unwrap();
        assert_ne!(Header::read(&y).unwrap().tensor_digest(&y).unwrap(), digest);
        // Not safetensors: one clear error.
        std::fs::write(&y, b"GGUF\x03\0\0\0rest").unwrap();
        assert!(Header::read(&y).unwrap_err().to_string().contains("a GGUF model"));
        std::fs::write(&y, [255u8; 12]).unwrap();
        assert!(Header::read(&y).unwrap_err().to_string().contains("not a safetensors file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
