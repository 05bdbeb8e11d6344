//! OpenAI wire types: the JSON bodies of `/v1/chat/completions`, `/v1/completions` and `/v1/models`, and the
//! error body — exactly as they travel, nothing else. Turning a request into generation settings (and
//! rejecting what is unsupported) is [`crate::request`]'s job; handlers live in [`crate::routes`].
//!
//! Requests keep every field they do not name in `extra`, so that unknown or unsupported fields are answered
//! with a 400 instead of being silently ignored. Fields that can take several shapes (`stop`, `prompt`,
//! message `content`) are parsed from a JSON value with messages that say which shapes are accepted.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessage>,
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// Return each answer token's log probability (`choices[].logprobs.content`).
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token (0 to 20).
    pub top_logprobs: Option<i64>,
    /// Functions the model may call (checked by [`crate::tools::parse`]).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// The `specee` extension object.
    pub specee: Option<SpeceeOptions>,
    /// Every other field, checked by [`crate::request`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Body of `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// Return each token's log probability and this many most likely alternatives (0 to 20; OpenAI allows 5).
    pub logprobs: Option<i64>,
    pub specee: Option<SpeceeOptions>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One message of a chat request.
#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    /// A participant name (accepted; chat templates here do not use it).
    pub name: Option<String>,
    /// An assistant message's calls (a previous answer's `tool_calls`).
    pub tool_calls: Option<Value>,
    /// A `tool` message's answer to this call (accepted; templates match answers to calls by order).
    pub tool_call_id: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A message's content: a string, or an array of parts of which only `{"type": "text", "text": …}` is
/// supported.
#[derive(Debug)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of an array `content`.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `stop`: one string or an array of strings.
#[derive(Debug)]
pub struct Stop(pub Vec<String>);

/// `prompt` of the completions endpoint: a string, an array with one string, an array of token ids, or an
/// array with one array of token ids. More than one prompt is a batch, answered with a 400 later.
#[derive(Debug)]
pub enum Prompt {
    Texts(Vec<String>),
    Tokens(Vec<Vec<i64>>),
}

/// `stream_options`.
#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` before `[DONE]`.
    pub include_usage: Option<bool>,
    /// specee's extension (chat completions): chunks carry `specee.tokens`, how each answer token was made, and
    /// the finishing chunk `specee.summary`.
    pub include_specee: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The `specee` extension object: decoding mode and the sampling settings OpenAI's API lacks.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeceeOptions {
    /// Decoding mode (`dense`, …); the server's `--mode` if absent.
    pub mode: Option<String>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repeat_penalty: Option<f64>,
    /// Keep generating past end-of-generation tokens.
    pub ignore_eos: Option<bool>,
    /// A grammar the output must follow, in llguidance's Lark dialect (instead of `response_format`).
    pub grammar: Option<String>,
    /// Under a grammar in dense decoding, what to do with the tokens it forces: `checked` (default), `unchecked`
    /// or `off` ([`engine::JumpForward`]).
    pub jump_forward: Option<String>,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Stop(vec![s])),
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    other => Err(D::Error::custom(format!(
                        "expected a string or an array of strings, found an array holding {}",
                        type_name(&other)
                    ))),
                })
                .collect::<Result<_, _>>()
                .map(Stop),
            other => {
                Err(D::Error::custom(format!("expected a string or an array of strings, found {}", type_name(&other))))
            }
        }
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => Ok(MessageContent::Text(s)),
            v @ Value::Array(_) => serde_json::from_value(v).map(MessageContent::Parts).map_err(|e| {
                D::Error::custom(format!(
                    "expected an array of content parts like {{\"type\": \"text\", \"text\": \"…\"}}: {e}"
                ))
            }),
            other => Err(D::Error::custom(format!(
                "expected a string or an array of content parts, found {}",
                type_name(&other)
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        const SHAPES: &str = "a string, an array of strings, an array of token ids or an array of arrays of token ids";
        let token = |v: &Value| {
            v.as_i64().ok_or_else(|| {
                D::Error::custom(format!("expected {SHAPES}; found a token id that is {}", type_name(v)))
            })
        };
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Prompt::Texts(vec![s])),
            Value::Array(items) => match items.first() {
                None => Ok(Prompt::Texts(Vec::new())),
                Some(Value::String(_)) => items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| D::Error::custom(format!("expected {SHAPES}; found a mixed array")))
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::Texts),
                Some(Value::Number(_)) => {
                    Ok(Prompt::Tokens(vec![items.iter().map(token).collect::<Result<_, _>>()?]))
                }
                Some(Value::Array(_)) => items
                    .iter()
                    .map(|inner| match inner {
                        Value::Array(ids) => ids.iter().map(token).collect::<Result<Vec<_>, _>>(),
                        other => Err(D::Error::custom(format!(
                            "expected {SHAPES}; found a mixed array holding {}",
                            type_name(other)
                        ))),
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::Tokens),
                Some(other) => {
                    Err(D::Error::custom(format!("expected {SHAPES}; found an array holding {}", type_name(other))))
                }
            },
            other => Err(D::Error::custom(format!("expected {SHAPES}; found {}", type_name(&other)))),
        }
    }
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// Present when the server counts reasoning (`serve --reasoning`, or a model with a think section).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// `usage.completion_tokens_details`, as OpenAI gives it for reasoning models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CompletionTokensDetails {
    /// Completion tokens that are reasoning (up to the profile's end of reasoning).
    pub reasoning_tokens: usize,
}

