//! One module per subcommand, plus the flags they share.

pub mod bench;
pub mod build_datastore;
pub mod chat;
pub mod eval;
pub mod eval_reasoning;
pub mod fetch;
pub mod generate;
pub mod inspect;
pub mod perplexity;
pub mod serve;
pub mod sparsity;
pub mod tokenize;
pub mod train_draft;
pub mod train_exit;
pub mod train_reasoning_exit;

use std::path::{Path, PathBuf};
use train::cache::CacheKey;

/// Flags every model-running subcommand takes.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file, or a default model by name: smollm2 (the default), gemma3, qwen-coder (fetched into
    /// models/ if missing).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// Threads (default: all cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
}

impl ModelArgs {
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1)
    }

    /// Loads the engine for these flags.
    pub fn load(&self) -> anyhow::Result<engine::Engine> {
        Ok(self.load_with_path()?.0)
    }

    /// Loads the engine for these flags and says which file it came from.
    pub fn load_with_path(&self) -> anyhow::Result<(engine::Engine, PathBuf)> {
        let path = engine::resolve_model(self.model.clone(), true)?;
        Ok((engine::Engine::load(&path)?, path))
    }
}

/// How training commands run the model over their records (shared by `train-draft` and `train-exit`).
#[derive(clap::Args, Clone, Debug)]
pub struct CollectArgs {
    /// Tokens the model writes per chat record while collecting.
    #[arg(long, default_value_t = 96)]
    pub max_new: usize,
    /// Tokens kept of each prompt or text.
    #[arg(long, default_value_t = 384)]
    pub max_input: usize,
    /// Use only the first N records (of each record file; 0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Use existing caches even where they were collected from other records, another model or other options
    /// (each such cache is named with what differs). Without it a mismatched cache is rebuilt.
    #[arg(long)]
    pub reuse_cache: bool,
    /// Records the draft-head collection runs side by side (one forward for all per step); the data is the
    /// same for any value, only faster (on Qwen2.5-Coder 0.5B, 8 rows cost ~1.7x one).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub collect_batch: u16,
}

impl CollectArgs {
    pub fn options(&self, threads: usize) -> train::data::CollectOptions {
        train::data::CollectOptions {
            max_new: self.max_new,
            max_input: self.max_input,
            threads,
            batch: self.collect_batch.into(),
        }
    }

    /// The key of what the model at `model_path` collects from `records` with these options, the first `limit`
    /// records only (0: all) ([`train::cache`]).
    pub fn key(&self, model_path: &Path, records: &Path, limit: usize) -> anyhow::Result<CacheKey> {
        Ok(CacheKey::new()
            .model(model_path)?
            .file("records", records)?
            .option("--max-new", self.max_new)
            .option("--max-input", self.max_input)
            .option("--limit", limit))
    }
}

/// What every trained artifact records about how it was made (with the figures its command adds): the model it
/// was made for ([`engine::identity::ModelIdentity`], fingerprinted), the exact command (`specee …`), the SHA-256
/// of every data file it read (`data.sha256`, lines as `sha256sum` writes them), the date and specee's version.
/// `specee inspect FILE` prints it; loading an artifact made for another model fails naming both.
pub fn manifest(engine: &engine::Engine, model_path: &Path, data: &[&Path]) -> anyhow::Result<Vec<(String, String)>> {
    use anyhow::Context;
    let identity = engine::identity::ModelIdentity::of(model_path, &engine.model)
        .fingerprinted(model_path)
        .with_context(|| format!("reading {}", model_path.display()))?;
    let mut hashes = Vec::new();
    for path in data {
        let sha = engine::identity::sha256_file(path).with_context(|| format!("reading {}", path.display()))?;
        hashes.push(format!("{sha}  {}", shown(path)));
    }
    let mut manifest = identity.to_metadata();
    manifest.extend([
        ("command".to_string(), command_line()),
        ("data.sha256".to_string(), hashes.join("\n")),
        ("date".to_string(), engine::identity::utc_now()),
        ("specee_version".to_string(), env!("CARGO_PKG_VERSION").to_string()),
    ]);
    Ok(manifest)
}

