//! HTTP routes: the OpenAI endpoints (`/v1/models/{id}` too), `/health` and `/metrics`, JSON errors for unknown routes, wrong
//! methods and oversized bodies, and server-sent events for `stream: true`.
//!
//! A generation request is parsed and checked ([`crate::request`]), submitted to the [`Scheduler`] (429 when
//! full), and answered once the worker reports that the prompt fits — so a prompt that is too long is a 400
//! even when streaming. A streamed response is an SSE stream of OpenAI chunks ending with `data: [DONE]`;
//! when the client goes away the stream is dropped, which cancels the generation.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{self, GenerationRequest, RequestDefaults};
use crate::scheduler::{Event, Finished, Job, Scheduler};
use crate::wire;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What every handler shares.
pub struct AppState {
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    pub defaults: RequestDefaults,
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    /// When the server started (Unix seconds).
    pub created: u64,
    /// Body size limit, bytes.
    pub body_limit: usize,
    /// Set on SIGTERM/ctrl-c: new generations are refused with 503 while in-flight ones finish.
    pub shutting_down: AtomicBool,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        scheduler: Scheduler,
        metrics: Arc<Metrics>,
        defaults: RequestDefaults,
        model_id: String,
        body_limit: usize,
    ) -> AppState {
        AppState {
            scheduler,
            metrics,
            defaults,
            model_id,
            created: unix_now(),
            body_limit,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
        }
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.created)
    }
}

/// The router with every route, the body limit and the request counter.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(chat_page))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.body_limit))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count_requests))
        .with_state(state)
}

/// The `endpoint` label of a path (unknown paths share one label, so clients cannot grow the metrics).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/" => "/",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let endpoint = endpoint_label(request.uri().path());
    // A body declared larger than the limit is answered at once, before a byte of it is read (the body limit
    // alone would wait for the first `body_limit` bytes, which a client declaring 1 GB may never send).
    let declared = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let response = if declared.is_some_and(|n| n > state.body_limit as u64) {
        too_large(&state).into_response()
    } else {
        next.run(request).await
    };
    state.metrics.record_request(endpoint, response.status().as_u16());
    response
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!("no route for {} {}", request.method(), request.uri().path()))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::method_not_allowed(format!("{} is not allowed on {}", request.method(), request.uri().path()))
}

/// The chat page: one self-contained file (its script and styles inline; nothing fetched from elsewhere).
async fn chat_page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("chat.html")).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.shutting_down.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "shutting_down"})))
            .into_response();
    }
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], state.metrics.render()).into_response()
}

