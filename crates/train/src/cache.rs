//! Keys that make training caches trustworthy.
//!
//! Collecting data for a draft head or tracing a model for exit predictors takes minutes to hours, so the
//! training commands cache what they collected beside their output and reuse it on a rerun. A cache is only
//! reused when it was made from the same inputs: each one carries a [`CacheKey`] in its safetensors metadata
//! (`cache.<entry>` keys) listing what determines its content: the model file ([`engine::identity::fingerprint`]),
//! the record files' SHA-256, the draft head that gave candidates, and every option that changes what is
//! collected (`--max-new`, `--max-input`, `--limit`, …).
//!
//! [`check`] compares the key a command would write with the one stored in an existing cache and says, in one
//! line, why a cache is rebuilt (`records changed`, `--max-new 96 -> 192`, `another model (A -> B)`, or
//! `made before caches were keyed`), or, with `--reuse-cache`, that a mismatched cache is used anyway and how it
//! differs.

use crate::TrainError;
use std::collections::HashMap;
use std::path::Path;

/// The prefix of a cache key's entries in a file's metadata.
const PREFIX: &str = "cache.";

/// What determines a cache's content: named entries, compared one by one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheKey {
    entries: Vec<(String, Entry)>,
}

/// One input of a cache and how a change of it is described.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// The model file: `"<file name> <fingerprint>"`.
    Model(String),
    /// A file by content: its SHA-256 (the path is kept to name it, but not compared).
    File { sha256: String, path: String },
    /// A command-line option's value.
    Option(String),
}

impl CacheKey {
    /// An empty key.
    pub fn new() -> CacheKey {
        CacheKey::default()
    }

    /// Adds the model file at `path` (its name and [`engine::identity::fingerprint`]).
    pub fn model(mut self, path: &Path) -> Result<CacheKey, TrainError> {
        let print = engine::identity::fingerprint(path).map_err(|e| io_error(path, e))?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        self.entries.push(("model".into(), Entry::Model(format!("{name} {print}"))));
        Ok(self)
    }

    /// Adds a file by content under `name` (`records`, `draft head`).
    pub fn file(mut self, name: &str, path: &Path) -> Result<CacheKey, TrainError> {
        let sha256 = engine::identity::sha256_file(path).map_err(|e| io_error(path, e))?;
        self.entries.push((name.into(), Entry::File { sha256, path: path.display().to_string() }));
        Ok(self)
    }

    /// Adds an option (`flag` as the user writes it, e.g. `--max-new`).
    pub fn option(mut self, flag: &str, value: impl std::fmt::Display) -> CacheKey {
        self.entries.push((flag.into(), Entry::Option(value.to_string())));
        self
    }

    /// Adds every entry of `other` (the key of the data a derived cache is computed from).
    pub fn extend(mut self, other: &CacheKey) -> CacheKey {
        self.entries.extend(other.entries.iter().cloned());
        self
    }

