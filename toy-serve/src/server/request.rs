//! What every endpoint does with a request before it reaches the engine: wait for the model,
//! read and parse the body, tokenize, check ids and the context; and the ids, timestamps and
//! fingerprint that responses carry.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use toy_core::tokenizer::Tokenizer;

use crate::api::Checked;
use crate::engine::ModelInfo;
use crate::error::ApiError;
use crate::grammar::Constraint;
use crate::state::Shared;

pub(super) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(super) fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

pub(super) fn fingerprint(s: &Shared) -> String {
    format!("toy-{}-{}", env!("CARGO_PKG_VERSION"), s.backend)
}

/// The loaded model, or 503 while it loads / once shutting down.
pub(super) fn ready(s: &Shared) -> Result<Arc<ModelInfo>, ApiError> {
    if s.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down", 5));
    }
    s.info
        .get()
        .cloned()
        .ok_or_else(|| ApiError::unavailable("the model is still loading; retry shortly", 2))
}

pub(super) fn check_model(info: &ModelInfo, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != info.id => Err(ApiError::model_not_found(m, &info.id)),
        _ => Ok(()),
    }
}

/// Read the body (at most `max_body` bytes; a larger one is drained, up to a bound, and
/// answered with 413 so that the client reads the answer instead of a reset) and parse it.
pub(super) async fn read_json<T: DeserializeOwned>(
    s: &Shared,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, ApiError> {
    let limit = s.max_body;
    let drain_limit = limit.saturating_mul(16).max(64 << 20);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut seen = 0usize;
    // One deadline for the whole body, not per chunk: a client trickling a byte at a time
    // would reset a per-chunk timer forever (slow-loris).
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk: Bytes = chunk.map_err(|e| {
                ApiError::invalid(None, format!("cannot read the request body: {e}"))
            })?;
            seen += chunk.len();
            if seen > limit {
                if seen > drain_limit {
                    break;
                }
                continue;
            }
            buf.extend_from_slice(&chunk);
        }
        Ok::<(), ApiError>(())
    };
    tokio::time::timeout(s.read_timeout, read)
        .await
        .map_err(|_| ApiError::timeout(s.read_timeout))??;
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            None,
            "the request body is empty: send a JSON object",
        ));
    }
    serde_json::from_slice(&buf).map_err(|e| match e.classify() {
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
            ApiError::invalid(None, format!("malformed JSON in the request body: {e}"))
                .code("invalid_json")
        }
        _ => ApiError::invalid(None, format!("invalid request: {e}")),
    })
}

/// Tokenize off the async runtime (a long text takes a while).
pub(super) async fn encode(
    info: &Arc<ModelInfo>,
    text: String,
    add_special: bool,
    parse_special: bool,
) -> Result<Vec<u32>, ApiError> {
    let info = info.clone();
    tokio::task::spawn_blocking(move || info.tokenizer.encode(&text, add_special, parse_special))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
        .map_err(|e| ApiError::invalid(None, format!("cannot tokenize the input: {e}")))
}

/// Compile the request's grammar, if any, for this model (off the async runtime: the first one
/// reads the vocabulary, a large schema takes a while).
pub(super) async fn constraint(
    info: &Arc<ModelInfo>,
    checked: &Checked,
) -> Result<Option<Constraint>, ApiError> {
    let Some(grammar) = checked.grammar.clone() else {
        return Ok(None);
    };
    let info = info.clone();
    tokio::task::spawn_blocking(move || info.grammars.compile(&info.tokenizer, grammar))
        .await
        .map_err(|e| ApiError::internal(format!("grammar task failed: {e}")))?
        .map(Some)
}

pub(super) fn check_ids(info: &ModelInfo, ids: &[u32], param: &str) -> Result<(), ApiError> {
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= info.vocab) {
        return Err(ApiError::invalid(
            Some(param),
            format!(
                "token id {bad} is outside the vocabulary (0 to {})",
                info.vocab - 1
            ),
        ));
    }
    Ok(())
}

/// How many tokens may be generated after `prompt_len` tokens; 400 with the numbers when the
/// request does not fit the context.
pub(super) fn fit_context(
    info: &ModelInfo,
    prompt_len: usize,
    max_tokens: Option<u64>,
    what: &str,
) -> Result<usize, ApiError> {
    let ctx = info.context;
    let exceeded = |requested: u64| {
        ApiError::invalid(
            Some(if what == "messages" { "messages" } else { "prompt" }),
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt_len} in the {what}, {requested} in the completion). Please reduce the length of the {what} or the completion.",
                prompt_len as u64 + requested
            ),
        )
        .code("context_length_exceeded")
    };
    match max_tokens {
        Some(m) if prompt_len as u64 + m > ctx as u64 => Err(exceeded(m)),
        Some(m) => Ok(m as usize),
        None if prompt_len >= ctx => Err(exceeded(1)),
        None => Ok(ctx - prompt_len),
    }
}

pub(super) fn token_string(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tok.token_bytes(id)).into_owned()
}
