//! `specee inspect FILE [--json] [--set KEY=VALUE ...] [--stamp-model GGUF]`: what a safetensors file of specee's
//! holds — a draft head, exit predictors, a datastore, a training cache, or a published EAGLE checkpoint folder —
//! and how it was made.
//!
//! It prints the file's format, its tensors (count, bytes, a digest of their contents: equal for two files whose
//! tensors are identical), the manifest a trained artifact carries (the model it was made for, the exact
//! command, the SHA-256 of each data file, seed, date, held-out figures; see `cmd::manifest`), the key a
//! training cache was collected under (`train::cache`), and every other metadata entry.
//!
//! `--set KEY=VALUE` (repeatable; `\n` in VALUE is a line break, an empty VALUE removes the key) and
//! `--stamp-model GGUF` (the `base_model.*` identity of that model) amend the metadata in place, keeping the
//! tensors byte for byte (`train::artifact::rewrite_metadata`); it is how the heads trained before manifests
//! existed got theirs.

use anyhow::Context;
use std::path::{Path, PathBuf};
use train::artifact::Header;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A safetensors file (or a published EAGLE checkpoint folder holding model.safetensors).
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Set a metadata entry (KEY=VALUE; `\n` in VALUE is a line break; KEY= removes it). Tensors are kept.
    #[arg(long, value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Record the identity of this GGUF model (architecture, shape, fingerprint) as the file's base model.
    #[arg(long, value_name = "GGUF")]
    pub stamp_model: Option<PathBuf>,
}

/// Manifest entries in the order they are printed (the rest follow sorted by name).
const MANIFEST_KEYS: &[&str] = &[
    "format",
    "base_model",
    "base_model.arch",
    "base_model.n_layers",
    "base_model.n_embd",
    "base_model.vocab",
    "base_model.fingerprint",
    "command",
    "data.sha256",
    "seed",
    "date",
    "specee_version",
    "heldout_top1",
    "heldout_top3",
    "heldout_step2_top1",
    "validation_agreement",
    "validation_avg_layers",
];

pub fn run(a: Args) -> anyhow::Result<()> {
    let path = if a.file.is_dir() { a.file.join("model.safetensors") } else { a.file.clone() };
    let mut edits = Vec::new();
    for s in &a.set {
        let (key, value) = s.split_once('=').with_context(|| format!("--set {s:?}: expected KEY=VALUE"))?;
        anyhow::ensure!(!key.is_empty(), "--set {s:?}: the key is empty");
        edits.push((key.to_string(), (!value.is_empty()).then(|| value.replace("\\n", "\n"))));
    }
    if let Some(model_path) = &a.stamp_model {
        let engine = engine::Engine::load(model_path)?;
        let identity = engine::identity::ModelIdentity::of(model_path, &engine.model)
            .fingerprinted(model_path)
            .with_context(|| format!("reading {}", model_path.display()))?;
        edits.extend(identity.to_metadata().into_iter().map(|(k, v)| (k, Some(v))));
    }
    if !edits.is_empty() {
        train::artifact::rewrite_metadata(&path, &edits)?;
    }
    let header = Header::read(&path)?;
    let digest = header.tensor_digest(&path)?;
    if a.json {
        let metadata: serde_json::Map<String, serde_json::Value> =
            header.metadata.iter().map(|(k, v)| (k.clone(), v.clone().into())).collect();
        let out = serde_json::json!({
            "file": path.display().to_string(),
            "bytes": header.file_size,
            "tensors": header.tensors.len(),
            "tensor_bytes": header.tensor_bytes(),
            "tensor_sha256": digest,
            "metadata": metadata,
        });
        println!("{out}");
    } else {
        print!("{}", describe(&path, &header, &digest));
    }
    Ok(())
}

/// The text `inspect` prints.
fn describe(path: &Path, header: &Header, digest: &str) -> String {
    let mut dtypes = std::collections::BTreeMap::<&str, usize>::new();
    for t in header.tensors.values() {
        *dtypes.entry(t.dtype.as_str()).or_default() += 1;
    }
    let dtypes: Vec<String> = dtypes.iter().map(|(d, n)| format!("{n} {d}")).collect();
    let mut out = format!(
        "file: {} ({:.1} MB)\ntensors: {} ({}), {} bytes, sha256 {digest}\n",
        path.display(),
        header.file_size as f64 / 1e6,
        header.tensors.len(),
        dtypes.join(", "),
        header.tensor_bytes()
    );
    let meta = &header.metadata;
    let entry = |out: &mut String, key: &str, value: &str| match value.contains('\n') {
        true => {
            out.push_str(&format!("  {key}:\n"));
            value.lines().for_each(|l| out.push_str(&format!("    {l}\n")));
        }
        false => out.push_str(&format!("  {key}: {value}\n")),
    };
    let manifest: Vec<&str> = MANIFEST_KEYS.iter().copied().filter(|k| meta.contains_key(*k)).collect();
    if manifest.is_empty() {
        out.push_str("manifest: none (made before manifests, or not a trained artifact)\n");
    } else {
        out.push_str("manifest:\n");
        manifest.iter().for_each(|k| entry(&mut out, k, &meta[*k]));
    }
    let mut rest: Vec<(&String, &String)> = meta.iter().filter(|(k, _)| !MANIFEST_KEYS.contains(&k.as_str())).collect();
    rest.sort();
    let (cache, other): (Vec<_>, Vec<_>) = rest.into_iter().partition(|(k, _)| k.starts_with("cache."));
    if let Some(key) = train::cache::CacheKey::from_metadata(meta) {
        out.push_str("cache key (what this cache was collected from):\n");
        for line in key.describe() {
            out.push_str(&format!("  {line}\n"));
        }
    } else if !cache.is_empty() {
        cache.iter().for_each(|(k, v)| entry(&mut out, k, v));
    }
    if !other.is_empty() {
        out.push_str("other metadata:\n");
        other.iter().for_each(|(k, v)| entry(&mut out, k, v));
    }
    out
}