/// `path` as a manifest records it: relative to the current folder when it lies inside it (the shipped files'
/// defaults resolve to absolute paths of the machine that trained them, which say nothing elsewhere), else as
/// given.
pub fn shown(path: &Path) -> String {
    if path.is_absolute() {
        let here = std::env::current_dir().and_then(|d| d.canonicalize());
        if let (Ok(here), Ok(full)) = (here, path.canonicalize()) {
            if let Ok(rel) = full.strip_prefix(&here) {
                return rel.display().to_string();
            }
        }
    }
    path.display().to_string()
}

/// Whether stderr is a terminal (progress bars draw there; elsewhere, in a log, long jobs print a line now and
/// then instead).
pub fn console_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// This process's command line as a user would type it: `specee` and its arguments.
pub fn command_line() -> String {
    std::iter::once("specee".to_string()).chain(std::env::args().skip(1)).collect::<Vec<_>>().join(" ")
}

/// `OUT` with its extension replaced by `.SUFFIX` (a cache or side file of a training command).
pub fn sibling(out: &std::path::Path, suffix: &str) -> PathBuf {
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    out.with_file_name(format!("{stem}.{suffix}"))
}

/// One file per record file beside `base` (`train-draft`'s data caches, `train-exit`'s traces and states):
/// `BASE.<kind>.<record file stem>.<ext>`, named by stem so that a rerun finds them. Two record files of one stem
/// would share (and corrupt) one file: refused.
pub fn per_record_file(
    base: &std::path::Path,
    records: &[PathBuf],
    kind: &str,
    ext: &str,
) -> anyhow::Result<Vec<PathBuf>> {
    let files: Vec<PathBuf> = records
        .iter()
        .map(|p| sibling(base, &format!("{kind}.{}.{ext}", p.file_stem().unwrap_or_default().to_string_lossy())))
        .collect();
    if let Some(i) = (1..files.len()).find(|&i| files[..i].contains(&files[i])) {
        anyhow::bail!(
            "two --data files are named {:?}: rename one (their caches are named by file name)",
            records[i].file_stem().unwrap_or_default()
        );
    }
    Ok(files)
}

/// How the reasoning is cut short (`generate`, `eval-reasoning`; see `engine::reasoning_exit`).
#[derive(clap::Args, Clone, Debug)]
pub struct ReasoningExitArgs {
    /// How the reasoning is cut short: `none` (full reasoning), `deer` (trial answers at paragraph boundaries) or
    /// `specexit` (signal heads). Runs with --mode dense or eagle. Not `--exit`, which names SpecEE's exit
    /// predictors in every command.
    #[arg(long, default_value = "none", value_parser = ["none", "deer", "specexit"])]
    pub reasoning_exit: String,
    /// DEER: exit when a trial answer's mean top probability exceeds this.
    #[arg(long, default_value_t = 0.95, value_parser = probability)]
    pub deer_threshold: f32,
    /// SpecExit: the signal-head file (default: heads/<model file stem>.reasoning.safetensors).
    #[arg(long)]
    pub signals: Option<PathBuf>,
    /// SpecExit: EWMA weight of each step's signals (default: the signal file's).
    #[arg(long, value_parser = probability)]
    pub alpha: Option<f32>,
    /// SpecExit: confidence must exceed this (default: the signal file's).
    #[arg(long, value_parser = probability)]
    pub confidence: Option<f32>,
    /// SpecExit: progress must exceed this (default: the signal file's).
    #[arg(long, value_parser = probability)]
    pub progress: Option<f32>,
    /// SpecExit: predicted remaining reasoning tokens must be below this (default: the signal file's).
    #[arg(long, value_parser = positive)]
    pub remaining: Option<f32>,
}

