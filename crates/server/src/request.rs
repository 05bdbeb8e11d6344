//! From an OpenAI request body to what the engine runs: parse the JSON (errors name the field at fault),
//! check every value, refuse what is not supported with a 400 (`n > 1`, tools, unknown fields), and fill in defaults.
//!
//! Defaults: OpenAI's where OpenAI's API has the field — `temperature` 1.0, `top_p` 1.0, a random `seed`,
//! `max_tokens` 16 for completions and "until the context is full" for chat — and llama.cpp's for the
//! samplers OpenAI lacks (`top_k` 40, `min_p` 0.05, no repetition penalty), which the `specee` extension
//! object can change. `max_tokens` above what the context leaves is capped to it, not refused.

use crate::error::ApiError;
use crate::mode::Mode;
use crate::wire::{self, MessageContent, Prompt, SpeceeOptions, Stop};
use decode::SamplingParams;
use engine::constraint::GrammarSpec;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use tokenizer::chat::Message;

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 1024;
/// Default `max_tokens` of the completions endpoint (OpenAI's).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// What the model should read.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    /// A conversation, rendered with the model's chat template (assistant turn opened).
    Chat(Vec<Message>),
    /// Raw text, tokenized as `specee generate` does (BOS as the model asks, special tokens parsed).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// A validated generation request.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    pub input: PromptInput,
    /// New tokens at most; `None` = until the context is full. Capped to the context later.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_at_eog: bool,
    pub mode: Mode,
    pub stream: bool,
    /// Streaming: send a last chunk with `usage`.
    pub include_usage: bool,
    /// Streaming: each token's trace (where it came from, its log probabilities) is collected here and sent with
    /// the chunks (`stream_options.include_specee`, `logprobs`).
    pub trace: Option<engine::TraceSink>,
    /// Streaming (chat): chunks carry `specee.tokens` (`stream_options.include_specee`).
    pub include_specee: bool,
    /// Log probabilities with this many alternatives per token (`logprobs`, `top_logprobs`).
    pub logprobs: Option<usize>,
    /// Functions the model may call (chat `tools`, `tool_choice` not `none`).
    pub tools: Option<crate::tools::Tools>,
    /// A grammar the output must follow (`response_format`, `specee.grammar`).
    pub grammar: Option<GrammarSpec>,
    /// Jump-forward under the grammar in dense decoding (`specee.jump_forward`; see [`engine::JumpForward`]).
    pub jump_forward: engine::JumpForward,
}

/// Server-wide settings requests fall back on.
#[derive(Clone, Debug)]
pub struct RequestDefaults {
    /// The mode of requests that do not choose one; `None` ("auto"): eagle for greedy requests when the server
    /// can run it (the same tokens as dense, sooner), dense otherwise.
    pub mode: Option<Mode>,
    /// Largest valid token id + 1.
    pub vocab_size: usize,
    /// Modes this server cannot run, with the reason (see [`crate::mode::ModeResources::missing`]).
    pub unavailable: Vec<(Mode, &'static str)>,
    /// The model's depth (what `/v1/models` and the chat page show layers against).
    pub n_layers: usize,
}

impl RequestDefaults {
    /// The "auto" mode's choice for a request sampling with `sampling` ([`engine::speculative::auto_runs_eagle`]).
    pub fn auto(&self, sampling: &SamplingParams) -> Mode {
        let head = !self.unavailable.iter().any(|(m, _)| *m == Mode::Eagle);
        if engine::speculative::auto_runs_eagle(head, sampling) {
            Mode::Eagle
        } else {
            Mode::Dense
        }
    }
}

/// Parses a JSON body into `T`; syntax and type errors become 400s naming the field.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            ApiError::invalid(inner)
        } else {
            ApiError::invalid_param(path.clone(), format!("invalid '{path}': {inner}"))
        }
    })
}

