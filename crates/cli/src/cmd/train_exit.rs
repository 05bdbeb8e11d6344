//! `specee train-exit -m PATH --data RECORDS.jsonl [--data MORE.jsonl ...] --out EXIT.safetensors`: trains
//! SpecEE's per-layer exit predictors for a model (see `train::exit` and `decode::specee`).
//!
//! It traces the model at full depth over each record file (cached beside the output as
//! `EXIT.trace.<file stem>.safetensors`, reused on a rerun made from the same model, records, draft head and
//! options, rebuilt with a line saying why otherwise, unless `--reuse-cache`: [`train::cache`]; so a long
//! collection can be split into record files traced one run at a time), joins the traces (every fifth record of
//! each file is validation), trains one MLP per layer printing validation precision/recall, simulates exits on
//! the validation split to pick the unverified threshold and the offline layer set, and writes the predictor
//! file plus a PNG bar chart of the exit layers (`EXIT.exit-layers.png`). Last it calibrates a temperature per
//! layer for exit logits on training records (`--calibrate N`; see `train::exit::calibrate_temperatures`);
//! `--calibrate-only` adds temperatures to an existing predictor file (`--out`) without tracing or training.

use super::{manifest, per_record_file, sibling, CollectArgs, ModelArgs};
use anyhow::Context;
use std::path::PathBuf;
use train::data::read_records;
use train::exit::{
    calibrate_temperatures, choose_schedule, collect_exit, oracle, oracle_window_layers, plot_histogram, train_exit,
    ExitData, ExitTrainOptions,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Records to trace (JSON lines: {"messages": [...]} answered greedily, or {"text": "..."} teacher-forced).
    /// Repeat to join several files, each traced once into its own cache. Every fifth record of each file is
    /// held out for validation.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// Output predictor file (safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// Draft head giving the candidates (default: the model's shipped head).
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Features per predictor: 12 (as published: the candidates' logits, probabilities and their change), 16
    /// (plus the draft head's log-probabilities of the candidates) or 18 (plus how much the layer changed the
    /// residual stream: cosine and relative size of its update).
    #[arg(long, default_value_t = 16)]
    pub features: usize,
    /// Hidden units per predictor.
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    #[arg(long, default_value_t = 8)]
    pub epochs: usize,
    #[arg(long, default_value_t = 1024)]
    pub batch: usize,
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Simulated agreement with dense the unverified threshold must keep on the validation split.
    #[arg(long, default_value_t = 0.985)]
    pub target_agreement: f64,
    /// Train on the records before this index only (0: all; with several files, an index into the joined
    /// records, each file's starting at a multiple of 5 past the one before); validation stays every fifth record
    /// of all the traced data, so caps can be compared on the same validation tokens.
    #[arg(long, default_value_t = 0)]
    pub train_records: usize,
    /// Training records (every fifth skipped: those are validation) to calibrate the exit temperatures on
    /// (0: none, temperatures 1).
    #[arg(long, default_value_t = 40)]
    pub calibrate: usize,
    /// Only calibrate: read the predictors in --out, set their temperatures, write them back.
    #[arg(long)]
    pub calibrate_only: bool,
    /// Most layers in the offline set.
    #[arg(long, default_value_t = 8)]
    pub max_offline: usize,
    /// Only measure the ceiling of early exit with a perfect draft head: trace with each token's dense top-1
    /// forced among the candidates (cached as `EXIT.perfect-trace.<file stem>.safetensors`), print what a perfect
    /// predictor would reach on it, and stop (no predictors are written).
    #[arg(long)]
    pub perfect_head: bool,
    /// Also write the normed hidden state (the head's input) after every layer from this one on, for every traced
    /// token, as `EXIT.states.<file stem>.f16` (raw little-endian f16, tokens × layers × n_embd, in the order of
    /// the trace): data for studying predictors that read the hidden state (`scripts/exit_probe.py`). A file
    /// whose states file is missing or does not fit its cached trace is traced again; tracing a file without
    /// --keep-states removes its old states file. Large: 1.8 KB per token and layer on Qwen2.5-Coder.
    #[arg(long, value_name = "FROM_LAYER")]
    pub keep_states: Option<usize>,
    #[command(flatten)]
    pub collect: CollectArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.hidden == 0 || a.batch == 0 || a.epochs == 0 {
        anyhow::bail!("--hidden, --batch and --epochs must be at least 1");
    }
    let (engine, model_path) = a.model.load_with_path()?;
    if a.calibrate_only {
        let mut predictors = decode::specee::ExitPredictors::load(&a.out)
            .with_context(|| format!("reading predictors {}", a.out.display()))?;
        predictors.check_fits(engine.model.config.n_layers)?;
        calibrate(&engine, &a, &mut predictors)?;
        predictors.save(&a.out)?;
        eprintln!("wrote {} with temperatures", a.out.display());
        return Ok(());
    }
    let head = engine::speculative::load_head(&engine, &model_path, a.draft.as_deref())?;
    let head_path = a.draft.clone().unwrap_or_else(|| engine::speculative::default_head_path(&model_path));
    let (n_layers, d) = (engine.model.config.n_layers, engine.model.config.n_embd);
    if let Some(from) = a.keep_states {
        anyhow::ensure!(
            !a.perfect_head,
            "--keep-states keeps the states of a plain trace, not of --perfect-head's two"
        );
        anyhow::ensure!(from < n_layers, "--keep-states {from}: the model has layers 0..{}", n_layers - 1);
    }
    let kind = if a.perfect_head { "perfect-trace" } else { "trace" };
    let caches = per_record_file(&a.out, &a.data, kind, "safetensors")?;
    let states_files = per_record_file(&a.out, &a.data, "states", "f16")?;
    let start = std::time::Instant::now();
    let mut data = ExitData::default();
    for ((path, cache), states_file) in a.data.iter().zip(&caches).zip(&states_files) {
        let key = a
            .collect
            .key(&model_path, path, a.collect.limit)?
            .file("draft head", &head_path)?
            .option("--perfect-head", a.perfect_head);
        // With --keep-states a trace is traced again unless its states file is there and fits it (its tokens, the
        // layers asked for): one written for other layers or for a trace since replaced does not.
        let states_missing = a.keep_states.is_some() && !states_file.is_file();
        let cached = if !states_missing && train::cache::check(cache, &key, a.collect.reuse_cache)? {
            Some(ExitData::load(cache).with_context(|| format!("reading {}", cache.display()))?)
        } else {
            None
        };
        let cached = cached.filter(|part| {
            let Some(from) = a.keep_states else { return true };
            let want = (part.len() * (n_layers - from) * d * 2) as u64;
            let fits = std::fs::metadata(states_file).is_ok_and(|m| m.len() == want);
            if !fits {
                eprintln!("{} does not fit that trace (other layers or tokens): tracing again", states_file.display());
            }
            fits
        });
        let part = if let Some(part) = cached {
            part
        } else {
            let mut records = read_records(path)?;
            if a.collect.limit > 0 {
                records.truncate(a.collect.limit);
            }
            let opts = a.collect.options(a.model.threads());
            let bar = train::progress_bar(true, records.len() as u64, &format!("tracing {}", path.display()));
            let mut states = Vec::new();
            let keep = a.keep_states.map(|from| (from, &mut states));
            let part = collect_exit(&engine, &head, &records, opts, a.perfect_head, keep, |done, tokens| {
                bar.set_position(done as u64);
                bar.set_message(format!("{tokens} tokens"));
                if !super::console_is_terminal() && done % 50 == 0 {
                    eprintln!("traced {done}/{} records of {}, {tokens} tokens", records.len(), path.display());
                }
            })?;
            bar.finish_and_clear();
            part.save(cache, &key)?;
            let f = states_file;
            if a.keep_states.is_some() {
                train::exit::save_states(f, &states).with_context(|| format!("writing {}", f.display()))?;
                eprintln!("wrote {} ({:.0} MB)", f.display(), std::fs::metadata(f).map_or(0, |m| m.len()) as f64 / 1e6);
            } else if f.is_file() {
                // States of the trace this one replaces would no longer match it.
                std::fs::remove_file(f).with_context(|| format!("removing {}", f.display()))?;
                eprintln!("removed {} (written for the trace this one replaces)", f.display());
            }
            part
        };
        data.append(&part).with_context(|| format!("joining the trace of {}", path.display()))?;
    }
    let trace_s = start.elapsed().as_secs_f64();
    let n_val = (0..data.len()).filter(|&t| data.is_validation(t)).count();
    let reachable = (0..data.len()).filter(|&t| data.reachable(t)).count();
    eprintln!(
        "{} tokens traced ({} validation) in {trace_s:.0} s; dense top-1 among the draft's 4 candidates: {:.3}",
        data.len(),
        n_val,
        reachable as f64 / data.len().max(1) as f64
    );
    if a.perfect_head {
        report_perfect_head(&data);
        return Ok(());
    }
    let topts = ExitTrainOptions {
        hidden: a.hidden,
        epochs: a.epochs,
        batch: a.batch,
        lr: a.lr,
        seed: a.seed,
        max_gap: 4,
        n_features: a.features,
        train_records: a.train_records,
    };
    let t0 = std::time::Instant::now();
    let (layers, _reports) = train_exit(&data, &topts, |line| eprintln!("{line}"))?;
    let train_s = t0.elapsed().as_secs_f64();
    let grid = [0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995];
    let (schedule, chosen, sims) =
        choose_schedule(&data, &layers, &grid, a.target_agreement, 0.9, a.max_offline.max(1));
    eprintln!("{}", ceiling_line("a perfect predictor", &data));
    eprintln!("simulated exits on the validation split (every predictor active):");
    eprintln!("  threshold  exit-rate  avg-layers  agreement");
    for s in &sims {
        eprintln!("  {:>9.3}  {:>9.3}  {:>10.2}  {:>9.4}", s.threshold, s.exit_rate, s.avg_layers, s.agreement);
    }
    eprintln!(
        "chosen: unverified threshold {:.3} (agreement {:.4}, {:.2} layers); offline layers {:?}",
        chosen.threshold, chosen.agreement, chosen.avg_layers, schedule.offline
    );
    let mut predictors = decode::specee::ExitPredictors::empty(n_layers);
    predictors.layers = layers;
    predictors.schedule = schedule;
    // Verified exits (`--verify full`) use the same threshold: the published 0.5 let the full head's top-1 at
    // shallow layers through (SmolLM2: teacher-forced agreement 0.46–0.82 at 0.5, 0.997 at 0.95).
    predictors.threshold = chosen.threshold;
    predictors.threshold_unverified = chosen.threshold;
    let inputs: Vec<&std::path::Path> = a.data.iter().chain([&head_path]).map(PathBuf::as_path).collect();
    predictors.metadata.extend(manifest(&engine, &model_path, &inputs)?);
    predictors.metadata.extend([
        ("train_data".to_string(), a.data.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")),
        ("draft_head".to_string(), super::shown(&head_path)),
        ("traced_tokens".to_string(), data.len().to_string()),
        ("train_seconds".to_string(), format!("{:.0}", train_s)),
        ("seed".to_string(), a.seed.to_string()),
        ("validation_agreement".to_string(), format!("{:.4}", chosen.agreement)),
        ("validation_avg_layers".to_string(), format!("{:.2}", chosen.avg_layers)),
    ]);
    if a.calibrate > 0 {
        calibrate(&engine, &a, &mut predictors)?;
    }
    predictors.save(&a.out)?;
    let plot = sibling(&a.out, "exit-layers.png");
    plot_histogram(&chosen.histogram, &plot)?;
    eprintln!(
        "wrote {} ({:.1} MB) after training {:.0} s; exit-layer plot {}",
        a.out.display(),
        std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0) as f64 / 1e6,
        train_s,
        plot.display()
    );
    Ok(())
}

/// Sets `predictors.temperature` from the first `--calibrate` training-split records of the `--data` files (in
/// order; each file's every fifth record is validation).
fn calibrate(engine: &engine::Engine, a: &Args, predictors: &mut decode::specee::ExitPredictors) -> anyhow::Result<()> {
    let want = a.calibrate.max(1);
    let mut records = Vec::new();
    for path in &a.data {
        let training = read_records(path)?.into_iter().enumerate().filter(|(i, _)| i % 5 != 0).map(|(_, r)| r);
        records.extend(training.take(want - records.len()));
        if records.len() == want {
            break;
        }
    }
    let bar = train::progress_bar(true, records.len() as u64, "calibrating exit temperatures");
    let t0 = std::time::Instant::now();
    let opts = a.collect.options(a.model.threads());
    let (temps, report) = calibrate_temperatures(engine, &records, opts, |done, rows| {
        bar.set_position(done as u64);
        bar.set_message(format!("{rows} positions"));
    })?;
    bar.finish_and_clear();
    eprintln!(
        "exit temperatures ({} records, {:.0} s): layer, temperature, mean NLL at 1 → at it",
        records.len(),
        t0.elapsed().as_secs_f64()
    );
    for (il, (t, (n1, nt))) in temps.iter().zip(&report).enumerate().take(temps.len() - 1) {
        eprintln!("  {il:>2}  {t:>6.3}  {n1:>7.3} → {nt:>6.3}");
    }
    predictors.temperature = temps;
    predictors.metadata.insert("calibrate_records".into(), records.len().to_string());
    Ok(())
}

/// What a perfect predictor reaches on the validation split of `data` ([`oracle`]), as one line.
fn ceiling_line(who: &str, data: &ExitData) -> String {
    let o = oracle(data);
    format!(
        "ceiling ({who} on the validation split): {:.1}% of tokens exit, {:.2} of {} layers per token",
        100.0 * o.exit_rate,
        o.avg_layers,
        data.n_layers
    )
}

/// `--perfect-head`: the ceiling of a perfect head and predictor, the layer each token would exit after, and the
/// layers per forward committing k consecutive tokens ([`oracle_window_layers`]).
fn report_perfect_head(data: &ExitData) {
    eprintln!("{}", ceiling_line("a perfect draft head and a perfect predictor", data));
    let o = oracle(data);
    let share = |c: usize| 100.0 * c as f64 / o.histogram.iter().sum::<usize>().max(1) as f64;
    let layers: Vec<String> = o
        .histogram
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c > 0)
        .map(|(l, &c)| match l < data.n_layers {
            true => format!("{}:{:.1}%", l + 1, share(c)),
            false => format!("none:{:.1}%", share(c)),
        })
        .collect();
    eprintln!("tokens by the layer they would exit after: {}", layers.join(" "));
    let windows: Vec<String> = (2..=4).map(|k| format!("{k} tokens {:.2}", oracle_window_layers(data, k))).collect();
    eprintln!(
        "layers per forward that commits k consecutive tokens (a tree's accepted path; the forward runs until all \
         settled): {}",
        windows.join(", ")
    );
}
