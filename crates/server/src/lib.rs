//! # server — an OpenAI-compatible HTTP server for specee
//!
//! `specee serve` puts one loaded [`engine::Engine`] behind the OpenAI API, so tools that speak it (the
//! official clients, curl) can use a local model:
//!
//! | route | what |
//! | --- | --- |
//! | `POST /v1/chat/completions` | chat, rendered with the model's chat template; `stream: true` gives SSE |
//! | `POST /v1/completions` | raw text (or token ids) continuation; `stream: true` gives SSE |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the one model served |
//! | `GET /health` | `{"status": "ok"}` (503 while shutting down) |
//! | `GET /metrics` | Prometheus text (see [`metrics`]) |
//!
//! How a request flows, one module per step:
//! 1. [`routes`]: the HTTP side — body limit, JSON errors for everything that fails, SSE.
//! 2. [`wire`]: the OpenAI JSON types, exactly as they travel.
//! 3. [`request`]: checks a request and turns it into generation settings; unsupported features (`n > 1`,
//!    tools, logprobs, non-text `response_format`, unknown fields) are refused with a 400.
//! 4. [`scheduler`]: bounded admission (429 with `Retry-After` beyond `--parallel` + `--queue`) and the thread
//!    that runs the engine; a client that disconnects cancels its generation. With `--parallel N ≥ 2`,
//!    [`batch`]: continuous batching of every request's rows into shared forwards, a KV pool, a prefix cache.
//! 5. [`mode`]: the decoding modes a request may pick (`{"specee": {"mode": "dense|eagle|specee"}}`) and what
//!    they run with ([`ModeResources`]: the draft head, the early-exit setup; loaded once at start).
//! 6. [`metrics`]: counters behind `/metrics`.
//!
//! SIGTERM or ctrl-c stops accepting connections, lets in-flight and queued requests finish, then returns;
//! a second signal exits at once. The server binds to loopback unless told otherwise.
//!
//! ```no_run
//! let engine = engine::Engine::load("models/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
//! server::run(engine, server::Config::default()).unwrap();
//! ```

pub mod batch;
pub mod error;
pub mod holdback;
pub mod metrics;
pub mod mode;
pub mod request;
pub mod routes;
pub mod scheduler;
pub mod tools;
pub mod wire;

pub use error::{ApiError, ServerError};
pub use mode::{Mode, ModeResources};

use metrics::Metrics;
use request::RequestDefaults;
use routes::AppState;
use scheduler::{Scheduler, SchedulerConfig};
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Default body size limit: 1 MiB.
pub const DEFAULT_BODY_LIMIT: usize = 1 << 20;

/// Default of [`Config::prefill_rows`]: prompt rows per batched forward. A chunk this long delays the other
/// requests' next token by one forward of this many rows.
pub const DEFAULT_PREFILL_ROWS: usize = 128;

/// Default of [`Config::tree_rows`]: rows the draft trees of several batched eagle requests share per forward.
pub const DEFAULT_TREE_ROWS: usize = 8;

/// How to serve.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address to bind (loopback by default).
    pub host: String,
    /// Port; 0 picks a free one (the address is printed on stdout).
    pub port: u16,
    /// Decoding mode of requests that do not choose one; `None` ("auto", the default): eagle for greedy
    /// requests when the draft head is loaded, dense otherwise.
    pub mode: Option<Mode>,
    /// Requests generated at once; from 2 on they share every forward ([`batch`]: continuous batching, a KV
    /// pool and a prefix cache), at 1 the one request runs its own mode (eagle, specee) with every thread.
    pub parallel: usize,
    /// Requests that may wait for a slot; more get 429.
    pub queue: usize,
    /// Context size, tokens (prompt + generated).
    pub ctx: usize,
    /// Compute threads in all; each of the `parallel` generations gets an equal share (at least one).
    pub threads: usize,
    /// Tokens of KV cache the batched requests may reserve together (`None`: `ctx × parallel`).
    pub kv_budget: Option<usize>,
    /// Tokens the prefix cache may hold when batching (0: none).
    pub prefix_cache: usize,
    /// Most prompt rows one batched forward prefills.
    pub prefill_rows: usize,
    /// Rows the draft trees of several batched eagle requests share per forward (a lone request drafts its whole
    /// tree; 0 or 1: no drafts beside other requests).
    pub tree_rows: usize,
    /// Largest request body, bytes.
    pub body_limit: usize,
    /// The model's id in `/v1/models` and in responses.
    pub model_id: String,
    /// What the modes beyond dense run with (none by default: dense only).
    pub resources: ModeResources,
    /// How reasoning is told from the answer, for `usage.completion_tokens_details.reasoning_tokens` (`None`: no
    /// reasoning counted). Prompts are not changed by it.
    pub reasoning: Option<engine::reasoning::ReasoningProfile>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            host: "127.0.0.1".into(),
            port: 8080,
            mode: None,
            parallel: 1,
            queue: 8,
            ctx: 4096,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kv_budget: None,
            prefix_cache: 4096,
            prefill_rows: DEFAULT_PREFILL_ROWS,
            tree_rows: DEFAULT_TREE_ROWS,
            body_limit: DEFAULT_BODY_LIMIT,
            model_id: "specee".into(),
            resources: ModeResources::default(),
            reasoning: None,
        }
    }
}

