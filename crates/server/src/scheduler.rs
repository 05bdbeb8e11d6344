//! Admission and generation: a bounded number of requests admitted (`--parallel` generating plus `--queue`
//! waiting; beyond that [`Scheduler::submit`] answers 429), and `--parallel` dedicated worker threads that
//! run the engine — generation never runs on the async executor.
//!
//! Each job carries a channel back to its handler; the worker sends [`Event::Started`] once the prompt is
//! rendered, tokenized and fits the context (or [`Event::Failed`]), then [`Event::Text`] pieces when
//! streaming, then [`Event::Done`]. A handler that goes away (the client disconnected) drops its receiver:
//! a queued job is then skipped, and a running one stops at its next token because the engine's `on_text`
//! callback returns `false`. A panic inside a generation is caught and answered with a 500.

use crate::error::{ApiError, ServerError};
use crate::holdback::Holdback;
use crate::metrics::{Metrics, Observe, Outcome};
use crate::mode::{DecodeStats, Mode, ModeResources};
use crate::request::{GenerationRequest, PromptInput};
use crate::wire::{CompletionTokensDetails, SpeceeInfo, Usage};
use engine::conversation::ChatDecoder;
use engine::{Engine, EngineError, FinishReason, GenerateParams};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// What a worker tells the handler waiting for a job.
#[derive(Debug)]
pub enum Event {
    /// The prompt fits; generation starts.
    Started { prompt_tokens: usize },
    /// Streamed text (only for streaming requests).
    Text(String),
    /// The tokens behind the next text (or the finish): how they were made (`stream_options.include_specee`)
    /// and their log probabilities (`logprobs`).
    Tokens(Vec<StreamedToken>),
    /// Generation finished.
    Done(Box<Finished>),
    /// The request failed (before or, for a 500, during generation).
    Failed(ApiError),
}

/// One streamed token: how it was made, and its log probabilities when the request asked for them.
#[derive(Debug)]
pub struct StreamedToken {
    pub info: crate::wire::TokenInfo,
    pub logprob: Option<crate::wire::TokenLogprob>,
}

/// A finished generation, as the handler answers it.
#[derive(Debug)]
pub struct Finished {
    pub text: String,
    /// The calls the answer made (`tools`); `text` is then what the model wrote around them.
    pub tool_calls: Option<Vec<crate::tools::ToolCall>>,
    /// One entry per answer token (`logprobs`).
    pub logprobs: Option<Vec<crate::wire::TokenLogprob>>,
    /// OpenAI's `finish_reason`: `stop` or `length`.
    pub finish_reason: &'static str,
    pub usage: Usage,
    pub info: SpeceeInfo,
}

/// A request waiting for a worker.
pub struct Job {
    pub request: GenerationRequest,
    pub events: UnboundedSender<Event>,
    /// When the server admitted it (queue wait and time to first token count from here).
    pub admitted_at: Instant,
}

/// Sizes of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests generated at once (more than one only when batching).
    pub parallel: usize,
    /// Requests that may wait beyond those.
    pub queue: usize,
    /// Context size, tokens.
    pub ctx: usize,
    /// Compute threads of each generation.
    pub threads_per_request: usize,
    /// Counts reasoning tokens in `usage` when set.
    pub reasoning: Option<Arc<engine::reasoning::ReasoningProfile>>,
    /// Batch every request into one shared forward ([`crate::batch`]) instead of one worker per request.
    pub batch: Option<crate::batch::BatchConfig>,
    /// Without batching: keep the last `dense` or `eagle` request's KV cache for the next one, which reuses the
    /// prompt prefix they share (a chat's next turn runs only its new tokens).
    pub keep_cache: bool,
}

/// What every generation path (the per-request workers and the batching scheduler) shares: the engine, the
/// metrics, the limits, and how a request is turned into tokens and its answer sent back.
pub(crate) struct Shared {
    pub(crate) engine: Arc<Engine>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) ctx: usize,
    pub(crate) n_layers: usize,
    pub(crate) reasoning: Option<Arc<engine::reasoning::ReasoningProfile>>,
    /// Jobs admitted and not yet finished (queued + running).
    pub(crate) admitted: Arc<AtomicUsize>,
}

struct Worker {
    shared: Arc<Shared>,
    resources: Arc<ModeResources>,
    threads: usize,
    keep_cache: bool,
}

/// The decoder of the last request, kept for the next ([`SchedulerConfig::keep_cache`]).
struct Kept<'e> {
    mode: Mode,
    sampling: decode::SamplingParams,
    decoder: ChatDecoder<'e>,
}

