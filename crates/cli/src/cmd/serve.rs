//! `specee serve -m PATH [--host 127.0.0.1] [--port 8080] [--mode auto|dense|eagle|specee|specee-eagle] [--parallel N] [--queue N]
//! [-c CTX] [-t THREADS] [--kv-budget TOKENS] [--prefix-cache TOKENS] [--prefill-rows N] [--draft FILE] [--exit FILE]`: the OpenAI-compatible HTTP server (see the `server` crate). Prints
//! `listening on http://ADDR` on stdout once it accepts connections; SIGTERM or ctrl-c drains and stops it.

use super::ModelArgs;
use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default; anything else exposes an unauthenticated API).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Decoding mode of requests that do not choose one (`{"specee": {"mode": …}}`); auto: eagle for greedy
    /// requests when the model has a draft head (the same tokens as dense, sooner), dense for the rest.
    #[arg(long, default_value = "auto")]
    pub mode: String,
    /// Requests generated at once. From 2 on they are batched: every forward carries the next token of each
    /// request and chunks of new prompts (continuous batching, lossless), with a KV pool and a prefix cache;
    /// greedy eagle requests draft trees verified in the same forwards (see --tree-rows).
    /// At 1, each request runs alone in its mode (eagle, specee) on every thread.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// When batching: tokens of KV cache the admitted requests may reserve together (each reserves its prompt plus
    /// max_tokens, at most the context); requests beyond it wait. Default: ctx-size × parallel.
    #[arg(long, value_name = "TOKENS")]
    pub kv_budget: Option<usize>,
    /// When batching: tokens of finished requests' KV caches kept so that prompts sharing their prefix (a system
    /// prompt, the earlier turns of a chat) skip computing it (0: off).
    #[arg(long, value_name = "TOKENS", default_value_t = 4096)]
    pub prefix_cache: usize,
    /// When batching: most prompt tokens one forward prefills (longer prompts go in chunks, between the other
    /// requests' tokens).
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_PREFILL_ROWS)]
    pub prefill_rows: usize,
    /// When batching: rows the draft trees of greedy eagle requests share in one forward when several decode at
    /// once (a lone request drafts its whole tree; 0 or 1: only a lone request drafts).
    #[arg(long, value_name = "N", default_value_t = server::DEFAULT_TREE_ROWS)]
    pub tree_rows: usize,
    /// Requests that may wait for a free slot; beyond that the server answers 429.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Context size in tokens (prompt + generated) of each request.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = server::DEFAULT_BODY_LIMIT)]
    pub max_body: usize,
    /// Draft head for the eagle and specee modes (default: heads/<model file stem>.draft.safetensors when present).
    #[arg(long)]
    pub draft: Option<std::path::PathBuf>,
    /// Exit predictors for the specee mode (default: heads/<model file stem>.exit.safetensors when present).
    #[arg(long)]
    pub exit: Option<std::path::PathBuf>,
    /// N-gram datastore the eagle modes draft from where the context offers no lookup match (default:
    /// heads/<model file stem>.datastore.safetensors when present; `specee build-datastore` writes one).
    #[arg(long, conflicts_with = "no_datastore")]
    pub datastore: Option<std::path::PathBuf>,
    /// Draft from the context only, not from a datastore.
    #[arg(long)]
    pub no_datastore: bool,
    /// Count reasoning tokens in `usage.completion_tokens_details.reasoning_tokens` by a reasoning profile (a
    /// built-in name, `boxed` or `think`, or a profile file; alone: the model's default). Models with a `</think>`
    /// token count by `think` without it. Prompts are not changed.
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "PROFILE")]
    pub reasoning: Option<String>,
}

/// Loads what the eagle and specee modes need: the files given (an error if they fail) or the model's shipped
/// ones (skipped, with their modes, when absent).
fn resources(a: &Args, eng: &engine::Engine, path: &std::path::Path) -> anyhow::Result<server::ModeResources> {
    use engine::{early_exit, speculative};
    let draft_path = a.draft.clone().unwrap_or_else(|| speculative::default_head_path(path));
    let draft = if a.draft.is_some() || draft_path.exists() {
        Some(std::sync::Arc::new(speculative::load_head(eng, path, Some(&draft_path))?))
    } else {
        None
    };
    let datastore = if a.no_datastore { None } else { speculative::load_datastore(eng, path, a.datastore.as_deref())? };
    let exit_path = a.exit.clone().unwrap_or_else(|| early_exit::default_exit_path(path));
    let specee = match &draft {
        Some(head) if a.exit.is_some() || exit_path.exists() => Some(early_exit::SpecEeSetup {
            head: head.clone(),
            predictors: early_exit::load_predictors(eng, path, Some(&exit_path))?,
            config: decode::specee::SpecEeConfig::default(),
            tree: None,
            lookup: decode::speculative::EagleProposer::DEFAULT_LOOKUP,
            datastore: datastore.clone(),
        }),
        _ => None,
    };
    Ok(server::ModeResources { draft, specee, datastore })
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let mode = match a.mode.as_str() {
        "auto" => None,
        name => Some(
            server::Mode::parse(name)
                .with_context(|| format!("unknown --mode '{name}' (available: auto, {})", server::Mode::names()))?,
        ),
    };
    anyhow::ensure!(a.parallel >= 1, "--parallel must be at least 1");
    let path = engine::resolve_model(a.model.model.clone(), true)?;
    let model_id = path.file_stem().map_or_else(|| "specee".to_string(), |s| s.to_string_lossy().into_owned());
    let engine = engine::Engine::load(&path)?;
    let resources = resources(&a, &engine, &path)?;
    // Think models count their reasoning without being asked.
    use engine::reasoning::ReasoningProfile;
    let native = ReasoningProfile::is_native(&engine).then_some("");
    let reasoning = ReasoningProfile::from_flag(a.reasoning.as_deref().or(native), &engine)?;
    let config = server::Config {
        host: a.host,
        port: a.port,
        mode,
        parallel: a.parallel,
        queue: a.queue,
        ctx: a.ctx,
        threads: a.model.threads(),
        kv_budget: a.kv_budget,
        prefix_cache: a.prefix_cache,
        prefill_rows: a.prefill_rows,
        tree_rows: a.tree_rows,
        body_limit: a.max_body,
        model_id,
        resources,
        reasoning,
    };
    server::run(engine, config)?;
    Ok(())
}
