//! What a file is, for training caches and the manifests of trained artifacts.
//!
//! - [`fingerprint`]: a model file's size and a SHA-256 over a sample of it (the first MiB, which holds a GGUF's
//!   metadata and tensor index, and 64 windows of 64 KiB spread over the rest): ~5 MB read for any file, so it
//!   costs nothing next to loading the model, and any two different models (or quantizations) differ in it.
//! - [`sha256_file`]: a whole file's SHA-256, for record files and draft heads (megabytes).
//! - [`ModelIdentity`]: what a draft head, an exit predictor file or a datastore records about the model it was
//!   made for (`base_model.*` metadata), and [`ModelIdentity::check`], which refuses another model's artifact
//!   with one line naming both models.
//! - [`utc_now`]: the date a manifest records (ISO 8601, UTC), without a date crate.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// Bytes of the head of a file that [`fingerprint`] always hashes.
const HEAD_BYTES: u64 = 1 << 20;
/// Windows [`fingerprint`] hashes over the rest of the file, and their size.
const WINDOWS: u64 = 64;
const WINDOW_BYTES: u64 = 64 << 10;

/// `"<size>:<16 hex digits>"`: a file's size and the SHA-256 of a fixed sample of it (see the module doc).
pub fn fingerprint(path: &Path) -> io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let mut hasher = Sha256::new();
    hasher.update(size.to_le_bytes());
    let mut buf = vec![0u8; HEAD_BYTES as usize];
    let head = HEAD_BYTES.min(size);
    file.read_exact(&mut buf[..head as usize])?;
    hasher.update(&buf[..head as usize]);
    if size > HEAD_BYTES {
        let span = size - HEAD_BYTES;
        for w in 0..WINDOWS {
            let offset = HEAD_BYTES + span * w / WINDOWS;
            let len = WINDOW_BYTES.min(size - offset) as usize;
            file.seek(SeekFrom::Start(offset))?;
            file.read_exact(&mut buf[..len])?;
            hasher.update(&buf[..len]);
        }
    }
    Ok(format!("{size}:{}", &hex(&hasher.finalize())[..16]))
}

/// The SHA-256 of a whole file, in hex.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher)?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The model an artifact was made for: its file name, the shape every artifact depends on, and its
/// [`fingerprint`]. Stored as `base_model` (the file name, as before manifests) and `base_model.*` metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    /// The GGUF file name.
    pub file: String,
    /// The architecture (`llama`, `qwen2`, `gemma3`, …).
    pub arch: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub vocab: usize,
    /// [`fingerprint`] of the file (empty where not recorded).
    pub fingerprint: String,
}

impl ModelIdentity {
    /// The identity of the model loaded from `path`, without its fingerprint (what [`Self::check`] needs).
    pub fn of(path: &Path, model: &model::Model) -> ModelIdentity {
        let c = &model.config;
        ModelIdentity {
            file: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            arch: c.arch.name().to_string(),
            n_layers: c.n_layers,
            n_embd: c.n_embd,
            vocab: c.vocab_size,
            fingerprint: String::new(),
        }
    }

    /// With the [`fingerprint`] of `path` (what a manifest records).
    pub fn fingerprinted(mut self, path: &Path) -> io::Result<ModelIdentity> {
        self.fingerprint = fingerprint(path)?;
        Ok(self)
    }

    /// The metadata entries that record it.
    pub fn to_metadata(&self) -> Vec<(String, String)> {
        vec![
            ("base_model".into(), self.file.clone()),
            ("base_model.arch".into(), self.arch.clone()),
            ("base_model.n_layers".into(), self.n_layers.to_string()),
            ("base_model.n_embd".into(), self.n_embd.to_string()),
            ("base_model.vocab".into(), self.vocab.to_string()),
            ("base_model.fingerprint".into(), self.fingerprint.clone()),
        ]
    }

    /// The identity recorded in `metadata`, if it holds one (files from before manifests hold only the name).
    pub fn from_metadata(metadata: &HashMap<String, String>) -> Option<ModelIdentity> {
        let number = |key: &str| metadata.get(key).and_then(|v| v.parse().ok());
        Some(ModelIdentity {
            file: metadata.get("base_model")?.clone(),
            arch: metadata.get("base_model.arch")?.clone(),
            n_layers: number("base_model.n_layers")?,
            n_embd: number("base_model.n_embd")?,
            vocab: number("base_model.vocab")?,
            fingerprint: metadata.get("base_model.fingerprint").cloned().unwrap_or_default(),
        })
    }