/// The queue and its workers.
pub struct Scheduler {
    sender: Mutex<Option<mpsc::Sender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    admitted: Arc<AtomicUsize>,
    limit: usize,
    metrics: Arc<Metrics>,
}

impl Scheduler {
    /// Starts `config.parallel` worker threads.
    pub fn start(
        engine: Arc<Engine>,
        resources: Arc<ModeResources>,
        metrics: Arc<Metrics>,
        config: &SchedulerConfig,
    ) -> Result<Scheduler, ServerError> {
        let (sender, receiver) = mpsc::channel::<Job>();
        let receiver = Mutex::new(receiver);
        let admitted = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            n_layers: engine.model.config.n_layers,
            engine,
            metrics: Arc::clone(&metrics),
            ctx: config.ctx,
            reasoning: config.reasoning.clone(),
            admitted: Arc::clone(&admitted),
        });
        // Batching: one thread runs every request. Otherwise (`--parallel 1`) one worker runs them one at a time.
        let (name, run): (String, Box<dyn FnOnce() + Send>) = match &config.batch {
            Some(batch) => {
                let batcher = crate::batch::Batcher::new(Arc::clone(&shared), batch.clone(), &resources);
                ("specee-batch".into(), Box::new(move || batcher.run(&receiver)))
            }
            None => {
                let threads = config.threads_per_request.max(1);
                let worker = Worker { shared, resources, threads, keep_cache: config.keep_cache };
                ("specee-generate".into(), Box::new(move || worker.run(&receiver)))
            }
        };
        let handle = std::thread::Builder::new()
            .name(name.clone())
            .spawn(run)
            .map_err(|e| ServerError::Config(format!("cannot start the generation thread {name}: {e}")))?;
        let workers = vec![handle];
        Ok(Scheduler {
            sender: Mutex::new(Some(sender)),
            workers: Mutex::new(workers),
            admitted,
            limit: config.parallel.max(1) + config.queue,
            metrics,
        })
    }

    /// Queues a job, or answers 429 when `parallel + queue` jobs are already admitted (503 once closed).
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let admitted =
            self.admitted.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.limit).then_some(n + 1));
        if admitted.is_err() {
            return Err(ApiError::overloaded(
                format!("the server is busy ({} requests generating or queued); retry shortly", self.limit),
                1,
            ));
        }
        self.metrics.queued.fetch_add(1, Ordering::AcqRel);
        let sent = self.sender.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|s| s.send(job).is_ok());
        match sent {
            Some(true) => Ok(()),
            _ => {
                self.metrics.queued.fetch_sub(1, Ordering::AcqRel);
                self.admitted.fetch_sub(1, Ordering::AcqRel);
                Err(ApiError::shutting_down())
            }
        }
    }

    /// Stops taking jobs, lets the workers finish the queued ones, and waits for them.
    pub fn close(&self) {
        self.sender.lock().unwrap_or_else(|p| p.into_inner()).take();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }
}

impl Worker {
    fn run(self, receiver: &Mutex<mpsc::Receiver<Job>>) {
        let metrics = &self.shared.metrics;
        let engine = Arc::clone(&self.shared.engine);
        let mut kept: Option<Kept<'_>> = None;
        loop {
            let job = {
                let rx = receiver.lock().unwrap_or_else(|p| p.into_inner());
                match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                }
            };
            metrics.queued.fetch_sub(1, Ordering::AcqRel);
            metrics.in_flight.fetch_add(1, Ordering::AcqRel);
            metrics.observe(Observe::QueueWait, job.admitted_at.elapsed().as_secs_f64());
            self.run_job(&engine, job, &mut kept);
            // Free the slot before the gauge says so, so that a client seeing 0 in flight can be admitted.
            self.shared.admitted.fetch_sub(1, Ordering::AcqRel);
            metrics.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn run_job<'e>(&self, engine: &'e Engine, job: Job, kept: &mut Option<Kept<'e>>) {
        let Job { request, events, admitted_at } = job;
        if events.is_closed() {
            // The client left while the job was queued.
            self.shared.record_cancelled(request.mode);
            return;
        }
        let result = catch_unwind(AssertUnwindSafe(|| self.generate(engine, &request, &events, admitted_at, kept)));
        if let Err(error) = result.map_err(panic_error).and_then(|r| r) {
            self.shared.fail(&request, &events, error);
        }
    }