/// Non-standard details added to responses under `specee` (OpenAI clients ignore unknown fields).
#[derive(Clone, Debug, Serialize)]
pub struct SpeceeInfo {
    pub mode: &'static str,
    pub prompt_tokens_per_second: f64,
    pub decode_tokens_per_second: f64,
    /// Tokens committed per full-model forward (1 for dense and `specee`; τ for the tree modes).
    pub acceptance_length: f64,
    /// Layers run per generated token (fewer than `n_layers` when tokens exit early).
    pub layers_per_token: f64,
    pub n_layers: usize,
    /// The draft tree of the tree modes, `depth,top_k,budget,min_prob` as `--tree` takes it (absent for dense and
    /// `specee`). With `--parallel` batching, trees beside other requests share the forward's row budget.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tree: Option<String>,
}

/// How one answer token was made (`stream_options.include_specee`).
#[derive(Clone, Debug, Serialize)]
pub struct TokenInfo {
    pub id: u32,
    /// The text this token completed (empty inside a multi-byte character).
    pub text: String,
    /// `plain` (one forward for this token), `draft` (a draft-head token the model accepted), `lookup` (a
    /// prompt-lookup token accepted), `bonus` (the model's own token after accepted drafts), `forced` (committed
    /// by the grammar without a model step: `specee.jump_forward`).
    pub source: &'static str,
    /// Layers run by the forward that decided it.
    pub layers: u16,
}

impl From<engine::TokenTrace> for TokenInfo {
    fn from(t: engine::TokenTrace) -> TokenInfo {
        TokenInfo { id: t.token, text: t.text, source: t.source.name(), layers: t.layers }
    }
}

/// The `specee` object of a streamed chunk (`stream_options.include_specee`).
#[derive(Debug, Default, Serialize)]
pub struct StreamSpecee {
    /// The tokens behind this chunk's text (every answer token appears in exactly one chunk).
    pub tokens: Vec<TokenInfo>,
    /// On the chunk with the finish reason: the answer's speeds and the mode's counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<SpeceeInfo>,
}

/// Response of `POST /v1/chat/completions` without streaming.
#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub specee: SpeceeInfo,
}

/// One token's log probability under the model, as chat completions give it (`logprobs.content[]`); also what
/// the completions endpoint's own shape is built from.
#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    /// The token's text (bytes that are not UTF-8 on their own are replaced; `bytes` holds them exactly).
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// The most likely tokens at this step, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative of [`TokenLogprob::top_logprobs`].
#[derive(Clone, Debug, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// `choices[].logprobs` of a chat completion (and of each streamed chunk: the chunk's tokens).
#[derive(Debug, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
    pub refusal: Option<Vec<TokenLogprob>>,
}

