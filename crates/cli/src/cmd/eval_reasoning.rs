//! `specee eval-reasoning -m PATH --problems FILE.jsonl [--mode M] [--reasoning-exit none] [--profile P] [-n N] [--json]`:
//! how well and how fast a model reasons through math word problems with known answers (issue #30).
//!
//! Each problem (`{"question": …, "answer": N}`, `scripts/math_problems.py` writes them) is rendered with a
//! reasoning profile ([`engine::reasoning`]: the model's default, or `--profile NAME|FILE`) and answered greedily
//! with the decoding mode; the final answer is parsed strictly from the profile's format (`\boxed{N}` or
//! `Answer: N`) and compared with the known one. Reported: accuracy, mean reasoning and total tokens, the share of
//! problems whose reasoning never ended within `-n` tokens, and seconds per problem (prompt and decoding).
//! `--reasoning-exit none` is full reasoning; the early exits (SpecExit, DEER) are still to come.

use super::{generate_with, ModeArgs, ModelArgs};
use engine::reasoning::{read_problems, ReasoningProfile};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Problems (JSON lines: {"question": "...", "answer": NUMBER}).
    #[arg(long)]
    pub problems: PathBuf,
    /// How the reasoning is cut short: `none` (full reasoning; the only one built so far). Not `--exit`, which
    /// names SpecEE's exit predictors in every command.
    #[arg(long, default_value = "none", value_parser = ["none"])]
    pub reasoning_exit: String,
    /// Reasoning profile: a built-in name (`boxed`, `think`) or a profile file (default: `think` for models with a
    /// `</think>` token, else `boxed`).
    #[arg(long)]
    pub profile: Option<String>,
    /// Most tokens generated per problem (reasoning and answer).
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n: usize,
    /// Only the first N problems (0: all).
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    let (eng, model_path) = a.model.load_with_path()?;
    let profile = ReasoningProfile::resolve(a.profile.as_deref(), &eng)?;
    let mut problems = read_problems(&a.problems)?;
    if a.limit > 0 {
        problems.truncate(a.limit);
    }
    let params = engine::GenerateParams { max_tokens: a.n, ..Default::default() };
    let auto = || engine::speculative::auto_mode(&model_path, a.mode.draft.as_deref(), &params.sampling);
    let mode = *a.mode.mode.get_or_insert_with(auto);
    let threads = a.model.threads();
    eng.model.warm_head_screen(threads);
    let (mut correct, mut reasoning, mut total, mut unended, mut seconds) = (0usize, 0usize, 0usize, 0usize, 0f64);
    let mut rows = Vec::new();
    for (i, p) in problems.iter().enumerate() {
        let ids = eng.tokenize_prompt(&profile.render(&eng, &p.question)?);
        let runner = a.mode.runner(&eng, &model_path)?;
        let start = Instant::now();
        let (g, _) = generate_with(&eng, runner, &ids, &params, ids.len() + a.n + 1, threads, |_| true)?;
        let secs = start.elapsed().as_secs_f64();
        let split = profile.split(&eng, &g.generated_ids);
        let answer = profile.answer(&g.text);
        let right = answer.is_some_and(|x| (x - p.answer).abs() < 1e-6);
        correct += usize::from(right);
        reasoning += split.reasoning_tokens;
        total += g.generated_ids.len();
        unended += usize::from(!split.ended);
        seconds += secs;
        if !a.json {
            eprintln!(
                "problem {}/{}: {} reasoning + {} answer tokens{}, answer {} (expected {}) {}, {secs:.1} s",
                i + 1,
                problems.len(),
                split.reasoning_tokens,
                split.answer_tokens,
                if split.ended { "" } else { " (reasoning never ended)" },
                answer.map_or("none".to_string(), |x| x.to_string()),
                p.answer,
                if right { "right" } else { "WRONG" }
            );
        }
        rows.push(json!({
            "reasoning_tokens": split.reasoning_tokens,
            "answer_tokens": split.answer_tokens,
            "reasoning_ended": split.ended,
            "answer": answer,
            "expected": p.answer,
            "correct": right,
            "seconds": secs,
        }));
    }
    let n = problems.len() as f64;
    let out = json!({
        "model": model_path.display().to_string(),
        "mode": mode.name(),
        "reasoning_exit": a.reasoning_exit,
        "profile": profile.name,
        "problems": problems.len(),
        "max_tokens": a.n,
        "accuracy": correct as f64 / n,
        "mean_reasoning_tokens": reasoning as f64 / n,
        "mean_total_tokens": total as f64 / n,
        "unended_share": unended as f64 / n,
        "seconds_per_problem": seconds / n,
        "per_problem": rows,
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "| mode | reasoning exit | problems | accuracy | reasoning tokens | total tokens | unended | s per problem |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {} | {} | {} | {:.1}% | {:.1} | {:.1} | {:.0}% | {:.2} |",
        mode.name(),
        a.reasoning_exit,
        problems.len(),
        100.0 * correct as f64 / n,
        reasoning as f64 / n,
        total as f64 / n,
        100.0 * unended as f64 / n,
        seconds / n
    );
    Ok(())
}