    fn generate<'e>(
        &self,
        engine: &'e Engine,
        request: &GenerationRequest,
        events: &UnboundedSender<Event>,
        admitted_at: Instant,
        kept: &mut Option<Kept<'e>>,
    ) -> Result<(), ApiError> {
        let shared = &*self.shared;
        let (prompt_ids, params) = shared.prepare(request)?;
        if events.send(Event::Started { prompt_tokens: prompt_ids.len() }).is_err() {
            shared.record_cancelled(request.mode);
            return Ok(());
        }
        let mut holdback = Holdback::for_request(request);
        let mut first_piece = true;
        let on_text = |piece: &str| {
            if first_piece {
                first_piece = false;
                shared.metrics.observe(Observe::FirstToken, admitted_at.elapsed().as_secs_f64());
            }
            stream_piece(request, events, &mut holdback, &engine.tokenizer, piece)
        };
        let (ctx, threads, n_layers) = (shared.ctx, self.threads, shared.n_layers);
        // Requests only name modes whose resources are loaded (checked when parsed).
        let unavailable = |mode: Mode| ApiError::internal(format!("mode {} has nothing loaded", mode.name()));
        let (generation, stats) = match request.mode {
            // With a kept cache: the decoder of the last request when it can continue (the same mode; for eagle,
            // greedy with the same settings), else a new one; taken out while it runs, so that a failure or a
            // panic drops it.
            mode @ (Mode::Dense | Mode::Eagle) if self.keep_cache => {
                // Greedy decoding draws no random numbers: the seed does not matter.
                let unseeded = |s: &decode::SamplingParams| decode::SamplingParams { seed: 0, ..s.clone() };
                let reusable = |k: &Kept<'_>| {
                    k.mode == mode
                        && (mode == Mode::Dense
                            || (params.sampling.is_greedy() && unseeded(&k.sampling) == unseeded(&params.sampling)))
                };
                let mut decoder = match kept.take() {
                    Some(k) if reusable(&k) => k.decoder,
                    _ if mode == Mode::Dense => ChatDecoder::dense(engine, ctx, threads),
                    _ => {
                        let head = Arc::clone(self.resources.draft.as_ref().ok_or_else(|| unavailable(Mode::Eagle))?);
                        let datastore = self.resources.datastore.clone();
                        let proposer = engine::speculative::AnyProposer::eagle(head, None, datastore);
                        ChatDecoder::tree(engine, ctx, threads, proposer, &params)
                    }
                };
                let turn = decoder.continue_with(engine, prompt_ids, &params, on_text)?;
                shared.metrics.record_prefix_lookup(turn.reused_tokens);
                *kept = Some(Kept { mode, sampling: params.sampling.clone(), decoder });
                let g = turn.generation;
                let mut stats = DecodeStats::dense(&g, n_layers);
                if mode == Mode::Eagle {
                    stats.steps = turn.target_forwards as u64;
                    stats.tree = self.resources.eagle_tree();
                }
                (g, stats)
            }
            Mode::Dense => {
                let g = engine.generate(&prompt_ids, &params, ctx, threads, on_text)?;
                let stats = DecodeStats::dense(&g, n_layers);
                (g, stats)
            }
            Mode::Eagle => {
                let head = Arc::clone(self.resources.draft.as_ref().ok_or_else(|| unavailable(Mode::Eagle))?);
                let proposer = engine::speculative::AnyProposer::eagle(head, None, self.resources.datastore.clone());
                let tree = proposer.tree();
                let (g, s) = engine.generate_speculative(&prompt_ids, &params, ctx, threads, proposer, on_text)?;
                let tokens = g.generated_ids.len() as u64;
                let stats =
                    DecodeStats { tokens, layers: tokens * n_layers as u64, steps: s.target_forwards as u64, tree };
                (g, stats)
            }
            Mode::Specee => {
                let setup = self.resources.specee.as_ref().ok_or_else(|| unavailable(Mode::Specee))?;
                let (g, s) = engine.generate_specee(&prompt_ids, &params, ctx, threads, setup, on_text)?;
                let tokens = g.generated_ids.len() as u64;
                // Layers per decoded token, scaled to the generated tokens (the first comes from the prompt pass).
                let layers = if s.tokens > 0 { s.layers as u64 * tokens / s.tokens as u64 } else { 0 };
                (g, DecodeStats { tokens, layers, steps: tokens, tree: None })
            }
            Mode::SpeceeEagle => {
                let setup = self.resources.specee.as_ref().ok_or_else(|| unavailable(Mode::SpeceeEagle))?;
                let (g, s) = engine.generate_merged(&prompt_ids, &params, ctx, threads, setup, on_text)?;
                let tokens = g.generated_ids.len() as u64;
                // A tree forward runs all its rows to the same depth: each token committed by it counts that depth.
                let forwards = s.speculative.target_forwards as u64;
                let layers = (s.layers as u64 * tokens).checked_div(forwards).unwrap_or(0);
                (g, DecodeStats { tokens, layers, steps: forwards, tree: Some(setup.merged_tree()) })
            }
        };
        shared.answer(request, events, request.mode, generation, stats, &holdback);
        Ok(())
    }
}