/// Validates a chat request.
pub fn chat_request(
    mut r: wire::ChatCompletionRequest,
    defaults: &RequestDefaults,
) -> Result<GenerationRequest, ApiError> {
    let response_format = r.extra.remove("response_format");
    check_extra_fields(&r.extra, "")?;
    check_n(r.n)?;
    if r.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "'messages' must hold at least one message"));
    }
    if r.messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid_param(
            "messages",
            format!("'messages' holds {} messages; at most {MAX_MESSAGES} are accepted", r.messages.len()),
        ));
    }
    let messages =
        r.messages.into_iter().enumerate().map(|(i, m)| chat_message(i, m)).collect::<Result<Vec<_>, _>>()?;
    if r.max_tokens.is_some() && r.max_completion_tokens.is_some() {
        return Err(ApiError::invalid_param(
            "max_completion_tokens",
            "give 'max_tokens' or 'max_completion_tokens', not both",
        ));
    }
    let (max_name, max_value) = match r.max_completion_tokens {
        Some(v) => ("max_completion_tokens", Some(v)),
        None => ("max_tokens", r.max_tokens),
    };
    let common = Common {
        max_tokens: max_tokens(max_name, max_value)?,
        temperature: r.temperature,
        top_p: r.top_p,
        seed: r.seed,
        stop: r.stop,
        stream: r.stream,
        stream_options: r.stream_options,
        specee: r.specee,
        response_format,
        logprobs: chat_logprobs(r.logprobs, r.top_logprobs)?,
    };
    let tools = crate::tools::parse(r.tools, r.tool_choice)?;
    let mut request = common.finish(PromptInput::Chat(messages), defaults)?;
    if let Some(t) = &tools {
        if request.grammar.is_some() {
            return Err(ApiError::invalid_param("tools", "give either 'tools' or 'response_format', not both"));
        }
        if t.choice != crate::tools::ToolChoice::Auto && !request.mode.follows_grammar(&request.sampling) {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!(
                    "decoding mode '{}' cannot force a tool call (a grammar) when sampling: send temperature 0, \
                     use mode 'dense', or tool_choice 'auto'",
                    request.mode.name()
                ),
            ));
        }
    }
    request.tools = tools;
    Ok(request)
}

/// Chat's `logprobs` (a flag) and `top_logprobs` (0 to 20, only with `logprobs`) as the number of alternatives.
fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    let top = top.map(|k| top_logprobs("top_logprobs", k)).transpose()?;
    match (logprobs.unwrap_or(false), top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, None) => Ok(None),
        (false, Some(_)) => Err(ApiError::invalid_param("top_logprobs", "'top_logprobs' needs 'logprobs': true")),
    }
}

/// A number of alternatives per token, 0 to [`engine::logprobs::MAX_TOP_LOGPROBS`].
fn top_logprobs(name: &str, k: i64) -> Result<usize, ApiError> {
    let max = engine::logprobs::MAX_TOP_LOGPROBS;
    usize::try_from(k)
        .ok()
        .filter(|&k| k <= max)
        .ok_or_else(|| ApiError::invalid_param(name, format!("'{name}' must be between 0 and {max}, got {k}")))
}

/// Refuses `stream_options.include_specee` where it is not offered.
fn no_specee_stream(options: &Option<wire::StreamOptions>) -> Result<(), ApiError> {
    match options {
        Some(wire::StreamOptions { include_specee: Some(true), .. }) => Err(ApiError::invalid_param(
            "stream_options.include_specee",
            "'stream_options.include_specee' is offered on chat completions only",
        )),
        _ => Ok(()),
    }
}

/// Validates a completions request.
pub fn completion_request(
    mut r: wire::CompletionRequest,
    defaults: &RequestDefaults,
) -> Result<GenerationRequest, ApiError> {
    let response_format = r.extra.remove("response_format");
    check_extra_fields(&r.extra, "")?;
    check_n(r.n)?;
    let input = match r.prompt {
        Prompt::Texts(mut texts) => match texts.len() {
            1 => PromptInput::Text(texts.remove(0)),
            0 => return Err(ApiError::invalid_param("prompt", "'prompt' is empty")),
            n => {
                return Err(ApiError::unsupported(
                    "prompt",
                    format!("'prompt' holds {n} prompts; this server answers one prompt per request"),
                ))
            }
        },
        Prompt::Tokens(mut lists) => match lists.len() {
            1 => PromptInput::Tokens(token_ids(lists.remove(0), defaults.vocab_size)?),
            n => {
                return Err(ApiError::unsupported(
                    "prompt",
                    format!("'prompt' holds {n} prompts; this server answers one prompt per request"),
                ))
            }
        },
    };
    no_specee_stream(&r.stream_options)?;
    if let PromptInput::Text(t) = &input {
        if t.is_empty() {
            return Err(ApiError::invalid_param("prompt", "'prompt' is empty"));
        }
    }
    let common = Common {
        max_tokens: Some(max_tokens("max_tokens", r.max_tokens)?.unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS)),
        temperature: r.temperature,
        top_p: r.top_p,
        seed: r.seed,
        stop: r.stop,
        stream: r.stream,
        stream_options: r.stream_options,
        specee: r.specee,
        response_format,
        logprobs: r.logprobs.map(|k| top_logprobs("logprobs", k)).transpose()?,
    };
    common.finish(input, defaults)
}