/// Serves `engine` until SIGTERM or ctrl-c, then drains in-flight requests and returns.
pub fn run(engine: engine::Engine, config: Config) -> Result<(), ServerError> {
    if config.parallel == 0 {
        return Err(ServerError::Config("--parallel must be at least 1".into()));
    }
    if config.ctx < 2 {
        return Err(ServerError::Config(format!("--ctx-size must be at least 2, got {}", config.ctx)));
    }
    if let Some(budget) = config.kv_budget.filter(|&b| b < config.ctx) {
        return Err(ServerError::Config(format!(
            "--kv-budget ({budget} tokens) must hold at least one context (--ctx-size {})",
            config.ctx
        )));
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(ServerError::Runtime)?;
    runtime.block_on(serve(engine, config))
}

async fn serve(engine: engine::Engine, config: Config) -> Result<(), ServerError> {
    let n_layers = engine.model.config.n_layers;
    let unavailable: Vec<(Mode, &'static str)> =
        Mode::ALL.iter().filter_map(|&m| config.resources.missing(m).map(|why| (m, why))).collect();
    if let Some((m, why)) = unavailable.iter().find(|(m, _)| Some(*m) == config.mode) {
        return Err(ServerError::Config(format!("--mode {} cannot run: {why}", m.name())));
    }
    let mode_label = match config.mode {
        Some(m) => m.name(),
        None if unavailable.iter().any(|(m, _)| *m == Mode::Eagle) => "auto (dense: no draft head)",
        None => "auto (eagle for greedy requests, dense for sampled ones)",
    };
    let defaults = RequestDefaults {
        mode: config.mode,
        vocab_size: engine.tokenizer.vocab_size(),
        unavailable,
        n_layers: engine.model.config.n_layers,
    };
    let metrics = Arc::new(Metrics::new(config.queue, config.parallel, n_layers));
    let scheduler_config = SchedulerConfig {
        parallel: config.parallel,
        queue: config.queue,
        ctx: config.ctx,
        threads_per_request: config.threads.max(1),
        reasoning: config.reasoning.clone().map(Arc::new),
        batch: (config.parallel > 1).then(|| batch::BatchConfig {
            parallel: config.parallel,
            threads: config.threads.max(1),
            kv_budget: config.kv_budget.unwrap_or(config.ctx * config.parallel),
            prefix_cache: config.prefix_cache,
            prefill_rows: config.prefill_rows.max(1),
            tree_rows: config.tree_rows,
        }),
        keep_cache: config.prefix_cache > 0,
    };
    let addr = format!("{}:{}", config.host, config.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind { addr: addr.clone(), source })?;
    let local = listener.local_addr().map_err(|source| ServerError::Bind { addr: addr.clone(), source })?;
    let resources = Arc::new(config.resources.clone());
    let scheduler = Scheduler::start(Arc::new(engine), resources, Arc::clone(&metrics), &scheduler_config)?;
    let state = Arc::new(AppState::new(scheduler, metrics, defaults, config.model_id.clone(), config.body_limit));
    if !local.ip().is_loopback() {
        eprintln!(
            "specee serve: warning: listening on {} — reachable from other machines; the API has no authentication",
            local.ip()
        );
    }
    match &scheduler_config.batch {
        Some(b) => eprintln!(
            "specee serve: model {}, batching {} requests (dense rows{}) on {} thread(s), queue {}, context {}, KV \
             budget {} tokens, prefix cache {} tokens",
            config.model_id,
            b.parallel,
            match (config.resources.draft.is_some(), b.tree_rows > 1) {
                (true, true) => format!("; greedy eagle requests draft trees, {} rows shared", b.tree_rows),
                (true, false) => "; a greedy eagle request alone drafts trees".to_string(),
                _ => String::new(),
            },
            b.threads,
            config.queue,
            config.ctx,
            b.kv_budget,
            b.prefix_cache
        ),
        None => eprintln!(
            "specee serve: model {}, mode {}, one request at a time on {} thread(s), queue {}, context {}",
            config.model_id, mode_label, scheduler_config.threads_per_request, config.queue, config.ctx
        ),
    }
    // Tests and scripts read the address from this line.
    println!("listening on http://{local}");
    let _ = std::io::stdout().flush();

    let app = routes::router(Arc::clone(&state));
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        // Streamed tokens should leave at once.
        let _ = tcp.set_nodelay(true);
    });
    let result = axum::serve(listener, app).with_graceful_shutdown(shutdown_signal(Arc::clone(&state))).await;
    state.scheduler.close();
    eprintln!("specee serve: stopped");
    result.map_err(ServerError::Serve)
}

/// Resolves on the first SIGTERM/ctrl-c (then refuses new generations); a second one exits the process.
async fn shutdown_signal(state: Arc<AppState>) {
    wait_for_signal().await;
    state.shutting_down.store(true, Ordering::Release);
    let busy = state.metrics.in_flight.load(Ordering::Acquire) + state.metrics.queued.load(Ordering::Acquire);
    eprintln!("specee serve: shutting down; finishing {busy} request(s) (signal again to stop at once)");
    tokio::spawn(async {
        wait_for_signal().await;
        eprintln!("specee serve: stopping at once");
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    ctrl_c().await;
}

/// Resolves on ctrl-c; never, if the handler cannot be installed (the server then runs until killed).
async fn ctrl_c() {
    if tokio::signal::ctrl_c().await.is_err() {
        std::future::pending::<()>().await;
    }
}