impl ReasoningExitArgs {
    /// The exit these flags ask for (signal heads loaded and checked against the model).
    pub fn exit(
        &self,
        eng: &engine::Engine,
        model_path: &Path,
    ) -> anyhow::Result<engine::reasoning_exit::ReasoningExit> {
        use engine::reasoning_exit::ReasoningExit;
        use engine::signals::{ExitPolicy, SignalHead};
        Ok(match self.reasoning_exit.as_str() {
            "deer" => ReasoningExit::Deer { threshold: self.deer_threshold },
            "specexit" => {
                let path =
                    self.signals.clone().unwrap_or_else(|| engine::speculative::shipped_path(model_path, "reasoning"));
                if !path.exists() {
                    anyhow::bail!(
                        "no signal heads at {} (train them with `specee train-reasoning-exit`, or pass --signals FILE)",
                        path.display()
                    );
                }
                let head = SignalHead::load_for(eng, &path, model_path)?;
                let stored = ExitPolicy::from_metadata(&head.metadata);
                let policy = ExitPolicy {
                    alpha: self.alpha.unwrap_or(stored.alpha),
                    confidence: self.confidence.unwrap_or(stored.confidence),
                    progress: self.progress.unwrap_or(stored.progress),
                    remaining: self.remaining.unwrap_or(stored.remaining),
                };
                ReasoningExit::SpecExit(std::sync::Arc::new(head), policy)
            }
            _ => ReasoningExit::None,
        })
    }
}

/// Sampling flags shared by `generate` and `chat` (llama.cpp's names and defaults; greedy unless `--temp` > 0).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0 or below = greedy).
    #[arg(long = "temp", default_value_t = 0.0, value_parser = finite)]
    pub temp: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    #[arg(long = "top-p", default_value_t = 0.95, value_parser = probability)]
    pub top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05, value_parser = probability)]
    pub min_p: f32,
    /// Divide the logits of recently seen tokens by this (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, value_parser = positive)]
    pub repeat_penalty: f32,
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler's settings.
    pub fn params(&self) -> decode::SamplingParams {
        decode::SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        }
    }
}

/// Decoding-mode flags shared by `generate`, `bench` and `eval`.
#[derive(clap::Args, Clone, Debug)]
pub struct ModeArgs {
    /// How tokens are produced: dense, eagle (tree speculative decoding with a trained draft head; lossless),
    /// ngram (tree speculative decoding with prompt lookup; lossless), specee (early exit with trained
    /// per-layer predictors; lossy, greedy) or specee-eagle (early exit inside eagle's tree verification;
    /// lossy, greedy). Default: dense, except in `generate`, which runs eagle for greedy decoding when a draft
    /// head is at hand (--draft, or the model's shipped one): the same output, faster.
    #[arg(long)]
    pub mode: Option<engine::speculative::Mode>,
    /// Draft head for --mode eagle and specee (default: heads/<model file stem>.draft.safetensors). --mode eagle
    /// also takes a published EAGLE-1/2/3 checkpoint folder (config.json + model.safetensors or pytorch_model.bin).
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Draft tree as DEPTH,TOP_K,BUDGET[,MIN_PROB] (default for eagle: the head's own tree, its metadata `tree`
    /// (Qwen2.5-Coder's head: 6,2,8,0.3), else 2,1,2,0.4, or 4,4,10 with a published head; for specee-eagle:
    /// 2,1,2,0.4; for ngram: 5,2,8). MIN_PROB drops the nodes whose path probability under the draft is lower
    /// (default 0: the budget alone decides).
    #[arg(long)]
    pub tree: Option<decode::speculative::TreeConfig>,
    /// --mode eagle and specee-eagle: also draft the prompt-lookup chain (what followed the latest 2–4 tokens
    /// earlier in the context) of N tokens, doubling up to 4N while each chain is accepted whole, merged into the
    /// head's tree (default 3; 0: off).
    #[arg(long)]
    pub lookup: Option<usize>,
    /// --mode eagle, ngram and specee-eagle: where the context offers no lookup match, draft from this n-gram
    /// datastore of the model's own answers (default: heads/<model file stem>.datastore.safetensors when present;
    /// `specee build-datastore` writes one).
    #[arg(long, conflicts_with = "no_datastore")]
    pub datastore: Option<PathBuf>,
    /// Draft from the context only, not from a datastore.
    #[arg(long)]
    pub no_datastore: bool,
    /// Exit predictors for --mode specee and specee-eagle (default: heads/<model file stem>.exit.safetensors).
    #[arg(long)]
    pub exit: Option<PathBuf>,
    /// --mode specee: what skipped layers get in their KV cache: missing (as published), propagate (K/V from
    /// the exit hidden state) or deferred (the next token that runs those layers carries the exited token
    /// through them in the same batch; the default: best agreement with dense at the same speed).
    #[arg(long, default_value = "deferred")]
    pub kv_policy: decode::specee::KvPolicy,
    /// --mode specee: how an exit is checked: candidates (emit the best draft candidate, no full head) or full
    /// (as published: the full head's top-1 at the exit layer must be a candidate).
    #[arg(long, default_value = "candidates")]
    pub verify: decode::specee::Verify,
    /// --mode specee: exit threshold (default: the predictor file's, for the chosen verification).
    #[arg(long)]
    pub exit_threshold: Option<f32>,
    /// --mode specee: evaluate only the offline layer set (no online scheduling).
    #[arg(long)]
    pub offline_only: bool,
}

/// A finite number (NaN or ±∞ would turn every probability into NaN).
pub(crate) fn finite(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("expected a finite number, got `{s}`")),
    }
}

