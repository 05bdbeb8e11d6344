//! One module per subcommand, plus the flags they share.

pub mod bench;
pub mod fetch;
pub mod generate;
pub mod perplexity;
pub mod serve;
pub mod tokenize;
pub mod train_draft;

use std::path::PathBuf;

/// Flags every model-running subcommand takes.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file (default: SmolLM2-135M-Instruct, fetched into models/ if missing).
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

/// Decoding-mode flags shared by `generate` and `bench`.
#[derive(clap::Args, Clone, Debug)]
pub struct ModeArgs {
    /// How tokens are produced: dense, eagle (tree speculative decoding with a trained draft head; lossless)
    /// or ngram (tree speculative decoding with prompt lookup; lossless).
    #[arg(long, default_value = "dense")]
    pub mode: engine::speculative::Mode,
    /// Draft head for --mode eagle (default: heads/<model file stem>.draft.safetensors).
    #[arg(long)]
    pub draft: Option<PathBuf>,
    /// Draft tree as DEPTH,TOP_K,BUDGET (default for eagle: 1,1,1; for ngram: 5,2,8).
    #[arg(long, value_parser = parse_tree)]
    pub tree: Option<decode::speculative::TreeConfig>,
}

fn parse_tree(s: &str) -> Result<decode::speculative::TreeConfig, String> {
    let v: Vec<usize> =
        s.split(',').map(|x| x.trim().parse().map_err(|_| format!("bad number `{x}`"))).collect::<Result<_, _>>()?;
    match v[..] {
        [depth, top_k, budget] => Ok(decode::speculative::TreeConfig { depth, top_k, budget }),
        _ => Err("expected DEPTH,TOP_K,BUDGET".into()),
    }
}

impl ModeArgs {
    /// The proposer for a speculative mode (None for dense).
    pub fn proposer(
        &self,
        eng: &engine::Engine,
        model_path: &std::path::Path,
    ) -> anyhow::Result<Option<engine::speculative::AnyProposer>> {
        use engine::speculative::{load_head, AnyProposer, Mode};
        Ok(match self.mode {
            Mode::Dense => None,
            Mode::Eagle => Some(AnyProposer::eagle(load_head(eng, model_path, self.draft.as_deref())?, self.tree)),
            Mode::Ngram => {
                let mut p = decode::speculative::NgramProposer::default();
                if let Some(t) = self.tree {
                    p.config.tree = t;
                }
                Some(AnyProposer::Ngram(p))
            }
        })
    }
}
