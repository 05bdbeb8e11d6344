//! One module per subcommand, plus the flags they share.

pub mod bench;
pub mod fetch;
pub mod generate;
pub mod perplexity;
pub mod serve;
pub mod tokenize;

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
        let path = engine::resolve_model(self.model.clone(), true)?;
        Ok(engine::Engine::load(path)?)
    }
}
