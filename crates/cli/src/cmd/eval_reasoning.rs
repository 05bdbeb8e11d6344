//! `specee eval-reasoning -m PATH --problems FILE.jsonl [--mode M] [--reasoning-exit none|deer|specexit] [--profile P] [-n N] [--json]`:
//! how well and how fast a model reasons through math word problems with known answers (issue #30).
//!
//! Each problem (`{"question": …, "answer": N}`, `scripts/math_problems.py` writes them) is rendered with a
//! reasoning profile ([`engine::reasoning`]: the model's default, or `--profile NAME|FILE`) and answered greedily
//! with the decoding mode; the final answer is parsed strictly from the profile's format (`\boxed{N}` or
//! `Answer: N`) and compared with the known one. Reported: accuracy, mean reasoning and total tokens, the share of
//! problems whose reasoning never ended within `-n` tokens, and seconds per problem (prompt and decoding).
//! `--reasoning-exit none` is full reasoning; `deer` and `specexit` cut it short ([`engine::reasoning_exit`]) and
//! run full reasoning beside them on every problem, with the same decoder, for the reduction and speed-up.

use super::{generate_with, ModeArgs, ModelArgs, ReasoningExitArgs};
use engine::reasoning::{read_problems, Problem, ReasoningProfile};
use engine::reasoning_exit::ReasoningExit;
use serde_json::{json, Value};
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
    #[command(flatten)]
    pub exit: ReasoningExitArgs,
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

/// One problem's outcome.
struct Outcome {
    reasoning: usize,
    answer_tokens: usize,
    total: usize,
    ended: bool,
    answer: Option<f64>,
    right: bool,
    seconds: f64,
    exited_at: Option<usize>,
    trials: usize,
}

impl Outcome {
    fn of(profile: &ReasoningProfile, eng: &engine::Engine, p: &Problem, g: &engine::Generation, seconds: f64) -> Self {
        let split = profile.split(eng, &g.generated_ids);
        let answer = profile.answer(&g.text);
        Outcome {
            reasoning: split.reasoning_tokens,
            answer_tokens: split.answer_tokens,
            total: g.generated_ids.len(),
            ended: split.ended,
            right: answer.is_some_and(|x| (x - p.answer).abs() < 1e-6),
            answer,
            seconds,
            exited_at: None,
            trials: 0,
        }
    }

    fn json(&self, expected: f64) -> Value {
        json!({
            "reasoning_tokens": self.reasoning,
            "answer_tokens": self.answer_tokens,
            "reasoning_ended": self.ended,
            "answer": self.answer,
            "expected": expected,
            "correct": self.right,
            "seconds": self.seconds,
            "exited_at": self.exited_at,
            "trials": self.trials,
        })
    }
}

