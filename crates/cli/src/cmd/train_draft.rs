//! `specee train-draft -m PATH --data TRAIN.jsonl [--data MORE.jsonl ...] --heldout HELDOUT.jsonl --out
//! HEAD.safetensors`: trains an EAGLE-style draft head for a model (see `train` and
//! `decode::speculative::eagle`).
//!
//! First it collects the training data by running the model over the records (its own greedy answers to the
//! chat prompts, its reading of the texts), cached beside the output per record file as
//! `HEAD.train-data.<file stem>.safetensors` and `HEAD.heldout-data.safetensors` (reused on a rerun, so adding a
//! record file later collects only the new one; `--epochs 0` stops there; `--cache OTHER` reads and writes
//! `OTHER.…` instead, e.g. another head's data). Each cache is keyed by the model, the
//! records' content and the collection options ([`train::cache`]): one made from anything else is rebuilt, with
//! a line saying why, unless `--reuse-cache`. Then it trains on all of them joined,
//! printing loss and held-out acceptance per epoch and checkpointing to `HEAD.ckpt.safetensors`, from which a
//! rerun resumes. `--tree` writes the tree the head is to draft with into it (a head fine-tuned with `--init`
//! keeps its tree). `scripts/draft_data.py` writes the record files.
//!
//! `--design eagle3` trains an EAGLE-3-style head instead (`train::eagle3`: one attention layer over the whole
//! context on three fused target layers, traced over the data once and cached beside it) and writes it as a
//! published EAGLE-3 checkpoint folder at `--out`, which `--mode eagle --draft DIR` runs.

use super::{manifest, per_record_file, sibling, CollectArgs, ModelArgs};
use anyhow::Context;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use train::cache::{self, CacheKey};
use train::data::{collect, load_aux, read_records, save_aux, trace_layer_inputs, CollectOptions, DraftData};
use train::TrainOptions;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Training records (JSON lines: {"messages": [...]} or {"text": "..."}); repeat to join several files.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// Held-out records (acceptance is measured on them after every epoch; never trained on).
    #[arg(long)]
    pub heldout: PathBuf,
    /// Output head file (safetensors, F16).
    #[arg(long)]
    pub out: PathBuf,
    /// Where the collected data is cached: `CACHE.train-data.<file stem>.safetensors` per record file and
    /// `CACHE.heldout-data.safetensors` (default: --out, so that a rerun finds them). Name another head's --out
    /// to train a second head on the data collected for the first.
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Draft vocabulary size (the most frequent tokens of the training data).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// Feed-forward width of the head.
    #[arg(long, default_value_t = 1024)]
    pub ff: usize,
    /// Epochs to train (0: only collect the data into the caches, e.g. to add a record file now and train later).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning rate at the end of training, as a fraction of --lr (cosine decay over all epochs; 1: constant).
    #[arg(long, default_value_t = 0.1)]
    pub lr_end: f64,
    /// Draft steps unrolled per training sample (the later ones feed on the head's own predicted features).
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// Weight of the feature loss against the token loss.
    #[arg(long, default_value_t = 1.0)]
    pub reg_weight: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Layers whose inputs the head fuses with the final-normed feature, EAGLE-3 style (e.g. `2,15`; empty:
    /// EAGLE-1 style). Traced over the collected data once and cached beside it. With `--design eagle3`: the
    /// three fused layers (default `2,L/2,L`, L = the model's layer count, whose "input" is the last layer's
    /// output).
    #[arg(long, value_delimiter = ',')]
    pub fuse_layers: Vec<usize>,
    /// Head design: `mlp` (specee's own format, one feed-forward block; every mode uses it) or `eagle3` (one
    /// attention layer over the whole context on three fused target layers, written as a published EAGLE-3
    /// checkpoint folder at --out; `--mode eagle --draft DIR` runs it). With `eagle3`, --batch counts tokens
    /// (whole sequences are packed up to it).
    #[arg(long, default_value = "mlp", value_parser = ["mlp", "eagle3"])]
    pub design: String,
    /// What an `mlp` head's token loss compares its drafts with: `data` (the next token of the record: the model's
    /// own greedy answer on chat records, the text itself elsewhere) or `teacher` (the target's next-token
    /// distribution over the draft vocabulary, from its head applied to the next position's feature: EAGLE's
    /// classification loss).
    #[arg(long, default_value = "data", value_parser = ["data", "teacher"])]
    pub labels: String,
    /// Start from this head (an `mlp` head file) instead of a fresh one: fine-tuning on new data. Its draft
    /// vocabulary is kept (--vocab is ignored) and its --ff and --fuse-layers must be given as it was trained;
    /// its SHA-256 is recorded in the manifest with the data's.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// The draft tree the head is to draft with, as DEPTH,TOP_K,BUDGET[,MIN_PROB]: written into its metadata
    /// `tree`, which `--mode eagle` uses unless given `--tree` (an `mlp` head; default: the `--init` head's tree,
    /// else none, so the decoder's 2,1,2,0.4). Measure it first: `specee bench --mode eagle --tree T --prompts
    /// FILE` on prompts the head is not evaluated on.
    #[arg(long)]
    pub tree: Option<decode::speculative::TreeConfig>,
    /// Attention heads of an `eagle3` head (default: the model's).
    #[arg(long)]
    pub heads: Option<usize>,
    /// KV heads of an `eagle3` head (default: the model's).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[command(flatten)]
    pub collect: CollectArgs,
}

