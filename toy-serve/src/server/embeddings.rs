//! `/v1/embeddings`: one engine job for all the inputs, answered as floats or base64.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::jobs::engine_error;
use super::request::{check_ids, check_model, encode, read_json, ready};
use super::{AppState, logged};
use crate::api::{EmbeddingRequest, PromptItem};
use crate::engine::Job;
use crate::error::ApiError;

pub(super) async fn embeddings(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let s2 = s.clone();
    logged(s, "embeddings", "emb", async move |log| {
        let req: EmbeddingRequest = read_json(&s2, &headers, body).await?;
        let info = ready(&s2)?;
        check_model(&info, req.model.as_deref())?;
        let base64 = match req.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid(
                    Some("encoding_format"),
                    format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
                ));
            }
        };
        if let Some(d) = req.dimensions
            && d as usize != info.d_model
        {
            return Err(ApiError::invalid(
                Some("dimensions"),
                format!(
                    "this model's embeddings have {} dimensions, not {d}",
                    info.d_model
                ),
            ));
        }
        let items = req.input.items();
        if items.is_empty() {
            return Err(ApiError::invalid(Some("input"), "input is an empty list"));
        }
        if items.len() > 2048 {
            return Err(ApiError::invalid(
                Some("input"),
                format!("at most 2048 inputs per request, got {}", items.len()),
            ));
        }
        let mut inputs = Vec::with_capacity(items.len());
        for item in items {
            let ids = match item {
                PromptItem::Text(t) => encode(&info, t, true, false).await?,
                PromptItem::Ids(ids) => {
                    check_ids(&info, &ids, "input")?;
                    ids
                }
            };
            if ids.is_empty() {
                return Err(ApiError::invalid(Some("input"), "an input is empty"));
            }
            if ids.len() > info.context {
                return Err(ApiError::invalid(
                    Some("input"),
                    format!(
                        "an input of {} tokens is longer than the context of {} tokens",
                        ids.len(),
                        info.context
                    ),
                )
                .code("context_length_exceeded"));
            }
            inputs.push(ids);
        }
        let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
        let _admission = s2
            .try_admit(1)
            .ok_or_else(|| ApiError::overloaded(s2.capacity))?;
        let (tx, rx) = oneshot::channel();
        if !s2.submit(Job::Embed { inputs, tx }) {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
        let vectors = rx
            .await
            .map_err(|_| engine_error(&s2, "the engine stopped".into()))?
            .map_err(|e| engine_error(&s2, e))?;
        if let Some(log) = log {
            log.prompt_tokens = prompt_tokens;
        }
        let data: Vec<Value> = vectors
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                let embedding = if base64 {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    json!(v)
                };
                json!({"object": "embedding", "index": i, "embedding": embedding})
            })
            .collect();
        Ok(axum::Json(json!({
            "object": "list",
            "data": data,
            "model": info.id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }))
        .into_response())
    })
    .await
}