/// The summary of one policy over all problems (`--json`'s keys).
fn summary(rows: &[Outcome], problems: &[Problem]) -> Value {
    let n = rows.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Outcome) -> f64| rows.iter().map(f).sum::<f64>() / n;
    json!({
        "accuracy": mean(&|o| f64::from(u8::from(o.right))),
        "mean_reasoning_tokens": mean(&|o| o.reasoning as f64),
        "mean_total_tokens": mean(&|o| o.total as f64),
        "unended_share": mean(&|o| f64::from(u8::from(!o.ended))),
        "exited_share": mean(&|o| f64::from(u8::from(o.exited_at.is_some()))),
        "mean_trials": mean(&|o| o.trials as f64),
        "seconds_per_problem": mean(&|o| o.seconds),
        "per_problem": rows.iter().zip(problems).map(|(o, p)| o.json(p.answer)).collect::<Vec<_>>(),
    })
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
    let exit = a.exit.exit(&eng, &model_path)?;
    let threads = a.model.threads();
    let ctx = |ids: &[u32]| ids.len() + a.n + 1;
    eng.model.warm_head_screen(threads);
    // Full reasoning: plain generation without an exit; with one, the exit's own decoder (the same tokens) so
    // that both sides of the comparison decode alike.
    let (mut base, mut cut) = (Vec::new(), Vec::new());
    for (i, p) in problems.iter().enumerate() {
        let ids = eng.tokenize_prompt(&profile.render(&eng, &p.question)?);
        let start = Instant::now();
        let full = if matches!(exit, ReasoningExit::None) {
            let runner = a.mode.runner(&eng, &model_path)?;
            generate_with(&eng, runner, &ids, &params, ctx(&ids), threads, |_| true)?.0
        } else {
            let proposer = a.mode.reasoning_proposer(&eng, &model_path)?;
            let none = ReasoningExit::None;
            eng.generate_reasoning(&ids, &params, ctx(&ids), threads, proposer, &profile, &none, |_| true)?.0
        };
        let o = Outcome::of(&profile, &eng, p, &full, start.elapsed().as_secs_f64());
        if !a.json {
            eprintln!("{}", line(i, problems.len(), "full", &o, p.answer));
        }
        base.push(o);
        if matches!(exit, ReasoningExit::None) {
            continue;
        }
        let proposer = a.mode.reasoning_proposer(&eng, &model_path)?;
        let start = Instant::now();
        let (g, stats) =
            eng.generate_reasoning(&ids, &params, ctx(&ids), threads, proposer, &profile, &exit, |_| true)?;
        let mut o = Outcome::of(&profile, &eng, p, &g, start.elapsed().as_secs_f64());
        o.exited_at = stats.exited_at;
        o.trials = stats.trials;
        if !a.json {
            eprintln!("{}", line(i, problems.len(), exit.name(), &o, p.answer));
        }
        cut.push(o);
    }
    let mut out = json!({
        "model": model_path.display().to_string(),
        "mode": mode.name(),
        "reasoning_exit": exit.name(),
        "profile": profile.name,
        "problems": problems.len(),
        "max_tokens": a.n,
    });
    let base_summary = summary(&base, &problems);
    let obj = out.as_object_mut().expect("an object");
    match &exit {
        ReasoningExit::None => obj.extend(base_summary.as_object().cloned().unwrap_or_default()),
        _ => {
            let s = summary(&cut, &problems);
            let ratio = |k: &str| base_summary[k].as_f64().unwrap_or(0.0) / s[k].as_f64().unwrap_or(0.0).max(1e-9);
            obj.insert("reasoning_reduction".into(), json!(1.0 - 1.0 / ratio("mean_reasoning_tokens")));
            obj.insert("speedup".into(), json!(ratio("seconds_per_problem")));
            if let ReasoningExit::Deer { threshold } = exit {
                obj.insert("deer_threshold".into(), json!(threshold));
            }
            if let ReasoningExit::SpecExit(_, p) = &exit {
                obj.insert(
                    "policy".into(),
                    json!({"alpha": p.alpha, "confidence": p.confidence, "progress": p.progress, "remaining": p.remaining}),
                );
            }
            obj.extend(s.as_object().cloned().unwrap_or_default());
            obj.insert("baseline".into(), base_summary.clone());
        }
    }
    if a.json {
        println!("{out}");
        return Ok(());
    }
    println!(
        "| mode | reasoning exit | problems | accuracy | reasoning tokens | total tokens | unended | cut short | s per problem |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let row = |name: &str, s: &Value| {
        let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
        println!(
            "| {} | {name} | {} | {:.1}% | {:.1} | {:.1} | {:.0}% | {:.0}% | {:.2} |",
            mode.name(),
            problems.len(),
            100.0 * f("accuracy"),
            f("mean_reasoning_tokens"),
            f("mean_total_tokens"),
            100.0 * f("unended_share"),
            100.0 * f("exited_share"),
            f("seconds_per_problem")
        );
    };
    row("none", &base_summary);
    if !matches!(exit, ReasoningExit::None) {
        row(exit.name(), &out);
        println!(
            "\n{}: {:.1}% fewer reasoning tokens, {:.2}x end-to-end against full reasoning (same decoder, same run)",
            exit.name(),
            100.0 * out["reasoning_reduction"].as_f64().unwrap_or(0.0),
            out["speedup"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

/// One progress line on stderr.
fn line(i: usize, n: usize, what: &str, o: &Outcome, expected: f64) -> String {
    format!(
        "problem {}/{n} [{what}]: {} reasoning + {} answer tokens{}{}, answer {} (expected {expected}) {}, {:.1} s",
        i + 1,
        o.reasoning,
        o.answer_tokens,
        if o.ended { "" } else { " (reasoning never ended)" },
        o.exited_at.map_or(String::new(), |t| format!(" (cut after {t})")),
        o.answer.map_or("none".to_string(), |x| x.to_string()),
        if o.right { "right" } else { "WRONG" },
        o.seconds
    )
}
