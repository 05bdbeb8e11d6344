//! `specee generate -m PATH -p TEXT -n N [sampling flags] [--chat] [--mode dense|eagle|ngram|specee] [--json]`
//! (or `--messages FILE` instead of `-p`: a conversation's next answer): streams the continuation to stdout and prints prompt and decode speeds to stderr; `--json` prints one object instead. Without `--mode`,
//! greedy decoding runs eagle when a draft head is at hand ([`engine::speculative::auto_mode`]): the same tokens
//! as dense, sooner.

use super::{generate_with, ModeArgs, ModelArgs, RunStats, SamplingArgs};
use engine::GenerateParams;
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Prompt text.
    #[arg(short = 'p', long = "prompt", required_unless_present = "messages", conflicts_with = "messages")]
    pub prompt: Option<String>,
    /// A conversation to answer instead of a prompt: OpenAI-style JSON messages (what `specee chat`'s `/save`
    /// writes), rendered with the model's chat template, the assistant's turn opened.
    #[arg(long, value_name = "FILE")]
    pub messages: Option<std::path::PathBuf>,
    /// Number of tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n: usize,
    /// Context size in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Render the prompt as one user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Ask the model to reason (a reasoning profile: a built-in name, `boxed` or `think`, or a profile file; alone:
    /// the model's default) and report reasoning and answer tokens apart. Renders the prompt as a question with
    /// the profile's messages and the model's chat template (implies --chat).
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "PROFILE")]
    pub reasoning: Option<String>,
    #[command(flatten)]
    pub exit: super::ReasoningExitArgs,
    /// Constrain the output to a JSON schema (a JSON file; `{}` for any JSON value): the output is JSON that
    /// validates against it, ending where the JSON does. Dense and eagle (identical output) follow it.
    #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Constrain the output to a grammar in llguidance's Lark dialect (a text file; `start: …` rules,
    /// GBNF-like; `%json {…}` embeds a JSON schema).
    #[arg(long, value_name = "FILE")]
    pub grammar: Option<std::path::PathBuf>,
    /// With a grammar in dense decoding, what to do with the tokens the grammar forces (keys, separators):
    /// `checked` feeds them as extra rows of one forward and keeps each only where the model would have chosen it
    /// (the same output as `off`, in fewer forwards); `unchecked` commits them as they are (a little faster; the
    /// output can differ); `off` runs one forward per token. Eagle drafts the forced tokens instead.
    #[arg(long, value_name = "HOW", default_value = "checked", value_parser = jump_forward)]
    pub jump_forward: engine::JumpForward,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (prompt_ids, generated_ids, text, timings) instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Report each generated token's log probability under the full model, with its K most likely alternatives
    /// (0 to 20): a table on stderr after the text, or `logprobs` in `--json`. Dense and eagle (equal values).
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u8).range(0..=20))]
    pub logprobs: Option<u8>,
}

/// A token's text as the log probability listings show it (invalid UTF-8 replaced).
fn token_text(eng: &engine::Engine, token: u32) -> String {
    String::from_utf8_lossy(eng.tokenizer.token_bytes(token)).into_owned()
}

/// `--json`'s `logprobs`: one object per generated token.
fn logprobs_json(eng: &engine::Engine, entries: &[engine::TokenLogprobs]) -> serde_json::Value {
    let alt = |&(t, lp): &(u32, f32)| serde_json::json!({"token": t, "text": token_text(eng, t), "logprob": lp});
    entries
        .iter()
        .map(|e| {
            serde_json::json!({
                "token": e.token,
                "text": token_text(eng, e.token),
                "logprob": e.logprob,
                "top": e.top.iter().map(alt).collect::<Vec<_>>(),
            })
        })
        .collect()
}

fn jump_forward(name: &str) -> Result<engine::JumpForward, String> {
    engine::JumpForward::parse(name).ok_or_else(|| format!("'{name}': give checked, unchecked or off"))
}

