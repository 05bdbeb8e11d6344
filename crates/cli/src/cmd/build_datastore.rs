//! `specee build-datastore -m PATH --data RECORDS.jsonl [--data MORE.jsonl ...] --out FILE.safetensors`: builds
//! the n-gram datastore that `--mode eagle`, `ngram` and `specee-eagle` draft from where the context offers no
//! prompt-lookup match (`decode::speculative::datastore`).
//!
//! It runs the model over the chat records as `train-draft` does (its own greedy answers), caching them beside the
//! output as `X.train-data.<file stem>.safetensors` for `--out X.datastore.safetensors` (or `X.safetensors`): the
//! caches `train-draft --out X.safetensors` writes, keyed the same way, so one collection serves both. Then it counts, for every
//! generated token, the 2–6 tokens before it. Raw-text records are collected but predict nothing: the store
//! drafts the model's own phrasing.

use super::train_draft::{collect_cached, Cached};
use super::{manifest, sibling, CollectArgs, ModelArgs};
use decode::speculative::{Datastore, DatastoreOptions};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Records (JSON lines: {"messages": [...]} or {"text": "..."}); repeat to join several files.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// Output file (safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// Shortest suffix stored and looked up.
    #[arg(long, default_value_t = 2)]
    pub min_n: usize,
    /// Longest suffix stored and looked up.
    #[arg(long, default_value_t = 6)]
    pub max_n: usize,
    /// Leave out n-grams seen fewer times than this (a smaller file; 1 keeps every one).
    #[arg(long, default_value_t = 1)]
    pub min_count: u32,
    /// Leave out n-grams whose most frequent follower has a lower share of their occurrences.
    #[arg(long, default_value_t = 0.0, value_parser = super::probability)]
    pub min_prob: f32,
    #[command(flatten)]
    pub collect: CollectArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.min_n == 0 || a.max_n < a.min_n || a.max_n > 16 || a.min_count == 0 {
        anyhow::bail!("need 1 <= --min-n <= --max-n <= 16 and --min-count >= 1");
    }
    let (engine, model_path) = a.model.load_with_path()?;
    let opts = a.collect.options(a.model.threads());
    let start = std::time::Instant::now();
    let mut data = Vec::new();
    // `X.datastore.safetensors` shares the caches of `train-draft --out X.safetensors`.
    let out_stem = a.out.file_stem().unwrap_or_default().to_string_lossy().into_owned();
    let cache_base = a.out.with_file_name(format!("{}.safetensors", out_stem.trim_end_matches(".datastore")));
    for path in &a.data {
        let stem = path.file_stem().unwrap_or_default().to_string_lossy().into_owned();
        let cache = sibling(&cache_base, &format!("train-data.{stem}.safetensors"));
        let key = a.collect.key(&model_path, path, a.collect.limit)?;
        let cache = Cached { path: &cache, key: &key, reuse: a.collect.reuse_cache };
        data.push(collect_cached(&engine, path, &cache, opts, a.collect.limit)?);
    }
    let sequences = data.iter().flat_map(|d| {
        (0..d.n_sequences()).map(move |s| {
            let range = d.sequence(s);
            (&d.tokens[range.clone()], d.generated_from(s) - range.start)
        })
    });
    let generated: usize =
        data.iter().flat_map(|d| (0..d.n_sequences()).map(|s| d.sequence(s).end - d.generated_from(s))).sum();
    let n_vocab = engine.model.config.vocab_size;
    let options = DatastoreOptions { min_n: a.min_n, max_n: a.max_n, min_count: a.min_count, min_prob: a.min_prob };
    let mut store = Datastore::build(sequences, options, n_vocab);
    let model = model_path.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let data_files: Vec<&std::path::Path> = a.data.iter().map(PathBuf::as_path).collect();
    store.metadata = manifest(&engine, &model_path, &data_files)?;
    store.metadata.extend([
        ("model".into(), model),
        ("data".into(), a.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")),
        ("generated_tokens".into(), generated.to_string()),
        ("min_count".into(), a.min_count.to_string()),
        ("min_prob".into(), a.min_prob.to_string()),
    ]);
    store.save(&a.out)?;
    eprintln!(
        "{} n-grams ({}..={} tokens) from {generated} generated tokens -> {} ({:.1} MB) in {:.0} s",
        store.len(),
        a.min_n,
        a.max_n,
        a.out.display(),
        std::fs::metadata(&a.out).map(|m| m.len() as f64 / 1e6).unwrap_or(0.0),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