/// A probability in [0, 1].
pub(crate) fn probability(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("expected a probability in [0, 1], got `{s}`")),
    }
}

/// A finite number above zero.
pub(crate) fn positive(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a finite number above 0, got `{s}`")),
    }
}

/// What produces tokens for one generation.
pub enum Runner {
    Dense,
    Speculative(engine::speculative::AnyProposer),
    Specee(engine::early_exit::SpecEeSetup),
    Merged(engine::early_exit::SpecEeSetup),
}

impl Runner {
    /// The draft tree's sizes (`eagle`, `ngram`, `specee-eagle`); none for the modes without a tree.
    pub fn tree(&self) -> Option<decode::speculative::TreeConfig> {
        match self {
            Runner::Speculative(p) => p.tree(),
            Runner::Merged(setup) => Some(setup.merged_tree()),
            Runner::Dense | Runner::Specee(_) => None,
        }
    }
}

/// The counters of the mode that ran.
#[derive(Clone, Copy, Debug, Default)]
pub enum RunStats {
    #[default]
    Dense,
    Speculative(decode::speculative::SpeculativeStats),
    Specee(decode::specee::SpecEeStats),
    Merged(decode::specee::MergedStats),
}

impl RunStats {
    /// The tree speculative counters (`eagle`, `ngram`, `specee-eagle`).
    pub fn speculative(&self) -> Option<decode::speculative::SpeculativeStats> {
        match self {
            RunStats::Speculative(s) => Some(*s),
            RunStats::Merged(s) => Some(s.speculative),
            _ => None,
        }
    }

    /// The early-exit counters (`specee`, `specee-eagle`).
    pub fn exits(&self) -> Option<engine::early_exit::ExitSummary> {
        match self {
            RunStats::Specee(s) => Some(s.into()),
            RunStats::Merged(s) => Some(s.into()),
            _ => None,
        }
    }
}

impl ModeArgs {
    /// The mode asked for (dense when none was).
    pub fn mode(&self) -> engine::speculative::Mode {
        self.mode.unwrap_or_default()
    }

    /// What `--mode` runs with (head, predictors, proposer loaded).
    pub fn runner(&self, eng: &engine::Engine, model_path: &std::path::Path) -> anyhow::Result<Runner> {
        use engine::speculative::{load_eagle, AnyProposer, Mode};
        Ok(match self.mode() {
            Mode::Dense => Runner::Dense,
            Mode::Eagle => {
                let mut p = load_eagle(eng, model_path, self.draft.as_deref(), self.tree)?;
                p.set_lookup(self.lookup_base(), self.datastore(eng, model_path)?);
                Runner::Speculative(p)
            }
            Mode::Ngram => {
                let mut p = decode::speculative::NgramProposer::default();
                if let Some(t) = self.tree {
                    p.config.tree = t;
                }
                Runner::Speculative(AnyProposer::Ngram(p.with_datastore(self.datastore(eng, model_path)?)))
            }
            Mode::Specee => Runner::Specee(self.specee_setup(eng, model_path)?),
            Mode::SpeceeEagle => Runner::Merged(self.specee_setup(eng, model_path)?),
        })
    }