/// A panic caught around a generation, as the 500 it is answered with.
pub(crate) fn panic_error(panic: Box<dyn std::any::Any + Send>) -> ApiError {
    let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
    ApiError::internal(format!("generation failed: {}", what.unwrap_or_else(|| "panic".into())))
}

/// Sends a streamed piece of text (what the stop strings no longer hold back); `false` once the client left.
pub(crate) fn stream_piece(
    request: &GenerationRequest,
    events: &UnboundedSender<Event>,
    holdback: &mut Holdback,
    tokenizer: &tokenizer::Tokenizer,
    piece: &str,
) -> bool {
    if !request.stream {
        return !events.is_closed();
    }
    send_tokens(request, events, tokenizer);
    let ready = holdback.push(piece);
    if ready.is_empty() {
        !events.is_closed()
    } else {
        events.send(Event::Text(ready.to_string())).is_ok()
    }
}

/// `a / b`, 0 when `b` is 0.
fn ratio(a: u64, b: u64) -> f64 {
    if b > 0 {
        a as f64 / b as f64
    } else {
        0.0
    }
}

/// Sends the token traces collected since the last call (`stream_options.include_specee`, `logprobs`).
fn send_tokens(request: &GenerationRequest, events: &UnboundedSender<Event>, tokenizer: &tokenizer::Tokenizer) {
    if let Some(sink) = &request.trace {
        let tokens: Vec<_> = std::mem::take(&mut *sink.lock().unwrap_or_else(|p| p.into_inner()));
        if !tokens.is_empty() {
            let tokens = tokens
                .into_iter()
                .map(|mut t| StreamedToken {
                    logprob: t.logprobs.take().map(|e| wire_logprob(tokenizer, &e)),
                    info: t.into(),
                })
                .collect();
            let _ = events.send(Event::Tokens(tokens));
        }
    }
}

/// A token's log probabilities as the API gives them: texts and bytes of the token and its alternatives.
pub(crate) fn wire_logprob(tokenizer: &tokenizer::Tokenizer, e: &engine::TokenLogprobs) -> crate::wire::TokenLogprob {
    let text = |t: u32| {
        let bytes = tokenizer.token_bytes(t).to_vec();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    };
    let (token, bytes) = text(e.token);
    let top_logprobs = e
        .top
        .iter()
        .map(|&(t, logprob)| {
            let (token, bytes) = text(t);
            crate::wire::TopLogprob { token, logprob, bytes }
        })
        .collect();
    crate::wire::TokenLogprob { token, logprob: e.logprob, bytes, top_logprobs }
}