    /// The metadata entries that store the key.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        let mut meta = HashMap::new();
        let names: Vec<&str> = self.entries.iter().map(|(n, _)| n.as_str()).collect();
        meta.insert(format!("{PREFIX}entries"), names.join("\n"));
        for (name, entry) in &self.entries {
            let value = match entry {
                Entry::Model(v) => format!("model {v}"),
                Entry::File { sha256, path } => format!("file {sha256} {path}"),
                Entry::Option(v) => format!("option {v}"),
            };
            meta.insert(format!("{PREFIX}{name}"), value);
        }
        meta
    }

    /// The key stored in `metadata`, if any.
    pub fn from_metadata(metadata: &HashMap<String, String>) -> Option<CacheKey> {
        let names = metadata.get(&format!("{PREFIX}entries"))?;
        let mut entries = Vec::new();
        for name in names.split('\n').filter(|n| !n.is_empty()) {
            let value = metadata.get(&format!("{PREFIX}{name}"))?;
            let (kind, rest) = value.split_once(' ').unwrap_or((value, ""));
            let entry = match kind {
                "model" => Entry::Model(rest.into()),
                "file" => {
                    let (sha256, path) = rest.split_once(' ').unwrap_or((rest, ""));
                    Entry::File { sha256: sha256.into(), path: path.into() }
                }
                "option" => Entry::Option(rest.into()),
                _ => return None,
            };
            entries.push((name.to_string(), entry));
        }
        Some(CacheKey { entries })
    }

    /// Reads the key stored in the safetensors file at `path` (`Ok(None)` for a cache written before keys).
    pub fn stored(path: &Path) -> Result<Option<CacheKey>, TrainError> {
        Ok(CacheKey::from_metadata(&crate::artifact::Header::read(path)?.metadata))
    }

    /// One line per entry, for a reader: `records: <sha256> (<path>)`, `--max-new: 96`.
    pub fn describe(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|(name, entry)| match entry {
                Entry::Model(v) | Entry::Option(v) => format!("{name}: {v}"),
                Entry::File { sha256, path } => format!("{name}: {sha256} ({path})"),
            })
            .collect()
    }

    /// How `stored` (an existing cache's key) differs from this key, one phrase per difference; empty when the
    /// cache was made from the same inputs.
    pub fn differences(&self, stored: &CacheKey) -> Vec<String> {
        let old: HashMap<&str, &Entry> = stored.entries.iter().map(|(n, e)| (n.as_str(), e)).collect();
        let mut out = Vec::new();
        for (name, entry) in &self.entries {
            match (old.get(name.as_str()), entry) {
                (None, _) => out.push(format!("{name} not recorded in the cache")),
                (Some(Entry::Model(a)), Entry::Model(b)) if a != b => {
                    let file = |v: &str| v.split(' ').next().unwrap_or_default().to_string();
                    out.push(match file(a) == file(b) {
                        true => format!("the model file {} changed", file(b)),
                        false => format!("another model ({} -> {})", file(a), file(b)),
                    });
                }
                (Some(Entry::File { sha256: a, .. }), Entry::File { sha256: b, path }) if a != b => {
                    out.push(format!("{name} changed ({path})"))
                }
                (Some(Entry::Option(a)), Entry::Option(b)) if a != b => out.push(format!("{name} {a} -> {b}")),
                (Some(a), b) if std::mem::discriminant(*a) != std::mem::discriminant(b) => {
                    out.push(format!("{name} recorded differently"))
                }
                _ => {}
            }
        }
        let names: Vec<&str> = self.entries.iter().map(|(n, _)| n.as_str()).collect();
        for (name, _) in &stored.entries {
            if !names.contains(&name.as_str()) {
                out.push(format!("{name} no longer applies"));
            }
        }
        out
    }
}

/// Whether the cache at `path` may be loaded for `key` (it exists and was made from the same inputs, or
/// `reuse_mismatch` accepts it as it is), printing one line when it exists: `using …`, `rebuilding …: why`, or
/// `--reuse-cache: using … although …`. `Ok(false)`: build it (and save it with `key`).
pub fn check(path: &Path, key: &CacheKey, reuse_mismatch: bool) -> Result<bool, TrainError> {
    if !path.exists() {
        return Ok(false);
    }
    let why = match CacheKey::stored(path)? {
        Some(stored) => key.differences(&stored),
        None => vec!["made before caches were keyed".to_string()],
    };
    let shown = path.display();
    if why.is_empty() {
        eprintln!("using cached {shown}");
        return Ok(true);
    }
    if reuse_mismatch {
        eprintln!("--reuse-cache: using {shown} although {}", why.join(", "));
        return Ok(true);
    }
    eprintln!("rebuilding {shown}: {}", why.join(", "));
    Ok(false)
}

fn io_error(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Io(path.display().to_string(), e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(records: &Path, max_new: usize) -> CacheKey {
        CacheKey::new().file("records", records).unwrap().option("--max-new", max_new)
    }

    #[test]
    fn keys_round_trip_and_name_what_differs() {
        let dir = std::env::temp_dir().join(format!("specee-cache-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
        std::fs::write(&a, "{\"text\": \"one\"}\n").unwrap();
        std::fs::write(&b, "{\"text\": \"two\"}\n").unwrap();
        let k = key(&a, 96);
        assert_eq!(CacheKey::from_metadata(&k.to_metadata()), Some(k.clone()));
        assert!(k.differences(&k).is_empty());
        let b_path = b.display().to_string();
        assert_eq!(key(&b, 192).differences(&k), [format!("records changed ({b_path})"), "--max-new 96 -> 192".into()]);
        // The same content under another name is the same records.
        std::fs::write(&b, "{\"text\": \"one\"}\n").unwrap();
        assert!(key(&b, 96).differences(&k).is_empty());
        let with_limit = key(&a, 96).option("--limit", 0);
        assert_eq!(with_limit.differences(&k), ["--limit not recorded in the cache"]);
        assert_eq!(k.differences(&with_limit), ["--limit no longer applies"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn models_are_told_apart_by_name_and_content() {
        let m = |v: &str| CacheKey { entries: vec![("model".into(), Entry::Model(v.into()))] };
        assert_eq!(m("b.gguf 9:ff").differences(&m("a.gguf 9:ee")), ["another model (a.gguf -> b.gguf)"]);
        assert_eq!(m("a.gguf 9:ff").differences(&m("a.gguf 9:ee")), ["the model file a.gguf changed"]);
    }
}