    /// The proposer a reasoning exit decodes with ([`engine::reasoning_exit`]): `--mode dense` (nothing
    /// drafted, feature rows kept) or `eagle`; the other modes are refused.
    pub fn reasoning_proposer(
        &self,
        eng: &engine::Engine,
        model_path: &std::path::Path,
    ) -> anyhow::Result<engine::speculative::AnyProposer> {
        use engine::speculative::Mode;
        match self.runner(eng, model_path)? {
            Runner::Dense => Ok(engine::speculative::AnyProposer::Dense),
            Runner::Speculative(p) if self.mode() == Mode::Eagle => Ok(p),
            _ => anyhow::bail!(
                "reasoning exits run with --mode dense or eagle, not {} (they read the final-normed feature rows)",
                self.mode()
            ),
        }
    }

    /// The head, predictors and settings of `--mode specee`.
    pub fn specee_setup(
        &self,
        eng: &engine::Engine,
        model_path: &std::path::Path,
    ) -> anyhow::Result<engine::early_exit::SpecEeSetup> {
        Ok(engine::early_exit::SpecEeSetup {
            head: std::sync::Arc::new(engine::speculative::load_head(eng, model_path, self.draft.as_deref())?),
            predictors: engine::early_exit::load_predictors(eng, model_path, self.exit.as_deref())?,
            config: decode::specee::SpecEeConfig {
                policy: self.kv_policy,
                verify: self.verify,
                threshold: self.exit_threshold,
                offline_only: self.offline_only,
            },
            tree: self.tree,
            lookup: self.lookup_base(),
            datastore: match self.mode() {
                engine::speculative::Mode::SpeceeEagle => self.datastore(eng, model_path)?,
                _ => None,
            },
        })
    }

    /// The lookup chain's base length.
    fn lookup_base(&self) -> usize {
        self.lookup.unwrap_or(decode::speculative::EagleProposer::DEFAULT_LOOKUP)
    }

    /// The datastore to draft from (none with `--no-datastore` or `--lookup 0`).
    fn datastore(
        &self,
        eng: &engine::Engine,
        model_path: &std::path::Path,
    ) -> anyhow::Result<Option<std::sync::Arc<decode::speculative::Datastore>>> {
        if self.no_datastore || (self.lookup == Some(0) && self.mode() != engine::speculative::Mode::Ngram) {
            return Ok(None);
        }
        Ok(engine::speculative::load_datastore(eng, model_path, self.datastore.as_deref())?)
    }
}

/// Generates with whatever `runner` holds.
pub fn generate_with(
    eng: &engine::Engine,
    runner: Runner,
    ids: &[u32],
    params: &engine::GenerateParams,
    ctx: usize,
    threads: usize,
    on_text: impl FnMut(&str) -> bool,
) -> anyhow::Result<(engine::Generation, RunStats)> {
    Ok(match runner {
        Runner::Dense => (eng.generate(ids, params, ctx, threads, on_text)?, RunStats::Dense),
        Runner::Speculative(p) => {
            let (g, s) = eng.generate_speculative(ids, params, ctx, threads, p, on_text)?;
            (g, RunStats::Speculative(s))
        }
        Runner::Specee(setup) => {
            let (g, s) = eng.generate_specee(ids, params, ctx, threads, &setup, on_text)?;
            (g, RunStats::Specee(s))
        }
        Runner::Merged(setup) => {
            let (g, s) = eng.generate_merged(ids, params, ctx, threads, &setup, on_text)?;
            (g, RunStats::Merged(s))
        }
    })
}

#[cfg(test)]
mod tests {
    /// A manifest names a file inside the current folder relatively, whether given absolute or relative, and
    /// anything else as given.
    #[test]
    fn manifests_show_paths_inside_the_current_folder_relatively() {
        let here = std::env::current_dir().unwrap();
        assert_eq!(super::shown(&here.join("Cargo.toml")), "Cargo.toml");
        assert_eq!(super::shown(&here.join("src").join("..").join("Cargo.toml")), "Cargo.toml");
        assert_eq!(super::shown(std::path::Path::new("Cargo.toml")), "Cargo.toml");
        assert_eq!(super::shown(std::path::Path::new("/")), "/");
        assert_eq!(super::shown(std::path::Path::new("/no/such/file")), "/no/such/file");
    }
}
