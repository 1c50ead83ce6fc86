//! llama.cpp's `/tokenize` and `/detokenize`.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::request::{check_ids, encode, read_json, ready, token_string};
use crate::api::{DetokenizeRequest, TokenizeRequest};
use crate::error::ApiError;

/// llama.cpp's `/tokenize`: `{"content", "add_special" (false), "parse_special" (true),
/// "with_pieces" (false)}` → `{"tokens": [ids]}` or `[{"id", "piece"}]`.
pub(super) async fn tokenize(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = read_json(&s, &headers, body).await?;
    let info = ready(&s)?;
    let ids = encode(
        &info,
        req.content,
        req.add_special.unwrap_or(false),
        req.parse_special.unwrap_or(true),
    )
    .await?;
    let tokens: Value = if req.with_pieces.unwrap_or(false) {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": token_string(&info.tokenizer, id)}))
            .collect()
    } else {
        json!(ids)
    };
    Ok(axum::Json(json!({"tokens": tokens})).into_response())
}

/// llama.cpp's `/detokenize`: `{"tokens": [ids]}` → `{"content": text}`.
pub(super) async fn detokenize(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = read_json(&s, &headers, body).await?;
    let info = ready(&s)?;
    check_ids(&info, &req.tokens, "tokens")?;
    Ok(axum::Json(json!({"content": info.tokenizer.decode(&req.tokens)})).into_response())
}