/// Where and how one record file's collected data is cached.
pub(crate) struct Cached<'a> {
    /// The cache file.
    pub path: &'a Path,
    /// What its content must have been collected from ([`CollectArgs::key`]).
    pub key: &'a CacheKey,
    /// `--reuse-cache`: accept a cache made from other inputs.
    pub reuse: bool,
}

/// Adds the aux rows of `layers` to `data` (collected into `cache`), tracing them unless a cache of them made
/// from the same data exists.
fn with_aux(
    engine: &engine::Engine,
    mut data: DraftData,
    cache: &Cached,
    layers: &[usize],
    threads: usize,
) -> anyhow::Result<DraftData> {
    if layers.is_empty() {
        return Ok(data);
    }
    let tag: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
    let aux_cache = cache.path.with_extension(format!("aux-{}.safetensors", tag.join("-")));
    let key = CacheKey::new().extend(cache.key).option("--fuse-layers", tag.join(","));
    let width = layers.len() * data.d;
    let aux = if cache::check(&aux_cache, &key, cache.reuse)? {
        let (aux, w) = load_aux(&aux_cache).with_context(|| format!("reading {}", aux_cache.display()))?;
        anyhow::ensure!(
            w == width && aux.len() == data.tokens.len() * w,
            "{} does not fit its data",
            aux_cache.display()
        );
        aux
    } else {
        let bar = train::progress_bar(true, data.n_sequences() as u64, &format!("tracing layers {}", tag.join(",")));
        let aux = trace_layer_inputs(&engine.model, &data, layers, threads, |s| bar.set_position(s as u64))?;
        bar.finish_and_clear();
        save_aux(&aux_cache, &aux, data.tokens.len(), layers, &key)?;
        aux
    };
    data.aux_width = width;
    data.aux = aux;
    Ok(data)
}