impl Shared {
    /// The request's prompt as token ids (chat rendered with the template) and its generation settings; a 400
    /// when the prompt is empty or does not fit the context.
    pub(crate) fn prepare(&self, request: &GenerationRequest) -> Result<(Vec<u32>, GenerateParams), ApiError> {
        let engine = &*self.engine;
        let tools = request.tools.as_ref();
        if tools.is_some() && !engine.chat_template_supports_tools() {
            let why = "this model's chat template has no tools section, so it cannot be given tools";
            return Err(ApiError::invalid_param("tools", why));
        }
        let prompt_ids = match &request.input {
            PromptInput::Chat(messages) => {
                engine.tokenize_prompt(&engine.render_chat_with_tools(messages, tools.map(|t| &t.spec))?)
            }
            PromptInput::Text(text) => engine.tokenize_prompt(text),
            PromptInput::Tokens(ids) => ids.clone(),
        };
        if prompt_ids.is_empty() {
            return Err(EngineError::EmptyPrompt.into());
        }
        if prompt_ids.len() >= self.ctx {
            return Err(EngineError::PromptTooLong { prompt: prompt_ids.len(), ctx: self.ctx }.into());
        }
        // A forced tool call is a grammar: the tags as the vocabulary's own tokens where it has them.
        let tag = |t: &str| match engine.tokenizer.token_id(t) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(t).unwrap_or_default(),
        };
        let forced = tools.and_then(|t| t.grammar(&tag(crate::tools::CALL_OPEN), &tag(crate::tools::CALL_CLOSE)));
        let grammar = forced.map(engine::constraint::GrammarSpec::Lark).or_else(|| request.grammar.clone());
        // A schema or grammar that cannot compile is the request's fault: a 400 before anything streams.
        if let Some(spec) = &grammar {
            engine.constraint(spec).map_err(|e| {
                let param = match spec {
                    _ if tools.is_some() => "tools",
                    engine::constraint::GrammarSpec::JsonSchema(_) => "response_format",
                    engine::constraint::GrammarSpec::Lark(_) => "specee.grammar",
                };
                ApiError::invalid_param(param, format!("{param} cannot be used: {e}"))
            })?;
        }
        let room = self.ctx - prompt_ids.len();
        let params = GenerateParams {
            max_tokens: request.max_tokens.map_or(room, |m| m.min(room)),
            sampling: request.sampling.clone(),
            stop_at_eog: request.stop_at_eog,
            stop: request.stop.clone(),
            trace: request.trace.clone(),
            grammar,
            logprobs: request.logprobs,
            jump_forward: request.jump_forward,
        };
        Ok((prompt_ids, params))
    }

    /// Counts a generation the client abandoned before it produced anything.
    pub(crate) fn record_cancelled(&self, mode: Mode) {
        self.metrics.record_generation(mode, Outcome::Cancelled, 0, DecodeStats::default(), None);
    }

    /// Answers a failed request (a 500 is also logged and counted).
    pub(crate) fn fail(&self, request: &GenerationRequest, events: &UnboundedSender<Event>, error: ApiError) {
        if error.status.is_server_error() {
            eprintln!("specee serve: {error}");
            self.metrics.record_generation(request.mode, Outcome::Error, 0, DecodeStats::default(), None);
        }
        let _ = events.send(Event::Failed(error));
    }

    /// Records a finished generation (run in `mode`) and sends its answer: the rest of a streamed text, then
    /// [`Event::Done`]; nothing when the client cancelled it.
    pub(crate) fn answer(
        &self,
        request: &GenerationRequest,
        events: &UnboundedSender<Event>,
        mode: Mode,
        generation: engine::Generation,
        stats: DecodeStats,
        holdback: &Holdback,
    ) {
        let prompt_tokens = generation.prompt_ids.len();
        let timings = generation.timings;
        let (outcome, mut finish_reason) = match generation.finish {
            FinishReason::Stop => (Outcome::Stop, "stop"),
            // OpenAI's API says `length` for both.
            FinishReason::Length | FinishReason::ContextFull => (Outcome::Length, "length"),
            FinishReason::Cancelled => (Outcome::Cancelled, ""),
        };
        let speed = (timings.decode_tokens > 1).then(|| timings.decode_tokens_per_s());
        self.metrics.record_generation(mode, outcome, prompt_tokens, stats, speed);
        if outcome == Outcome::Cancelled {
            return;
        }
        // Tool calls in the answer: the text around them is the content.
        let mut text = generation.text;
        let mut tool_calls = None;
        if let Some((content, mut calls)) = request.tools.as_ref().and_then(|t| t.parse_calls(&text)) {
            for c in calls.iter_mut() {
                c.id = crate::tools::next_call_id();
            }
            text = content;
            tool_calls = Some(calls);
            finish_reason = "tool_calls";
        }
        if request.stream {
            send_tokens(request, events, &self.engine.tokenizer);
            let rest = holdback.finish(&text);
            if !rest.is_empty() {
                let _ = events.send(Event::Text(rest.to_string()));
            }
        }
        let completion_tokens = generation.generated_ids.len();
        let completion_tokens_details = self.reasoning.as_ref().map(|p| CompletionTokensDetails {
            reasoning_tokens: p.split(&self.engine, &generation.generated_ids).reasoning_tokens,
        });
        let logprobs = generation.logprobs.map(|l| l.iter().map(|e| wire_logprob(&self.engine.tokenizer, e)).collect());
        let finished = Finished {
            logprobs,
            tool_calls,
            text,
            finish_reason,
            usage: Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
                completion_tokens_details,
            },
            info: SpeceeInfo {
                mode: mode.name(),
                prompt_tokens_per_second: timings.prompt_tokens_per_s(),
                decode_tokens_per_second: timings.decode_tokens_per_s(),
                acceptance_length: ratio(stats.tokens, stats.steps),
                layers_per_token: ratio(stats.layers, stats.tokens),
                n_layers: self.n_layers,
                tree: stats.tree.map(|t| t.to_string()),
            },
        };
        let _ = events.send(Event::Done(Box::new(finished)));
    }
}