/// The fields both endpoints share.
struct Common {
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<wire::StreamOptions>,
    specee: Option<SpeceeOptions>,
    response_format: Option<Value>,
    logprobs: Option<usize>,
}

/// Most bytes of a `response_format` schema or a `specee.grammar` (compilation is bounded too).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// The grammar `response_format` asks for: `text` (or absent) none; `json_object` any JSON object (or, as
/// llama-server accepts, the object's `schema`); `json_schema` its `json_schema.schema` (`strict` or not, the
/// output always follows it).
fn response_format(format: Option<Value>) -> Result<Option<GrammarSpec>, ApiError> {
    let bad = |field: &str, why: String| ApiError::invalid_param(field, why);
    let format = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("response_format", "'response_format' must be an object".into())),
    };
    let schema = |v: &Value, field: &str| -> Result<GrammarSpec, ApiError> {
        if !v.is_object() && !v.is_boolean() {
            return Err(bad(field, format!("'{field}' must be a JSON schema (an object)")));
        }
        if v.to_string().len() > MAX_GRAMMAR_BYTES {
            return Err(bad(field, format!("'{field}' is larger than {MAX_GRAMMAR_BYTES} bytes")));
        }
        Ok(GrammarSpec::JsonSchema(v.clone()))
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match format.get("schema") {
            Some(v) => schema(v, "response_format.schema").map(Some),
            None => Ok(Some(GrammarSpec::json_object())),
        },
        Some("json_schema") => {
            let Some(js) = format.get("json_schema").and_then(Value::as_object) else {
                return Err(bad(
                    "response_format.json_schema",
                    "'response_format' of type 'json_schema' needs a 'json_schema' object with a 'schema'".into(),
                ));
            };
            match js.get("schema") {
                Some(v) => schema(v, "response_format.json_schema.schema").map(Some),
                // OpenAI's `schema` is optional: any JSON value then.
                None => Ok(Some(GrammarSpec::JsonSchema(serde_json::json!({})))),
            }
        }
        Some(other) => Err(bad(
            "response_format.type",
            format!("unknown response_format type '{other}' (expected text, json_object or json_schema)"),
        )),
        None => Err(bad("response_format.type", "'response_format' needs a 'type'".into())),
    }
}

