//! `specee perplexity -m PATH -f FILE [-c 256] [--chunks N] [--json]`: perplexity as llama.cpp computes it;
//! the last line is `PPL = <value> ± <stderr>`.

use super::ModelArgs;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Chunk length in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 256)]
    pub ctx: usize,
    /// Evaluate at most this many chunks (0 = all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
    /// Print one JSON object instead.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(&a.file).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", a.file.display()))?;
    let eng = a.model.load()?;
    let quiet = a.json;
    let r = engine::perplexity::perplexity(&eng, &text, a.ctx, a.model.threads(), a.chunks, |done, total, running| {
        if !quiet {
            eprint!("\r[{done}/{total}] running PPL {running:.4}   ");
            let _ = std::io::stderr().flush();
        }
    })?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "ppl": r.ppl, "stderr": r.stderr, "chunks": r.chunks, "ctx": a.ctx, "tokens_scored": r.tokens_scored, "seconds": r.seconds })
        );
    } else {
        eprintln!();
        eprintln!("{} chunks of {} tokens, {} tokens scored, {:.1} s", r.chunks, a.ctx, r.tokens_scored, r.seconds);
        println!("PPL = {:.4} ± {:.4}", r.ppl, r.stderr);
    }
    Ok(())
}
