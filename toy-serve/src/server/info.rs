//! The small read-only endpoints: the chat page at `/`, `/health`, `/v1/models`,
//! `/v1/models/{id}` and the Prometheus `/metrics`.

use std::sync::atomic::Ordering;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::request::{check_model, ready};
use crate::engine::ModelInfo;
use crate::error::ApiError;

/// The chat page served at `/`.
const PAGE: &str = include_str!("../page.html");

pub(super) async fn page() -> Html<&'static str> {
    Html(PAGE)
}

pub(super) async fn health(State(s): State<AppState>) -> Response {
    if s.shutting_down.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting down"})),
        )
            .into_response();
    }
    match s.info.get() {
        Some(info) => axum::Json(json!({"status": "ok", "model": info.id})).into_response(),
        None => {
            let mut res = (
                StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(json!({"status": "loading model"})),
            )
                .into_response();
            res.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(2));
            res
        }
    }
}

fn model_object(info: &ModelInfo) -> Value {
    json!({
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": "toy",
        "meta": {
            "n_ctx": info.context,
            "n_ctx_train": info.model_context,
            "n_vocab": info.vocab,
            "n_embd": info.d_model,
            "n_params": info.n_params,
        }
    })
}

pub(super) async fn models(State(s): State<AppState>) -> Result<Response, ApiError> {
    let info = ready(&s)?;
    Ok(axum::Json(json!({"object": "list", "data": [model_object(&info)]})).into_response())
}

pub(super) async fn model(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let info = ready(&s)?;
    check_model(&info, Some(&id))?;
    Ok(axum::Json(model_object(&info)).into_response())
}

pub(super) async fn metrics(State(s): State<AppState>) -> Response {
    let text = s.metrics.render(s.in_flight.load(Ordering::SeqCst));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