impl Common {
    fn finish(self, input: PromptInput, defaults: &RequestDefaults) -> Result<GenerationRequest, ApiError> {
        let stream = self.stream.unwrap_or(false);
        let mut include_usage = false;
        let mut include_specee = false;
        if let Some(options) = self.stream_options {
            check_extra_fields(&options.extra, "stream_options.")?;
            if !stream {
                return Err(ApiError::invalid_param(
                    "stream_options",
                    "'stream_options' is only allowed with 'stream': true",
                ));
            }
            include_usage = options.include_usage.unwrap_or(false);
            include_specee = options.include_specee.unwrap_or(false);
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("'temperature' must be between 0 and 2, got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::invalid_param("top_p", format!("'top_p' must be between 0 and 1, got {top_p}")));
        }
        let stop = self.stop.map(|s| s.0).unwrap_or_default();
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid_param(
                "stop",
                format!("'stop' holds {} strings; at most {MAX_STOP_STRINGS} are accepted", stop.len()),
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!("stop strings must be 1 to {MAX_STOP_BYTES} bytes long, got {} bytes", s.len()),
            ));
        }
        let seed = match self.seed {
            // Any integer is a valid seed; negative ones wrap.
            Some(s) => s as u64,
            None => random_seed(),
        };
        let mut sampling =
            SamplingParams { temperature: temperature as f32, top_p: top_p as f32, seed, ..Default::default() };
        let mut mode = defaults.mode;
        let mut stop_at_eog = true;
        let mut grammar = None;
        let mut jump_forward = engine::JumpForward::default();
        if let Some(x) = self.specee {
            if let Some(name) = x.jump_forward {
                jump_forward = engine::JumpForward::parse(&name).ok_or_else(|| {
                    let why = format!("'specee.jump_forward' must be checked, unchecked or off, got '{name}'");
                    ApiError::invalid_param("specee.jump_forward", why)
                })?;
            }
            if let Some(name) = x.mode {
                mode = Some(Mode::parse(&name).ok_or_else(|| {
                    ApiError::invalid_param(
                        "specee.mode",
                        format!("unknown decoding mode '{name}' (available: {})", Mode::names()),
                    )
                })?);
            }
            if let Some(k) = x.top_k {
                sampling.top_k = usize::try_from(k).map_err(|_| {
                    ApiError::invalid_param("specee.top_k", format!("'specee.top_k' must be 0 (off) or more, got {k}"))
                })?;
            }
            if let Some(p) = x.min_p {
                if !(0.0..=1.0).contains(&p) {
                    return Err(ApiError::invalid_param(
                        "specee.min_p",
                        format!("'specee.min_p' must be between 0 and 1, got {p}"),
                    ));
                }
                sampling.min_p = p as f32;
            }
            if let Some(p) = x.repeat_penalty {
                if !(p > 0.0 && p <= 10.0) {
                    return Err(ApiError::invalid_param(
                        "specee.repeat_penalty",
                        format!("'specee.repeat_penalty' must be in (0, 10], got {p}"),
                    ));
                }
                sampling.repeat_penalty = p as f32;
            }
            stop_at_eog = !x.ignore_eos.unwrap_or(false);
            if let Some(g) = x.grammar {
                if g.len() > MAX_GRAMMAR_BYTES {
                    let why = format!("'specee.grammar' is larger than {MAX_GRAMMAR_BYTES} bytes");
                    return Err(ApiError::invalid_param("specee.grammar", why));
                }
                grammar = Some(GrammarSpec::Lark(g));
            }
        }
        if let Some(format) = response_format(self.response_format)? {
            if grammar.is_some() {
                let why = "give either 'response_format' or 'specee.grammar', not both";
                return Err(ApiError::invalid_param("specee.grammar", why));
            }
            grammar = Some(format);
        }
        let mode = mode.unwrap_or_else(|| defaults.auto(&sampling));
        if let Some((_, why)) = defaults.unavailable.iter().find(|(m, _)| *m == mode) {
            return Err(ApiError::invalid_param(
                "specee.mode",
                format!("decoding mode '{}' is not available on this server: {why}", mode.name()),
            ));
        }
        if mode.greedy_only() && !sampling.is_greedy() {
            return Err(ApiError::invalid_param(
                "temperature",
                format!(
                    "decoding mode '{}' decodes greedily only: send temperature 0 (or pick mode 'eagle' or 'dense')",
                    mode.name()
                ),
            ));
        }
        if grammar.is_some() && !mode.follows_grammar(&sampling) {
            return Err(ApiError::invalid_param(
                "response_format",
                format!(
                    "decoding mode '{}' cannot follow a response format or grammar when sampling: send temperature 0 or use mode 'dense'",
                    mode.name()
                ),
            ));
        }
        if self.logprobs.is_some() && !mode.reports_logprobs() {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!(
                    "decoding mode '{}' cannot report log probabilities (its tokens come from truncated forwards): \
                     use mode 'dense' or 'eagle'",
                    mode.name()
                ),
            ));
        }
        let traced = include_specee || (stream && self.logprobs.is_some());
        Ok(GenerationRequest {
            grammar,
            jump_forward,
            include_specee,
            logprobs: self.logprobs,
            tools: None,
            input,
            max_tokens: self.max_tokens,
            sampling,
            stop,
            stop_at_eog,
            mode,
            stream,
            include_usage,
            trace: traced.then(engine::TraceSink::default),
        })
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // The standard library's per-process random keys, mixed with the time.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

fn max_tokens(name: &str, value: Option<i64>) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if v < 1 => Err(ApiError::invalid_param(name, format!("'{name}' must be at least 1, got {v}"))),
        // Above the context it is capped once the prompt's length is known.
        Some(v) => Ok(Some(usize::try_from(v).unwrap_or(usize::MAX))),
    }
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) if n > 1 => {
            Err(ApiError::unsupported("n", format!("'n' = {n}: this server returns one choice per request (n = 1)")))
        }
        Some(n) => Err(ApiError::invalid_param("n", format!("'n' must be at least 1, got {n}"))),
    }
}