/// The grammar `--json-schema` or `--grammar` names, read and parsed (a clear error for a missing file or bad JSON).
fn grammar_spec(
    schema: Option<&std::path::Path>,
    lark: Option<&std::path::Path>,
) -> anyhow::Result<Option<engine::constraint::GrammarSpec>> {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()));
    Ok(match (schema, lark) {
        (Some(p), _) => {
            let v = serde_json::from_str(&read(p)?).map_err(|e| anyhow::anyhow!("{}: not JSON: {e}", p.display()))?;
            Some(engine::constraint::GrammarSpec::JsonSchema(v))
        }
        (None, Some(p)) => Some(engine::constraint::GrammarSpec::Lark(read(p)?)),
        (None, None) => None,
    })
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    let (eng, model_path) = a.model.load_with_path()?;
    let params = GenerateParams {
        max_tokens: a.n,
        sampling: a.sampling.params(),
        stop_at_eog: !a.ignore_eos,
        grammar: grammar_spec(a.json_schema.as_deref(), a.grammar.as_deref())?,
        logprobs: a.logprobs.map(usize::from),
        jump_forward: a.jump_forward,
        ..Default::default()
    };
    let auto = || engine::speculative::auto_mode(&model_path, a.mode.draft.as_deref(), &params.sampling);
    let mode = *a.mode.mode.get_or_insert_with(auto);
    let exit = a.exit.exit(&eng, &model_path)?;
    if !matches!(exit, engine::reasoning_exit::ReasoningExit::None) && a.reasoning.is_none() {
        a.reasoning = Some(String::new());
    }
    let profile = engine::reasoning::ReasoningProfile::from_flag(a.reasoning.as_deref(), &eng)?;
    let text = match (&profile, &a.messages, &a.prompt) {
        (_, Some(file), _) => {
            let json = std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let messages =
                engine::conversation::parse_messages(&json).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            anyhow::ensure!(a.reasoning.is_none(), "--messages does not combine with --reasoning");
            eng.render_chat(&messages)?
        }
        (Some(p), None, Some(prompt)) => p.render(&eng, prompt)?,
        (None, None, Some(prompt)) => eng.render_prompt(prompt, a.chat)?,
        (_, None, None) => anyhow::bail!("give a prompt (-p TEXT) or a conversation (--messages FILE)"),
    };
    let ids = eng.tokenize_prompt(&text);
    let json = a.json;
    let mut out = std::io::stdout().lock();
    let on_text = |piece: &str| {
        if !json {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
        true
    };
    let (g, stats, cut, tree) = match (&exit, &profile) {
        (engine::reasoning_exit::ReasoningExit::None, _) | (_, None) => {
            let runner = a.mode.runner(&eng, &model_path)?;
            let tree = runner.tree();
            let (g, stats) = generate_with(&eng, runner, &ids, &params, a.ctx, a.model.threads(), on_text)?;
            (g, stats, None, tree)
        }
        (exit, Some(p)) => {
            anyhow::ensure!(a.logprobs.is_none(), "--logprobs does not combine with a reasoning exit");
            let proposer = a.mode.reasoning_proposer(&eng, &model_path)?;
            let tree = proposer.tree();
            let threads = a.model.threads();
            let (g, r) = eng.generate_reasoning(&ids, &params, a.ctx, threads, proposer, p, exit, on_text)?;
            let stats = match mode {
                engine::speculative::Mode::Dense => RunStats::Dense,
                _ => RunStats::Speculative(r.speculative),
            };
            (g, stats, Some(r), tree)
        }
    };
    drop(out);
    let t = &g.timings;
    let split = profile.as_ref().map(|p| (p.split(&eng, &g.generated_ids), p.answer(&g.text)));
    if json {
        let mut v = serde_json::json!({
                "prompt_ids": g.prompt_ids,
                "generated_ids": g.generated_ids,
                "text": g.text,
                "mode": mode.name(),
                "finish_reason": match g.finish {
                    engine::FinishReason::Length => "length",
                    engine::FinishReason::ContextFull => "context_full",
                    engine::FinishReason::Stop => "stop",
                    engine::FinishReason::Cancelled => "cancelled",
                },
                "timings": {
                    "prompt_tokens_per_s": t.prompt_tokens_per_s(),
                    "decode_tokens_per_s": t.decode_tokens_per_s(),
                    "prompt_tokens": t.prompt_tokens,
                    "prompt_seconds": t.prompt_seconds,
                    "decode_tokens": t.decode_tokens,
                    "forced_tokens": t.forced_tokens,
                },
                "speculative": match stats.speculative() {
                    Some(s) => serde_json::json!({
                        "acceptance_length": s.acceptance_length(),
                        "target_forwards": s.target_forwards,
                        "drafted_nodes": s.drafted_nodes,
                        "accepted_drafts": s.accepted_drafts,
                        "draft_share": s.draft_share(),
                        "tree": tree.map(|t| t.to_string()),
                    }),
                    _ => serde_json::Value::Null,
                },
                "early_exit": match stats.exits() {
                    Some(s) => serde_json::json!({
                        "avg_layers": s.avg_layers,
                        "exit_rate": s.exit_rate,
                        "predictor_calls_per_token": s.predictor_calls_per_token,
                        "verify_failures_per_token": s.verify_failures_per_token,
                    }),
                    None => serde_json::Value::Null,
                },
        });
        if let Some(entries) = &g.logprobs {
            v["logprobs"] = logprobs_json(&eng, entries);
        }
        if let Some((s, answer)) = split {
            v["reasoning"] = serde_json::json!({
                "profile": profile.as_ref().map(|p| p.name.clone()),
                "reasoning_tokens": s.reasoning_tokens,
                "answer_tokens": s.answer_tokens,
                "ended": s.ended,
                "answer": answer,
                "exit": exit.name(),
                "exited_at": cut.and_then(|r| r.exited_at),
                "trials": cut.map_or(0, |r| r.trials),
            });
        }
        println!("{v}");
    } else {
        println!();
        let _ = std::io::stdout().flush();
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | decode: {} tokens, {:.1} tok/s ({mode})",
            t.prompt_tokens,
            t.prompt_tokens_per_s(),
            t.decode_tokens,
            t.decode_tokens_per_s()
        );
        if let Some(entries) = &g.logprobs {
            eprintln!("log probabilities (token, logprob, then the most likely alternatives):");
            for e in entries {
                let alts: Vec<String> =
                    e.top.iter().map(|&(t, lp)| format!("{:?} {lp:.3}", token_text(&eng, t))).collect();
                eprintln!(
                    "  {:<16} {:>8.4}  {}",
                    format!("{:?}", token_text(&eng, e.token)),
                    e.logprob,
                    alts.join(", ")
                );
            }
        }
        if let Some((s, answer)) = split {
            eprintln!(
                "reasoning: {} tokens{}, answer: {} tokens, final answer: {}",
                s.reasoning_tokens,
                if s.ended { "" } else { " (not ended)" },
                s.answer_tokens,
                answer.map_or("none found".to_string(), |x| x.to_string())
            );
        }
        if let Some(r) = cut {
            match r.exited_at {
                Some(t) => eprintln!("{}: reasoning cut after {t} tokens ({} trial answers)", exit.name(), r.trials),
                None => eprintln!("{}: the reasoning was not cut ({} trial answers)", exit.name(), r.trials),
            }
        }
        if g.finish == engine::FinishReason::ContextFull {
            eprintln!(
                "stopped after {} of {} tokens: the context of {} tokens is full (raise -c/--ctx-size)",
                g.generated_ids.len(),
                a.n,
                a.ctx
            );
        }
        if let Some(s) = stats.exits() {
            let unit = if matches!(stats, RunStats::Merged(_)) { "tree forward" } else { "token" };
            eprintln!(
                "early exit: {:.1} of {} layers per {unit}, {:.0}% settled by a predictor, {:.2} predictor calls and \
                 {:.3} failed verifications per token",
                s.avg_layers,
                eng.model.config.n_layers,
                100.0 * s.exit_rate,
                s.predictor_calls_per_token,
                s.verify_failures_per_token
            );
        }
        if let Some(s) = stats.speculative() {
            eprintln!(
                "speculative: τ {:.2} tokens per target forward ({} forwards, {} of {} drafted tokens accepted), \
                 {:.0}% of decode time drafting{}",
                s.acceptance_length(),
                s.target_forwards,
                s.accepted_drafts,
                s.drafted_nodes,
                100.0 * s.draft_share(),
                tree.map_or(String::new(), |t| format!(", tree {t}"))
            );
        }
    }
    Ok(())
}