/// The data the model collects from the records at `records_path` (the first `limit` only; 0: all): loaded
/// from `cache` when it was collected from the same inputs, else collected and saved there.
pub(crate) fn collect_cached(
    engine: &engine::Engine,
    records_path: &Path,
    cache: &Cached,
    opts: CollectOptions,
    limit: usize,
) -> anyhow::Result<DraftData> {
    if cache::check(cache.path, cache.key, cache.reuse)? {
        return DraftData::load(cache.path).with_context(|| format!("reading {}", cache.path.display()));
    }
    let mut records = read_records(records_path)?;
    if limit > 0 {
        records.truncate(limit);
    }
    let bar = train::progress_bar(true, records.len() as u64, &format!("collecting {}", records_path.display()));
    let start = std::time::Instant::now();
    let data = collect(engine, &records, opts, |done, tokens| {
        bar.set_position(done as u64);
        bar.set_message(format!("{tokens} tokens"));
        if !super::console_is_terminal() && done % 25 == 0 {
            let secs = start.elapsed().as_secs_f64();
            eprintln!("collected {done}/{} records, {tokens} tokens, {secs:.0} s", records.len());
        }
    })?;
    bar.finish_and_clear();
    eprintln!(
        "collected {} sequences, {} tokens from {} in {:.0} s",
        data.n_sequences(),
        data.tokens.len(),
        records_path.display(),
        start.elapsed().as_secs_f64()
    );
    data.save(cache.path, cache.key)?;
    Ok(data)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.vocab == 0 || a.ff == 0 || a.batch == 0 || a.steps == 0 {
        anyhow::bail!("--vocab, --ff, --batch and --steps must be at least 1");
    }
    if !(a.lr > 0.0 && (0.0..=1.0).contains(&a.lr_end)) {
        anyhow::bail!("--lr must be positive and --lr-end between 0 and 1 (a fraction of --lr)");
    }
    let cache_base = a.cache.as_ref().unwrap_or(&a.out);
    let caches = per_record_file(cache_base, &a.data, "train-data", "safetensors")?;
    let eagle3 = a.design == "eagle3";
    if let Some(tree) = &a.tree {
        anyhow::ensure!(!eagle3, "--tree is written into an `mlp` head; an eagle3 head runs with eagle's --tree");
        decode::speculative::DraftHead::check_tree(tree).map_err(|why| anyhow::anyhow!("--tree {tree}: {why}"))?;
    }
    if let Some(init) = &a.init {
        anyhow::ensure!(!eagle3, "--init starts an `mlp` head from another; it does not apply to --design eagle3");
        anyhow::ensure!(init.is_file(), "--init {}: no such head file", init.display());
    }
    let (engine, model_path) = a.model.load_with_path()?;
    let opts = a.collect.options(a.model.threads());
    let n_layers = engine.model.config.n_layers;
    let fuse_layers =
        if eagle3 && a.fuse_layers.is_empty() { vec![2, n_layers / 2, n_layers] } else { a.fuse_layers.clone() };
    let mut train_data = DraftData::default();
    let reuse = a.collect.reuse_cache;
    for (path, cache) in a.data.iter().zip(&caches) {
        let key = a.collect.key(&model_path, path, a.collect.limit)?;
        let cache = Cached { path: cache, key: &key, reuse };
        let data = collect_cached(&engine, path, &cache, opts, a.collect.limit)?;
        train_data.append(&with_aux(&engine, data, &cache, &fuse_layers, opts.threads)?)?;
    }
    let heldout_cache = sibling(cache_base, "heldout-data.safetensors");
    let heldout_key = a.collect.key(&model_path, &a.heldout, 0)?;
    let heldout_cache = Cached { path: &heldout_cache, key: &heldout_key, reuse };
    let heldout = collect_cached(&engine, &a.heldout, &heldout_cache, opts, 0)?;
    let heldout = with_aux(&engine, heldout, &heldout_cache, &fuse_layers, opts.threads)?;
    if a.epochs == 0 {
        eprintln!("--epochs 0: data collected ({} training tokens), no head trained", train_data.tokens.len());
        return Ok(());
    }
    let data_files: Vec<&Path> = a.data.iter().chain([&a.heldout]).chain(&a.init).map(PathBuf::as_path).collect();
    let mut metadata: HashMap<String, String> = manifest(&engine, &model_path, &data_files)?.into_iter().collect();
    metadata.extend([
        ("train_data".to_string(), a.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")),
        ("heldout_data".to_string(), a.heldout.display().to_string()),
        ("train_tokens".to_string(), train_data.tokens.len().to_string()),
    ]);
    // The tree: `--tree`, else a fine-tuned head keeps the tree its `--init` head drafted with.
    let inherited = match (&a.tree, &a.init) {
        (None, Some(init)) => {
            decode::speculative::DraftHead::load(init).with_context(|| format!("--init {}", init.display()))?.tree
        }
        _ => None,
    };
    if let Some(tree) = a.tree.or(inherited) {
        metadata.insert("tree".to_string(), tree.to_string());
    }
    let c = &engine.model.config;
    let report = if eagle3 {
        let eopts = train::eagle3::Eagle3Options {
            vocab: a.vocab,
            ff: a.ff,
            n_head: a.heads.unwrap_or(c.n_head),
            n_head_kv: a.kv_heads.unwrap_or(c.n_head_kv),
            epochs: a.epochs,
            batch_tokens: a.batch,
            lr: a.lr,
            lr_end: a.lr_end,
            steps: a.steps,
            seed: a.seed,
            checkpoint: sibling(&a.out, "ckpt"),
            progress: true,
        };
        train::eagle3::train_eagle3(&engine.model, &train_data, &heldout, &fuse_layers, &a.out, &eopts, metadata)?
    } else {
        let topts = TrainOptions {
            vocab: a.vocab,
            ff: a.ff,
            epochs: a.epochs,
            batch: a.batch,
            lr: a.lr,
            lr_end: a.lr_end,
            steps: a.steps,
            reg_weight: a.reg_weight,
            seed: a.seed,
            eval_positions: 4000,
            checkpoint: sibling(&a.out, "ckpt.safetensors"),
            progress: true,
            fuse_layers: fuse_layers.clone(),
            labels: if a.labels == "teacher" { train::Labels::Teacher } else { train::Labels::Data },
            init: a.init.clone(),
        };
        train::train_draft(&engine.model, &train_data, &heldout, &a.out, &topts, metadata)?
    };
    let weights = if eagle3 { a.out.join("model.safetensors") } else { a.out.clone() };
    let size = std::fs::metadata(weights).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({:.1} MB) after {} epochs ({} in this run) on {} positions in {:.0} s: held-out top-1 {:.3}, \
         top-3 {:.3}, step-2 top-1 {:.3}",
        a.out.display(),
        size as f64 / 1e6,
        a.epochs,
        report.epochs_run,
        report.train_positions,
        report.seconds,
        report.heldout.top1,
        report.heldout.top3,
        report.heldout.top1_step2
    );
    Ok(())
}
