//! `specee train-reasoning-exit -m PATH --problems FILE.jsonl [--out SIGNALS.safetensors]`: traces the model's
//! full reasoning on problems with known answers, says what an exit could save on them, and trains SpecExit's
//! signal heads (see `train::reasoning` and `engine::signals`).
//!
//! 1. Traces (`--traces DIR`, default `data/reasoning/traces/<problems file stem>/`, cached in chunks and resumed
//!    on a rerun): the full greedy answer, a trial answer forced at every paragraph boundary, the feature rows.
//! 2. A table of ceilings on the traces: full reasoning, the oracle exit (the first boundary whose trial answer is
//!    the final one) and DEER at seven thresholds, replayed exactly (a greedy exit answers what the trial at
//!    that boundary answered). `--traces-only` stops here (use it on held-out problems).
//! 3. The signal heads, trained on four traces in five (the fifth validates: per-epoch AUC, MAE), the exit
//!    policy chosen on the validation traces for the accuracy `--budget`, a PNG of the signals along eight
//!    validation traces (`SIGNALS.signals.png`), and the file (default
//!    `heads/<model file stem>.reasoning.safetensors`) with its manifest and the chosen thresholds.

use super::{console_is_terminal, manifest, sibling, ModeArgs, ModelArgs};
use engine::reasoning::{read_problems, ReasoningProfile};
use std::path::PathBuf;
use train::reasoning::{
    ceilings_table, collect_traces, plot_signals, save_signal_head, train_signals, SignalOptions, TraceOptions,
};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Problems (JSON lines: {"question": "...", "answer": NUMBER}).
    #[arg(long)]
    pub problems: PathBuf,
    /// Reasoning profile: a built-in name (`boxed`, `think`) or a profile file (default: the model's).
    #[arg(long)]
    pub profile: Option<String>,
    /// Where the traces are cached (default: data/reasoning/traces/<problems file stem>).
    #[arg(long)]
    pub traces: Option<PathBuf>,
    /// Most tokens per trace.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n: usize,
    /// Problems per cached chunk of traces.
    #[arg(long, default_value_t = 25)]
    pub chunk: usize,
    /// Only the first N problems (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Trace and print the ceilings, train nothing.
    #[arg(long)]
    pub traces_only: bool,
    /// Output signal-head file (default: heads/<model file stem>.reasoning.safetensors).
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Epochs (held-out AUC peaks early: 4 on Qwen2.5-Coder's traces).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Accuracy (percentage points) the chosen policy may lose against full reasoning on the validation traces.
    #[arg(long, default_value_t = 1.0)]
    pub budget: f64,
}

/// DEER thresholds the ceilings table replays.
const DEER_THRESHOLDS: [f32; 7] = [0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999];

pub fn run(mut a: Args) -> anyhow::Result<()> {
    let (eng, model_path) = a.model.load_with_path()?;
    let profile = ReasoningProfile::resolve(a.profile.as_deref(), &eng)?;
    let mut problems = read_problems(&a.problems)?;
    if a.limit > 0 {
        problems.truncate(a.limit);
    }
    if a.mode.mode.is_none() {
        let params = engine::GenerateParams::default();
        a.mode.mode = Some(engine::speculative::auto_mode(&model_path, a.mode.draft.as_deref(), &params.sampling));
    }
    let dir = a.traces.clone().unwrap_or_else(|| {
        let stem = a.problems.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        PathBuf::from("data/reasoning/traces").join(stem)
    });
    let threads = a.model.threads();
    eng.model.warm_head_screen(threads);
    let opts = TraceOptions { max_tokens: a.n, threads, chunk: a.chunk, progress: console_is_terminal() };
    let started = std::time::Instant::now();
    let set = collect_traces(&eng, &model_path, &a.problems, &problems, &profile, &dir, &opts, || {
        a.mode.reasoning_proposer(&eng, &model_path).map_err(|e| train::TrainError::Invalid(e.to_string()))
    })?;
    let trials: usize = set.records.iter().map(|r| r.trials.len()).sum();
    eprintln!(
        "{} traces in {} ({:.0} s this run): {} trial answers, {} feature rows",
        set.records.len(),
        dir.display(),
        started.elapsed().as_secs_f64(),
        trials,
        set.features.len() / set.d.max(1)
    );
    println!("Ceilings on {} ({} problems, replayed on the traces):\n", a.problems.display(), set.records.len());
    println!("{}", ceilings_table(&set.records, &DEER_THRESHOLDS));
    if a.traces_only {
        return Ok(());
    }
    let out = a.out.clone().unwrap_or_else(|| engine::speculative::shipped_path(&model_path, "reasoning"));
    let sopts = SignalOptions {
        hidden: a.hidden,
        epochs: a.epochs,
        batch: a.batch,
        lr: a.lr,
        seed: a.seed,
        budget: a.budget / 100.0,
        progress: console_is_terminal(),
    };
    let t0 = std::time::Instant::now();
    let report = train_signals(&set, &sopts, |line| eprintln!("{line}"))?;
    let p = report.policy;
    println!(
        "Validation ({} traces): full reasoning {:.1}% right, {:.1} reasoning tokens; chosen policy (alpha {}, \
         confidence > {}, progress > {}, remaining < {}): {:.1}% right, {:.1} reasoning tokens ({:.1}% fewer), {:.0}% \
         cut short",
        report.validation.len(),
        100.0 * report.full.accuracy,
        report.full.mean_reasoning,
        p.alpha,
        p.confidence,
        p.progress,
        p.remaining,
        100.0 * report.chosen.accuracy,
        report.chosen.mean_reasoning,
        100.0 * report.chosen.reduction(&report.full),
        100.0 * report.chosen.exited
    );
    let mut metadata: std::collections::HashMap<String, String> =
        manifest(&eng, &model_path, &[a.problems.as_path()])?.into_iter().collect();
    metadata.extend([
        ("profile".to_string(), profile.name.clone()),
        ("traces".to_string(), set.records.len().to_string()),
        ("validation_auc".to_string(), format!("{:.4}", report.metrics.auc)),
        ("validation_progress_mae".to_string(), format!("{:.4}", report.metrics.progress_mae)),
        ("validation_log_remaining_mae".to_string(), format!("{:.4}", report.metrics.log_remaining_mae)),
        ("validation_reduction".to_string(), format!("{:.4}", report.chosen.reduction(&report.full))),
        ("train_seconds".to_string(), format!("{:.0}", t0.elapsed().as_secs_f64())),
        (
            "settings".to_string(),
            format!(
                "hidden={} epochs={} batch={} lr={} seed={} budget={}",
                a.hidden, a.epochs, a.batch, a.lr, a.seed, a.budget
            ),
        ),
    ]);
    save_signal_head(&report.head, &p, metadata, &out)?;
    let png = sibling(&out, "signals.png");
    plot_signals(&report.head, &set, &report.validation, 8, &png)?;
    println!("wrote {} and {}", out.display(), png.display());
    Ok(())
}
