//! `specee eval -m PATH --mode specee|specee-eagle --text FILE [--prompts FILE.jsonl] [-c 256] [--chunks N] [-n 64] [--json]`:
//! the quality of a lossy mode against dense decoding.
//!
//! - `--text`: teacher-forced, chunked as `specee perplexity` (chunks of `-c` tokens, the first half as context):
//!   at every scored position the mode decides the next token; `agreement` is the share equal to dense top-1,
//!   `ppl_dense` / `ppl_mode` the perplexities (the mode's from its exit layer's logits), `avg_layers` the layers
//!   run per token. For `specee-eagle` every scored position is the root of a tree drafted from the true prefix,
//!   the mode's token is what that step would commit first, and `avg_layers` counts layers per tree forward.
//! - `--prompts`: free-running greedy, `-n` tokens per prompt (no stop at end of generation): mean matching
//!   prefix with dense and the share of prompts whose output is identical.

use super::{ModeArgs, ModelArgs};
use engine::speculative::Mode;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Held-out text for the teacher-forced measurement.
    #[arg(long)]
    pub text: PathBuf,
    /// Held-out prompts for the free-running measurement (JSON lines: {"prompt": ...} or {"messages": [...]}).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Chunk length in tokens (teacher-forced).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 256)]
    pub ctx: usize,
    /// Evaluate at most this many chunks (0 = all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    /// Tokens generated per prompt (free-running).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub gen: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let which = match a.mode.mode() {
        Mode::Specee => engine::early_exit::ExitMode::Specee,
        Mode::SpeceeEagle => engine::early_exit::ExitMode::Merged,
        other => anyhow::bail!(
            "`specee eval` measures lossy modes; --mode {other} is lossless (use --mode specee or specee-eagle)"
        ),
    };
    let text =
        std::fs::read_to_string(&a.text).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", a.text.display()))?;
    let (eng, path) = a.model.load_with_path()?;
    let threads = a.model.threads();
    let setup = a.mode.specee_setup(&eng, &path)?;
    let quiet = a.json;
    let show = |what: &str, done: usize, total: usize| {
        if !quiet {
            eprint!("\r{what} [{done}/{total}]   ");
            let _ = std::io::stderr().flush();
        }
    };
    let t = engine::early_exit::eval_text(&eng, &setup, which, &text, a.ctx, threads, a.chunks, |d, n| {
        show("teacher-forced", d, n)
    })?;
    if !quiet {
        eprintln!();
    }
    let n_layers = eng.model.config.n_layers;
    let mut out = json!({
        "model": path.display().to_string(),
        "mode": a.mode.mode().name(),
        "kv_policy": format!("{:?}", setup.config.policy).to_lowercase(),
        "verify": format!("{:?}", setup.config.verify).to_lowercase(),
        "threshold": setup.threshold(),
        "n_layers": n_layers,
        "positions": t.positions,
        "agreement": t.agreement,
        "ppl_dense": t.ppl_dense,
        "ppl_mode": t.ppl_mode,
        "avg_layers": t.exits.avg_layers,
        "exit_rate": t.exits.exit_rate,
        "predictor_calls_per_token": t.exits.predictor_calls_per_token,
        "verify_failures_per_token": t.exits.verify_failures_per_token,
        "seconds": t.seconds,
    });
    if let Some(pp) = &a.prompts {
        let prompts = engine::bench::read_prompts(&eng, pp)?;
        let p = engine::early_exit::eval_prompts(&eng, &setup, which, &prompts, a.gen, threads, |d, n| {
            show("free-running", d, n)
        })?;
        if !quiet {
            eprintln!();
        }
        out["free_running"] = json!({
            "prompts": p.prompts,
            "n_gen": p.n_tokens,
            "mean_matching_prefix": p.mean_matching_prefix,
            "exact_match": p.exact_match,
            "avg_layers": p.exits.avg_layers,
        });
    }
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "teacher-forced ({} positions of {}): agreement {:.4}, PPL dense {:.4} → mode {:.4} ({:+.2}%), \
         {:.2} of {} layers per {}, {:.0}% settled by a predictor, {:.2} predictor calls and {:.3} failed \
         verifications per token",
        t.positions,
        a.text.display(),
        t.agreement,
        t.ppl_dense,
        t.ppl_mode,
        100.0 * (t.ppl_mode / t.ppl_dense - 1.0),
        t.exits.avg_layers,
        n_layers,
        if which == engine::early_exit::ExitMode::Merged { "tree forward" } else { "token" },
        100.0 * t.exits.exit_rate,
        t.exits.predictor_calls_per_token,
        t.exits.verify_failures_per_token
    );
    if let Some(f) = out.get("free_running") {
        println!(
            "free-running ({} prompts × {} tokens): mean matching prefix {:.1} tokens, {:.0}% identical to dense, \
             {:.2} layers per token",
            f["prompts"],
            f["n_gen"],
            f["mean_matching_prefix"].as_f64().unwrap_or(0.0),
            100.0 * f["exact_match"].as_f64().unwrap_or(0.0),
            f["avg_layers"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}
