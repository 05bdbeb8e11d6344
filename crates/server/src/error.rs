//! Errors: [`ApiError`] is what a client sees — an HTTP status and an OpenAI-style body
//! `{"error": {"message", "type", "param", "code"}}` — and [`ServerError`] is what stops the server itself
//! (binding the port, the runtime).

use crate::wire::{ErrorBody, ErrorDetail};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// An error answered to a client. Its message names the offending value where there is one.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's error `type`: `invalid_request_error`, `rate_limit_error`, `server_error`, …
    pub kind: &'static str,
    /// The request field at fault, as a path (`messages[0].content`), when known.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `rate_limit_exceeded`, …).
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400: the request is malformed or asks for something this server does not do.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 about one field.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::invalid(message).with_param(param)
    }

    /// 400 for a field or value this server knows but does not support.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::invalid_param(param, message).with_code("unsupported_parameter")
    }

    /// 404 for an unknown route.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message).with_code("not_found")
    }

    /// 405 for a known route used with the wrong method.
    pub fn method_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message).with_code("method_not_allowed")
    }

    /// 429: the queue is full.
    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> ApiError {
        let mut e =
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).with_code("rate_limit_exceeded");
        e.retry_after = Some(retry_after);
        e
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the server is shutting down")
            .with_code("shutting_down");
        e.retry_after = Some(1);
        e
    }

    /// 500: something broke on our side (never the client's input).
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = status;
        self
    }

    /// The OpenAI-style body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                param: self.param.clone(),
                code: self.code.map(str::to_string),
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self.body()).unwrap_or_else(|_| b"{\"error\":{}}".to_vec());
        let mut response =
            (self.status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response();
        if let Some(secs) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Maps an engine failure to what the client sees: problems with the request are 400s, the rest 500s.
impl From<engine::EngineError> for ApiError {
    fn from(e: engine::EngineError) -> ApiError {
        use engine::EngineError as E;
        match e {
            E::PromptTooLong { prompt, ctx } => ApiError::invalid(format!(
                "the prompt has {prompt} tokens but the server's context holds {ctx} (start the server with a larger --ctx-size)"
            ))
            .with_code("context_length_exceeded"),
            E::EmptyPrompt => ApiError::invalid("the prompt is empty (it tokenizes to no tokens)"),
            E::NoChatTemplate => ApiError::invalid(
                "this model has no chat template (tokenizer.chat_template); use /v1/completions with a raw prompt",
            )
            .with_param("messages"),
            // Chat templates reject some conversations (e.g. roles that do not alternate) with an error.
            E::Tokenizer(t) => ApiError::invalid_param("messages", format!("the chat template rejected the conversation: {t}")),
            other => ApiError::internal(other.to_string()),
        }
    }
}

/// What stops the server from starting or running.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("server failed: {0}")]
    Serve(std::io::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
}