fn model_card(state: &AppState) -> wire::ModelCard {
    let d = &state.defaults;
    let modes = crate::mode::Mode::ALL.iter().filter(|m| !d.unavailable.iter().any(|(u, _)| u == *m));
    wire::ModelCard {
        id: state.model_id.clone(),
        object: "model",
        created: state.created,
        owned_by: "specee",
        specee: wire::ModelExtras { modes: modes.map(|m| m.name()).collect(), n_layers: d.n_layers },
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(wire::ModelList { object: "list", data: vec![model_card(&state)] }).into_response()
}

async fn model(State(state): State<Arc<AppState>>, id: Result<Path<String>, PathRejection>) -> Response {
    let id = match id {
        Ok(Path(id)) => id,
        Err(e) => {
            return ApiError::invalid(format!("bad model id in the path: {}", e.body_text()))
                .with_status(e.status())
                .into_response()
        }
    };
    if id != state.model_id {
        return ApiError::not_found(format!(
            "model '{id}' is not served here (this server serves '{}')",
            state.model_id
        ))
        .with_param("model")
        .with_code("model_not_found")
        .into_response();
    }
    axum::Json(model_card(&state)).into_response()
}

fn too_large(state: &AppState) -> ApiError {
    ApiError::invalid(format!("the request body is larger than the {} bytes this server accepts", state.body_limit))
        .with_status(StatusCode::PAYLOAD_TOO_LARGE)
        .with_code("request_too_large")
}

fn body_error(state: &AppState, rejection: BytesRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        too_large(state)
    } else {
        ApiError::invalid(format!("cannot read the request body: {}", rejection.body_text()))
            .with_status(rejection.status())
    }
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let parsed = body
        .map_err(|r| body_error(&state, r))
        .and_then(|bytes| request::parse_body::<wire::ChatCompletionRequest>(&bytes))
        .and_then(|r| request::chat_request(r, &state.defaults));
    match parsed {
        Ok(r) => generate(state, r, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let parsed = body
        .map_err(|r| body_error(&state, r))
        .and_then(|bytes| request::parse_body::<wire::CompletionRequest>(&bytes))
        .and_then(|r| request::completion_request(r, &state.defaults));
    match parsed {
        Ok(r) => generate(state, r, Kind::Completion).await,
        Err(e) => e.into_response(),
    }
}

/// Which endpoint's response shapes to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn generate(state: Arc<AppState>, request: GenerationRequest, kind: Kind) -> Response {
    if state.shutting_down.load(Ordering::Acquire) {
        return ApiError::shutting_down().into_response();
    }
    let stream = request.stream;
    let include_usage = request.include_usage;
    let include_specee = request.include_specee;
    let logprobs = request.logprobs.is_some();
    let (events, mut rx) = unbounded_channel();
    if let Err(e) = state.scheduler.submit(Job { request, events, admitted_at: std::time::Instant::now() }) {
        return e.into_response();
    }
    // Wait until the worker has checked the prompt: errors before generation are plain JSON errors.
    match rx.recv().await {
        Some(Event::Started { .. }) => {}
        Some(Event::Failed(e)) => return e.into_response(),
        _ => return ApiError::internal("the generation ended before it started").into_response(),
    }
    let chunks = Chunks {
        kind,
        id: state.new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: unix_now(),
        model: state.model_id.clone(),
    };
    if stream {
        return stream_response(chunks, rx, StreamFlags { include_usage, include_specee, logprobs });
    }
    loop {
        match rx.recv().await {
            Some(Event::Done(f)) => return chunks.full_response(*f),
            Some(Event::Failed(e)) => return e.into_response(),
            Some(Event::Started { .. } | Event::Text(_) | Event::Tokens(_)) => {}
            None => return ApiError::internal("the generation ended without a result").into_response(),
        }
    }
}

/// Builds response bodies of one request.
struct Chunks {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Chunks {
    fn full_response(&self, f: Finished) -> Response {
        let logprobs = f.logprobs;
        match self.kind {
            Kind::Chat => axum::Json(wire::ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![wire::ChatChoice {
                    index: 0,
                    message: wire::AssistantMessage {
                        role: "assistant",
                        // Only tool calls: `content` is null, as OpenAI answers.
                        content: (f.tool_calls.is_none() || !f.text.is_empty()).then_some(f.text),
                        tool_calls: f.tool_calls,
                    },
                    logprobs: logprobs.map(|content| wire::ChatLogprobs { content, refusal: None }),
                    finish_reason: f.finish_reason,
                }],
                usage: f.usage,
                specee: f.info,
            })
            .into_response(),
            Kind::Completion => axum::Json(wire::Completion {
                id: self.id.clone(),
                object: "text_completion",
                created: self.created,
                model: self.model.clone(),
                choices: vec![wire::CompletionChoice {
                    text: f.text,
                    index: 0,
                    logprobs: logprobs.map(|l| wire::CompletionLogprobs::from_entries(l, 0).0),
                    finish_reason: Some(f.finish_reason),
                }],
                usage: Some(f.usage),
                specee: Some(f.info),
            })
            .into_response(),
        }
    }

    /// One streamed chunk: text and/or a finish reason (chat: `role` on the first).
    fn chunk(&self, role: bool, text: Option<String>, finish_reason: Option<&'static str>) -> SseEvent {
        self.chunk_with(role, text, finish_reason, None, None)
    }

    /// [`Chunks::chunk`] with the log probabilities of its tokens (`logprobs`; completions: with the character
    /// offset of the first) and specee's stream extension (chat only).
    fn chunk_with(
        &self,
        role: bool,
        text: Option<String>,
        finish_reason: Option<&'static str>,
        logprobs: Option<(Vec<wire::TokenLogprob>, &mut usize)>,
        specee: Option<wire::StreamSpecee>,
    ) -> SseEvent {
        match self.kind {
            Kind::Chat => self.chat_chunk(
                wire::Delta { role: role.then_some("assistant"), content: text, tool_calls: None },
                logprobs.map(|(content, _)| wire::ChatLogprobs { content, refusal: None }),
                finish_reason,
                specee,
            ),
            Kind::Completion => json_event(&self.completion_chunk(vec![wire::CompletionChoice {
                text: text.unwrap_or_default(),
                index: 0,
                logprobs: logprobs.map(|(entries, offset)| {
                    let (l, next) = wire::CompletionLogprobs::from_entries(entries, *offset);
                    *offset = next;
                    l
                }),
                finish_reason,
            }])),
        }
    }

    /// A chat chunk whose delta is the answer's tool calls.
    fn tool_calls_chunk(&self, calls: Vec<wire::DeltaToolCall>) -> SseEvent {
        self.chat_chunk(wire::Delta { role: None, content: None, tool_calls: Some(calls) }, None, None, None)
    }

    /// One `chat.completion.chunk` event of this stream.
    fn chat_chunk(
        &self,
        delta: wire::Delta,
        logprobs: Option<wire::ChatLogprobs>,
        finish_reason: Option<&'static str>,
        specee: Option<wire::StreamSpecee>,
    ) -> SseEvent {
        json_event(&wire::ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![wire::ChunkChoice { index: 0, delta, logprobs, finish_reason }],
            usage: None,
            specee,
        })
    }

    fn completion_chunk(&self, choices: Vec<wire::CompletionChoice>) -> wire::Completion {
        wire::Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage: None,
            specee: None,
        }
    }

    /// The last chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self, usage: wire::Usage) -> SseEvent {
        match self.kind {
            Kind::Chat => json_event(&wire::ChatCompletionChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk",
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
                specee: None,
            }),
            Kind::Completion => {
                json_event(&wire::Completion { usage: Some(usage), ..self.completion_chunk(Vec::new()) })
            }
        }
    }
}