    /// Whether an artifact made for `self` works with `model`: same architecture, depth, width and vocabulary
    /// (another quantization of the same model does).
    pub fn fits(&self, model: &ModelIdentity) -> bool {
        (&self.arch, self.n_layers, self.n_embd, self.vocab) == (&model.arch, model.n_layers, model.n_embd, model.vocab)
    }

    /// `Err` naming both models unless the artifact described by `metadata` fits `model` ([`Self::fits`]);
    /// artifacts that record no identity pass (their shapes are checked on their own).
    pub fn check(metadata: &HashMap<String, String>, model: &ModelIdentity) -> Result<(), OtherModel> {
        match ModelIdentity::from_metadata(metadata) {
            Some(made_for) if !made_for.fits(model) => Err(OtherModel { made_for, model: model.clone() }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {} layers, d {}, vocabulary {})",
            self.file, self.arch, self.n_layers, self.n_embd, self.vocab
        )
    }
}

/// An artifact made for another model than the one loaded.
#[derive(Debug, thiserror::Error)]
#[error("it was made for {made_for}, not for {model}")]
pub struct OtherModel {
    pub made_for: ModelIdentity,
    pub model: ModelIdentity,
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    utc_date(secs)
}

/// Seconds since 1970 as `YYYY-MM-DDTHH:MM:SSZ` (the proleptic Gregorian calendar, as `date -u` prints it).
fn utc_date(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (H. Hinnant's algorithm, eras of 400 years).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_match_the_calendar() {
        assert_eq!(utc_date(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_date(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_date(1_796_287_599), "2026-12-03T08:46:39Z");
    }

    #[test]
    fn fingerprints_see_size_and_sampled_content() {
        let dir = std::env::temp_dir().join(format!("specee-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        let mut bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&a, &bytes).unwrap();
        let fa = fingerprint(&a).unwrap();
        assert!(fa.starts_with("3000000:"), "{fa}");
        // A byte in the first MiB (the GGUF header and index) and a byte in the first sampled window change it.
        bytes[10] ^= 1;
        std::fs::write(&b, &bytes).unwrap();
        assert_ne!(fingerprint(&b).unwrap(), fa);
        bytes[10] ^= 1;
        bytes[HEAD_BYTES as usize + 5] ^= 1;
        std::fs::write(&b, &bytes).unwrap();
        assert_ne!(fingerprint(&b).unwrap(), fa);
        bytes[HEAD_BYTES as usize + 5] ^= 1;
        std::fs::write(&b, &bytes).unwrap();
        assert_eq!(fingerprint(&b).unwrap(), fa);
        // Small files are hashed whole.
        std::fs::write(&b, b"abc").unwrap();
        assert!(fingerprint(&b).unwrap().starts_with("3:"));
        assert_eq!(sha256_file(&b).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn identities_round_trip_and_refuse_other_models() {
        let smol = ModelIdentity {
            file: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            arch: "llama".into(),
            n_layers: 30,
            n_embd: 576,
            vocab: 49152,
            fingerprint: "98362432:0123456789abcdef".into(),
        };
        let meta: HashMap<String, String> = smol.to_metadata().into_iter().collect();
        assert_eq!(ModelIdentity::from_metadata(&meta), Some(smol.clone()));
        // Another quantization of the same model fits; another model does not, and the error names both.
        let q8 = ModelIdentity {
            file: "SmolLM2-135M-Instruct.Q8_0.gguf".into(),
            fingerprint: String::new(),
            ..smol.clone()
        };
        assert!(ModelIdentity::check(&meta, &q8).is_ok());
        let gemma = ModelIdentity {
            file: "gemma-3-270m-q4_k_m.gguf".into(),
            arch: "gemma3".into(),
            n_layers: 18,
            n_embd: 640,
            vocab: 262_144,
            fingerprint: String::new(),
        };
        let err = ModelIdentity::check(&meta, &gemma).unwrap_err().to_string();
        assert_eq!(
            err,
            "it was made for SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers, d 576, vocabulary 49152), not for \
             gemma-3-270m-q4_k_m.gguf (gemma3, 18 layers, d 640, vocabulary 262144)"
        );
        // Files from before manifests (the name alone) pass: their shapes are checked on their own.
        let old = HashMap::from([("base_model".to_string(), smol.file.clone())]);
        assert!(ModelIdentity::check(&old, &gemma).is_ok());
    }
}