/// `choices[].logprobs` of a completion (and of each streamed chunk: the chunk's tokens).
#[derive(Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, the alternatives by text (alternatives whose texts coincide keep the likelier).
    pub top_logprobs: Vec<TopByText>,
    /// Where each token's text starts in the completion (characters).
    pub text_offset: Vec<usize>,
}

/// A completions `top_logprobs` entry: a JSON object from token text to log probability, most likely first.
#[derive(Debug, Default)]
pub struct TopByText(pub Vec<(String, f32)>);

impl Serialize for TopByText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

impl CompletionLogprobs {
    /// The completions shape of `entries`, the first starting at character `offset` of the completion; returns
    /// it with the offset after the last.
    pub fn from_entries(entries: Vec<TokenLogprob>, mut offset: usize) -> (CompletionLogprobs, usize) {
        let mut out = CompletionLogprobs::default();
        for e in entries {
            let mut top = TopByText::default();
            for alt in e.top_logprobs {
                if !top.0.iter().any(|(t, _)| *t == alt.token) {
                    top.0.push((alt.token, alt.logprob));
                }
            }
            out.text_offset.push(offset);
            offset += e.token.chars().count();
            out.tokens.push(e.token);
            out.token_logprobs.push(e.logprob);
            out.top_logprobs.push(top);
        }
        (out, offset)
    }
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<crate::tools::ToolCall>>,
}

/// One call in a streamed `delta.tool_calls`.
#[derive(Debug, Serialize)]
pub struct DeltaToolCall {
    pub index: usize,
    #[serde(flatten)]
    pub call: crate::tools::ToolCall,
}

/// One server-sent event of a streamed chat completion.
#[derive(Debug, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub specee: Option<StreamSpecee>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<DeltaToolCall>>,
}

/// Response of `POST /v1/completions` without streaming, and (with `usage: None`) each streamed event.
#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub specee: Option<SpeceeInfo>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Response of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// What this server can do with the model (specee's extension; the chat page reads it).
    pub specee: ModelExtras,
}

/// The `specee` object of a model card.
#[derive(Debug, Serialize)]
pub struct ModelExtras {
    /// Decoding modes requests may choose (`specee.mode`).
    pub modes: Vec<&'static str>,
    /// The model's depth.
    pub n_layers: usize,
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_accepts_string_and_array() {
        let s: Stop = serde_json::from_str("\"x\"").unwrap();
        assert_eq!(s.0, vec!["x"]);
        let s: Stop = serde_json::from_str("[\"a\", \"b\"]").unwrap();
        assert_eq!(s.0, vec!["a", "b"]);
        assert!(serde_json::from_str::<Stop>("3").unwrap_err().to_string().contains("found a number"));
        assert!(serde_json::from_str::<Stop>("[1]").is_err());
    }

    #[test]
    fn prompt_shapes() {
        assert!(matches!(serde_json::from_str::<Prompt>("\"hi\"").unwrap(), Prompt::Texts(t) if t == ["hi"]));
        assert!(matches!(serde_json::from_str::<Prompt>("[1, 2]").unwrap(), Prompt::Tokens(t) if t == [vec![1, 2]]));
        assert!(matches!(serde_json::from_str::<Prompt>("[[1], [2]]").unwrap(), Prompt::Tokens(t) if t.len() == 2));
        assert!(serde_json::from_str::<Prompt>("[\"a\", 1]").is_err());
        assert!(serde_json::from_str::<Prompt>("{}").is_err());
        assert!(serde_json::from_str::<Prompt>("[1.5]").is_err());
    }

    #[test]
    fn unknown_fields_are_kept() {
        let r: ChatCompletionRequest = serde_json::from_str(r#"{"messages": [], "user": "u", "x": 1}"#).unwrap();
        assert!(r.extra.contains_key("user") && r.extra.contains_key("x"));
    }

    #[test]
    fn content_parts() {
        let m: ChatMessage =
            serde_json::from_str(r#"{"role": "user", "content": [{"type": "text", "text": "hi"}]}"#).unwrap();
        assert!(matches!(m.content, Some(MessageContent::Parts(p)) if p[0].text.as_deref() == Some("hi")));
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role": "user", "content": 5}"#).is_err());
    }
}