fn chat_message(index: usize, m: wire::ChatMessage) -> Result<Message, ApiError> {
    let at = |field: &str| format!("messages[{index}].{field}");
    check_extra_fields(&m.extra, &format!("messages[{index}]."))?;
    let role = match m.role.as_str() {
        "system" | "user" | "assistant" | "tool" => m.role.clone(),
        // OpenAI's newer name for system instructions.
        "developer" => "system".to_string(),
        "function" => {
            return Err(ApiError::unsupported(
                at("role"),
                "role 'function' (the deprecated function-calling API) is not supported: send 'tool' messages",
            ))
        }
        other => {
            return Err(ApiError::invalid_param(
                at("role"),
                format!("unknown role '{other}' (expected system, developer, user or assistant)"),
            ))
        }
    };
    let tool_calls = match m.tool_calls {
        None | Some(Value::Null) => None,
        Some(_) if role != "assistant" => {
            return Err(ApiError::invalid_param(at("tool_calls"), "only assistant messages carry 'tool_calls'"))
        }
        Some(calls) => Some(crate::tools::template_calls(calls, &at("tool_calls"))?),
    };
    let content = match m.content {
        // An assistant message of tool calls alone.
        None if tool_calls.is_some() => String::new(),
        None => return Err(ApiError::invalid_param(at("content"), format!("'{}' is missing", at("content")))),
        Some(MessageContent::Text(t)) => t,
        Some(MessageContent::Parts(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(t)) => text.push_str(&t),
                    ("text", None) => {
                        return Err(ApiError::invalid_param(
                            at(&format!("content[{j}].text")),
                            "a text part needs 'text'",
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::unsupported(
                            at(&format!("content[{j}].type")),
                            format!("content parts of type '{other}' are not supported (only 'text')"),
                        ))
                    }
                }
            }
            text
        }
    };
    Ok(Message { role, content, tool_calls })
}

fn token_ids(ids: Vec<i64>, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_param("prompt", "'prompt' is an empty list of token ids"));
    }
    ids.into_iter()
        .map(|id| {
            u32::try_from(id).ok().filter(|&t| (t as usize) < vocab_size).ok_or_else(|| {
                ApiError::invalid_param("prompt", format!("token id {id} is outside the vocabulary (0..{vocab_size})"))
            })
        })
        .collect()
}

/// How the server treats a field it does not implement.
enum Extra {
    /// Accepted and ignored whatever its value (bookkeeping the server has no use for).
    Benign,
    /// Accepted only when it asks for nothing (`false`, `0`, `{}`, `[]`, the given value); else a 400.
    OnlyNeutral(&'static str),
}

fn extra_policy(name: &str) -> Option<Extra> {
    Some(match name {
        "user"
        | "metadata"
        | "store"
        | "service_tier"
        | "parallel_tool_calls"
        | "prompt_cache_key"
        | "safety_identifier"
        | "name" => Extra::Benign,
        "functions" | "function_call" => {
            Extra::OnlyNeutral("the deprecated function-calling API is not supported (send 'tools')")
        }
        "frequency_penalty" | "presence_penalty" => {
            Extra::OnlyNeutral("frequency and presence penalties are not supported (see specee.repeat_penalty)")
        }
        "logit_bias" => Extra::OnlyNeutral("logit bias is not supported"),
        "echo" => Extra::OnlyNeutral("echoing the prompt is not supported"),
        "best_of" => Extra::OnlyNeutral("best_of is not supported"),
        "suffix" => Extra::OnlyNeutral("suffixes (fill-in-the-middle) are not supported"),
        "modalities" => Extra::OnlyNeutral("only text output is supported"),
        "audio" | "prediction" | "web_search_options" | "reasoning_effort" | "verbosity" => {
            Extra::OnlyNeutral("this feature is not supported")
        }
        _ => return None,
    })
}

/// Whether `value` asks for nothing.
fn is_neutral(name: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(if name == "best_of" { 1.0 } else { 0.0 }),
        Value::String(s) => s.is_empty() || (s == "none" && matches!(name, "tool_choice" | "function_call")),
        Value::Array(a) => a.is_empty() || (name == "modalities" && a.iter().all(|m| m == "text")),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) => false,
    }
}