fn json_event<T: Serialize>(value: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_string()))
}

/// What a stream's chunks carry beyond the text.
#[derive(Clone, Copy, Debug)]
struct StreamFlags {
    include_usage: bool,
    include_specee: bool,
    logprobs: bool,
}

/// State of one SSE stream: events ready to send, and the worker's channel.
struct SseState {
    chunks: Chunks,
    rx: UnboundedReceiver<Event>,
    pending: VecDeque<SseEvent>,
    flags: StreamFlags,
    finished: bool,
    /// Tokens waiting for the next text chunk (`stream_options.include_specee`, `logprobs`).
    tokens: Vec<crate::scheduler::StreamedToken>,
    /// Characters of the completion the earlier chunks' log probabilities covered (completions' `text_offset`).
    offset: usize,
}

/// The tokens waiting for a chunk, split into its `logprobs` entries (with the completion's character offset,
/// which they advance) and specee's stream extension (`summary` on the finishing chunk).
#[allow(clippy::type_complexity)]
fn take_tokens<'o>(
    tokens: &mut Vec<crate::scheduler::StreamedToken>,
    flags: StreamFlags,
    offset: &'o mut usize,
    summary: Option<wire::SpeceeInfo>,
) -> (Option<(Vec<wire::TokenLogprob>, &'o mut usize)>, Option<wire::StreamSpecee>) {
    let (mut infos, mut entries) = (Vec::new(), Vec::new());
    for t in tokens.drain(..) {
        infos.push(t.info);
        entries.extend(t.logprob);
    }
    let specee = (flags.include_specee && (!infos.is_empty() || summary.is_some()))
        .then(|| wire::StreamSpecee { tokens: infos, summary });
    let logprobs = (flags.logprobs && !entries.is_empty()).then_some((entries, offset));
    (logprobs, specee)
}

fn stream_response(chunks: Chunks, rx: UnboundedReceiver<Event>, flags: StreamFlags) -> Response {
    let mut pending = VecDeque::new();
    if chunks.kind == Kind::Chat {
        pending.push_back(chunks.chunk(true, Some(String::new()), None));
    }
    let state = SseState { chunks, rx, pending, flags, finished: false, tokens: Vec::new(), offset: 0 };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event), s));
            }
            if s.finished {
                return None;
            }
            match s.rx.recv().await {
                Some(Event::Tokens(tokens)) => s.tokens.extend(tokens),
                Some(Event::Text(text)) => {
                    let (logprobs, specee) = take_tokens(&mut s.tokens, s.flags, &mut s.offset, None);
                    let event = s.chunks.chunk_with(false, Some(text), None, logprobs, specee);
                    s.pending.push_back(event);
                }
                Some(Event::Done(mut f)) => {
                    if let Some(calls) = f.tool_calls.take() {
                        // The calls, whole, in one delta before the finishing chunk.
                        let calls =
                            calls.into_iter().enumerate().map(|(index, call)| wire::DeltaToolCall { index, call });
                        s.pending.push_back(s.chunks.tool_calls_chunk(calls.collect()));
                    }
                    let empty = (s.chunks.kind == Kind::Completion).then(String::new);
                    let summary = Some(f.info.clone());
                    let (logprobs, specee) = take_tokens(&mut s.tokens, s.flags, &mut s.offset, summary);
                    let event = s.chunks.chunk_with(false, empty, Some(f.finish_reason), logprobs, specee);
                    s.pending.push_back(event);
                    if s.flags.include_usage {
                        s.pending.push_back(s.chunks.usage_chunk(f.usage));
                    }
                    s.pending.push_back(SseEvent::default().data("[DONE]"));
                    s.finished = true;
                }
                Some(Event::Failed(e)) => {
                    // Headers are sent already: report the error in the stream and end it without [DONE].
                    s.pending.push_back(json_event(&e.body()));
                    s.finished = true;
                }
                Some(Event::Started { .. }) => {}
                None => s.finished = true,
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(10))).into_response()
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