/// Refuses unknown fields and unsupported features among `extra` (fields the wire type does not name).
fn check_extra_fields(extra: &Map<String, Value>, prefix: &str) -> Result<(), ApiError> {
    for (name, value) in extra {
        let param = format!("{prefix}{name}");
        match extra_policy(name) {
            Some(Extra::Benign) => {}
            Some(Extra::OnlyNeutral(why)) => {
                if !is_neutral(name, value) {
                    return Err(ApiError::unsupported(param.clone(), format!("'{param}': {why} by this server")));
                }
            }
            None => {
                return Err(ApiError::invalid_param(
                    param.clone(),
                    format!("unrecognized request argument supplied: '{param}'"),
                )
                .with_code("unknown_parameter"))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ChatCompletionRequest, CompletionRequest};

    fn defaults() -> RequestDefaults {
        RequestDefaults {
            mode: Some(Mode::Dense),
            vocab_size: 100,
            unavailable: vec![(Mode::Specee, "no predictors")],
            n_layers: 30,
        }
    }

    fn chat(body: &str) -> Result<GenerationRequest, ApiError> {
        chat_request(parse_body::<ChatCompletionRequest>(body.as_bytes())?, &defaults())
    }

    fn completion(body: &str) -> Result<GenerationRequest, ApiError> {
        completion_request(parse_body::<CompletionRequest>(body.as_bytes())?, &defaults())
    }

    fn param(e: ApiError) -> Option<String> {
        assert_eq!(e.status.as_u16(), 400, "{e}");
        e.param
    }

    #[test]
    fn minimal_chat_gets_defaults() {
        let r = chat(r#"{"model": "x", "messages": [{"role": "user", "content": "hi"}]}"#).unwrap();
        assert_eq!(r.input, PromptInput::Chat(vec![Message::new("user", "hi")]));
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_eq!(r.mode, Mode::Dense);
        assert!(!r.stream && r.stop.is_empty() && r.stop_at_eog);
    }

    #[test]
    fn benign_fields_accepted() {
        let r = chat(
            r#"{"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                "n": 1, "user": "u", "stream": true, "stream_options": {"include_usage": true}, "logprobs": false,
                "response_format": {"type": "text"}, "tools": [], "seed": -1, "stop": "x", "temperature": 0}"#,
        )
        .unwrap();
        assert_eq!(r.input, PromptInput::Chat(vec![Message::new("system", "ab")]));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.sampling.seed, u64::MAX);
        assert_eq!(r.stop, vec!["x"]);
    }

    #[test]
    fn modes_are_checked_against_what_the_server_loaded() {
        let body = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], {extra}}}"#);
        let parse = |extra: &str, d: &RequestDefaults| {
            chat_request(parse_body::<ChatCompletionRequest>(body(extra).as_bytes()).unwrap(), d)
        };
        let all = RequestDefaults { unavailable: Vec::new(), ..defaults() };
        let r = parse(r#""temperature": 0.7, "specee": {"mode": "eagle"}"#, &all).unwrap();
        assert_eq!(r.mode, Mode::Eagle);
        assert_eq!(parse(r#""temperature": 0, "specee": {"mode": "specee"}"#, &all).unwrap().mode, Mode::Specee);
        let e = parse(r#""temperature": 0.7, "specee": {"mode": "specee"}"#, &all).unwrap_err();
        assert_eq!(param(e).as_deref(), Some("temperature"));
        let e = parse(r#""temperature": 0.7, "specee": {"mode": "specee-eagle"}"#, &all).unwrap_err();
        assert!(e.to_string().contains("'specee-eagle' decodes greedily only"), "{e}");
        let r = parse(r#""temperature": 0, "specee": {"mode": "specee-eagle"}"#, &all).unwrap();
        assert_eq!(r.mode, Mode::SpeceeEagle);
        let e = parse(r#""temperature": 0, "specee": {"mode": "specee"}"#, &defaults()).unwrap_err();
        assert!(e.to_string().contains("not available on this server: no predictors"), "{e}");
    }

    #[test]
    fn auto_picks_eagle_for_greedy_requests_when_the_server_has_it() {
        let body = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}], {extra}}}"#);
        let parse = |extra: &str, d: &RequestDefaults| {
            chat_request(parse_body::<ChatCompletionRequest>(body(extra).as_bytes()).unwrap(), d).unwrap().mode
        };
        let auto = RequestDefaults { mode: None, unavailable: Vec::new(), ..defaults() };
        assert_eq!(parse(r#""temperature": 0"#, &auto), Mode::Eagle);
        assert_eq!(parse(r#""temperature": 0.7"#, &auto), Mode::Dense);
        assert_eq!(parse(r#""temperature": 0, "specee": {"repeat_penalty": 1.2}"#, &auto), Mode::Dense);
        assert_eq!(parse(r#""temperature": 0, "specee": {"mode": "dense"}"#, &auto), Mode::Dense);
        let no_head = RequestDefaults { mode: None, unavailable: vec![(Mode::Eagle, "no draft head")], ..defaults() };
        assert_eq!(parse(r#""temperature": 0"#, &no_head), Mode::Dense);
    }

    #[test]
    fn logprobs_on_both_endpoints_with_their_limits_and_modes() {
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        let r = chat(&format!(r#"{{{msgs}, "logprobs": true}}"#)).unwrap();
        assert_eq!(r.logprobs, Some(0));
        assert!(r.trace.is_none(), "no stream: the generation's own list answers");
        let r = chat(&format!(r#"{{{msgs}, "logprobs": true, "top_logprobs": 20, "stream": true}}"#)).unwrap();
        assert_eq!(r.logprobs, Some(20));
        assert!(r.trace.is_some() && !r.include_specee, "streamed: traced per chunk");
        assert_eq!(chat(&format!(r#"{{{msgs}, "logprobs": false, "top_logprobs": null}}"#)).unwrap().logprobs, None);
        assert_eq!(completion(r#"{"prompt": "x", "logprobs": 5}"#).unwrap().logprobs, Some(5));
        assert_eq!(completion(r#"{"prompt": "x", "logprobs": 0}"#).unwrap().logprobs, Some(0));
        assert_eq!(completion(r#"{"prompt": "x", "logprobs": null}"#).unwrap().logprobs, None);
        for bad in [r#""logprobs": 21"#, r#""logprobs": -1"#, r#""logprobs": true"#] {
            let e = completion(&format!(r#"{{"prompt": "x", {bad}}}"#)).unwrap_err();
            assert_eq!(param(e).as_deref(), Some("logprobs"), "{bad}");
        }
        let all = RequestDefaults { unavailable: Vec::new(), ..defaults() };
        let body = format!(r#"{{{msgs}, "logprobs": true, "temperature": 0, "specee": {{"mode": "specee-eagle"}}}}"#);
        let e = chat_request(parse_body::<ChatCompletionRequest>(body.as_bytes()).unwrap(), &all).unwrap_err();
        assert!(e.to_string().contains("cannot report log probabilities"), "{e}");
    }

    #[test]
    fn include_specee_asks_chat_streams_for_token_traces_only() {
        let msgs = r#""messages": [{"role": "user", "content": "hi"}], "stream": true"#;
        let with = chat(&format!(r#"{{{msgs}, "stream_options": {{"include_specee": true}}}}"#)).unwrap();
        assert!(with.trace.is_some());
        let without = chat(&format!(r#"{{{msgs}, "stream_options": {{"include_usage": true}}}}"#)).unwrap();
        assert!(without.trace.is_none());
        let body = r#"{"prompt": "x", "stream": true, "stream_options": {"include_specee": true}}"#;
        assert_eq!(param(completion(body).unwrap_err()).as_deref(), Some("stream_options.include_specee"));
        assert!(completion(r#"{"prompt": "x", "stream": true, "stream_options": {"include_specee": false}}"#).is_ok());
    }

    #[test]
    fn response_formats_become_grammars() {
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        let grammar = |extra: &str| chat(&format!("{{{msgs}, {extra}}}")).unwrap().grammar;
        assert_eq!(grammar(r#""response_format": {"type": "text"}"#), None);
        assert_eq!(grammar(r#""response_format": {"type": "json_object"}"#), Some(GrammarSpec::json_object()));
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let body = format!(
            r#""response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "strict": true, "schema": {schema}}}}}"#
        );
        assert_eq!(grammar(&body), Some(GrammarSpec::JsonSchema(schema.clone())));
        let body = format!(r#""response_format": {{"type": "json_object", "schema": {schema}}}"#);
        assert_eq!(grammar(&body), Some(GrammarSpec::JsonSchema(schema)));
        assert_eq!(grammar(r#""specee": {"grammar": "start: \"a\""}"#), Some(GrammarSpec::Lark("start: \"a\"".into())));
        let completion = completion(r#"{"prompt": "x", "response_format": {"type": "json_object"}}"#).unwrap();
        assert_eq!(completion.grammar, Some(GrammarSpec::json_object()));
        let jump = |extra: &str| chat(&format!("{{{msgs}, {extra}}}")).unwrap().jump_forward;
        assert_eq!(jump(r#""specee": {"mode": "dense"}"#), engine::JumpForward::Checked);
        assert_eq!(jump(r#""specee": {"jump_forward": "unchecked"}"#), engine::JumpForward::Unchecked);
        assert_eq!(jump(r#""specee": {"jump_forward": "off"}"#), engine::JumpForward::Off);
    }

    #[test]
    fn unsupported_and_unknown_fields_refused() {
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        for (extra, want) in [
            (r#""n": 2"#, "n"),
            (r#""n": 0"#, "n"),
            (r#""tools": [{"type": "function"}]"#, "tools[0].function"),
            (r#""tool_choice": "required""#, "tool_choice"),
            (r#""functions": [{"name": "f"}]"#, "functions"),
            (
                r#""tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}"#,
                "tools",
            ),
            (r#""logprobs": true, "top_logprobs": 21"#, "top_logprobs"),
            (r#""logprobs": true, "top_logprobs": -1"#, "top_logprobs"),
            (r#""top_logprobs": 2"#, "top_logprobs"),
            (r#""logprobs": 3"#, "logprobs"),
            (r#""response_format": {"type": "xml"}"#, "response_format.type"),
            (r#""response_format": {"type": "json_schema"}"#, "response_format.json_schema"),
            (
                r#""response_format": {"type": "json_schema", "json_schema": {"schema": 3}}"#,
                "response_format.json_schema.schema",
            ),
            (r#""response_format": "json""#, "response_format"),
            (r#""response_format": {"type": "json_object"}, "specee": {"grammar": "start: \"a\""}"#, "specee.grammar"),
            (
                r#""response_format": {"type": "json_object"}, "specee": {"mode": "eagle"}, "temperature": 0.5"#,
                "response_format",
            ),
            (r#""frobnicate": 1"#, "frobnicate"),
            (r#""max_tokens": -5"#, "max_tokens"),
            (r#""max_tokens": 0"#, "max_tokens"),
            (r#""max_tokens": "many""#, "max_tokens"),
            (r#""temperature": 3"#, "temperature"),
            (r#""top_p": -0.1"#, "top_p"),
            (r#""stop": 7"#, "stop"),
            (r#""stop": [""]"#, "stop"),
            (r#""specee": {"mode": "warp"}"#, "specee.mode"),
            (r#""specee": {"mode": "specee"}"#, "specee.mode"),
            (r#""specee": {"speed": 11}"#, "specee.speed"),
            (r#""specee": {"jump_forward": "sometimes"}"#, "specee.jump_forward"),
            (r#""specee": {"jump_forward": true}"#, "specee.jump_forward"),
            (r#""stream_options": {"include_usage": true}"#, "stream_options"),
        ] {
            let e = chat(&format!("{{{msgs}, {extra}}}")).unwrap_err();
            assert_eq!(param(e).as_deref(), Some(want), "{extra}");
        }
        assert_eq!(param(chat(r#"{"messages": []}"#).unwrap_err()).as_deref(), Some("messages"));
        assert_eq!(
            param(chat(r#"{"messages": [{"role": "function", "content": "x"}]}"#).unwrap_err()).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param(chat(r#"{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}"#).unwrap_err())
                .as_deref(),
            Some("messages[0].tool_calls")
        );
        // A tool round trip's messages: the assistant's calls (content null) and the tool's answer.
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                 "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "18 C"}],
                "tools": [{"type": "function", "function": {"name": "w"}}], "tool_choice": "auto"}"#,
        )
        .unwrap();
        let PromptInput::Chat(m) = &r.input else { panic!() };
        assert_eq!(m[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!((m[2].role.as_str(), m[2].content.as_str()), ("tool", "18 C"));
        assert!(r.tools.is_some());
        assert_eq!(
            param(chat(r#"{"messages": [{"role": "user", "content": 3}]}"#).unwrap_err()).as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param(
                chat(r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#)
                    .unwrap_err()
            )
            .as_deref(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            param(chat(r#"{"messages": [{"role": "user"}]}"#).unwrap_err()).as_deref(),
            Some("messages[0].content")
        );
        assert!(chat(r#"{"prompt": "x"}"#).unwrap_err().message.contains("messages"));
    }

    #[test]
    fn malformed_bodies() {
        assert!(chat("{").unwrap_err().message.contains("not valid JSON"));
        assert!(chat("[1]").unwrap_err().message.contains("JSON object"));
        assert!(chat("").is_err());
    }

    #[test]
    fn completions_prompts() {
        let r = completion(r#"{"prompt": "Once"}"#).unwrap();
        assert_eq!(r.input, PromptInput::Text("Once".into()));
        assert_eq!(r.max_tokens, Some(COMPLETIONS_DEFAULT_MAX_TOKENS));
        assert_eq!(
            completion(r#"{"prompt": [[1, 2]], "max_tokens": 99999999999}"#).unwrap().input,
            PromptInput::Tokens(vec![1, 2])
        );
        assert_eq!(param(completion(r#"{"prompt": ["a", "b"]}"#).unwrap_err()).as_deref(), Some("prompt"));
        assert_eq!(param(completion(r#"{"prompt": [100]}"#).unwrap_err()).as_deref(), Some("prompt"));
        assert_eq!(param(completion(r#"{"prompt": [-1]}"#).unwrap_err()).as_deref(), Some("prompt"));
        assert_eq!(param(completion(r#"{"prompt": ""}"#).unwrap_err()).as_deref(), Some("prompt"));
        assert_eq!(param(completion(r#"{"prompt": "x", "echo": true}"#).unwrap_err()).as_deref(), Some("echo"));
        assert!(completion(r#"{"prompt": "x", "echo": false, "best_of": 1, "suffix": null}"#).is_ok());
    }
}
