//! The axum router, its middleware and the per-request logging wrapper. The handlers live in
//! one module per endpoint family:
//!
//! - `info`: the chat page, `/health`, `/v1/models`, `/metrics`;
//! - `tokens`: llama.cpp's `/tokenize` and `/detokenize`;
//! - `embeddings`: `/v1/embeddings`;
//! - `chat`: `/v1/chat/completions`;
//! - `completions`: the legacy `/v1/completions`;
//!
//! with what they share in `request` (reading and checking a request), `jobs` (generation
//! jobs for the engine and their results) and `sse` (the one server-sent-events stream type).

mod chat;
mod completions;
mod embeddings;
mod info;
mod jobs;
mod request;
mod sse;
mod tokens;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use tower_http::catch_panic::CatchPanicLayer;

use crate::error::ApiError;
use crate::state::{RequestLog, Shared};

type AppState = Arc<Shared>;

/// Marks a response whose handler records its own metrics and event (at the end of the body).
#[derive(Clone, Copy)]
struct SelfLogged;

pub fn router(shared: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::chat))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(info::models))
        .route("/v1/models/{id}", get(info::model))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/metrics", get(info::metrics))
        .route_layer(middleware::from_fn_with_state(shared.clone(), auth))
        .route("/", get(info::page))
        .route("/health", get(info::health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(shared.clone(), record))
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::internal("internal error: the handler panicked").into_response()
            },
        ))
        .with_state(shared)
}

/// `app` answering cross-origin requests from `origins` (`--cors`; `*` is any origin): the
/// preflight `OPTIONS` is answered before authentication, and responses carry
/// `Access-Control-Allow-Origin`. No origins: `app` as it is, so browsers keep other sites'
/// pages from calling the server (CORS is off by default). An origin that is not a valid header
/// value is an error naming it.
pub fn with_cors(app: Router, origins: &[String]) -> Result<Router, String> {
    use axum::http::{HeaderValue, Method};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return Ok(app);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let values = origins
            .iter()
            .map(|o| {
                HeaderValue::from_str(o.trim_end_matches('/')).map_err(|_| {
                    format!("--cors {o:?} is not a valid origin (e.g. https://example.com)")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        AllowOrigin::list(values)
    };
    let cors = CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]);
    Ok(app.layer(cors))
}

// ---------------------------------------------------------------------------------------------
// Middleware

/// `Authorization: Bearer KEY` when the server has `--api-key`.
async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        match given {
            None => {
                return ApiError::unauthorized(
                    "no API key: send `Authorization: Bearer <key>` (the key given to --api-key)",
                )
                .into_response();
            }
            Some(k) if !constant_time_eq(k.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Metrics (and a `request` event for API endpoints) for every response that the handler did
/// not record itself.
async fn record(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| endpoint_name(p.as_str()))
        .unwrap_or("other");
    let start = std::time::Instant::now();
    let res = next.run(req).await;
    if res.extensions().get::<SelfLogged>().is_none() {
        let status = res.status().as_u16();
        s.metrics
            .request(endpoint, status, start.elapsed().as_secs_f64());
        let quiet = matches!(endpoint, "health" | "metrics" | "page");
        if let (Some(log), false) = (&s.events, quiet) {
            log.write(
                "request",
                json!({"endpoint": endpoint, "status": status, "latency_s": start.elapsed().as_secs_f64()}),
            );
        }
    }
    res
}

fn endpoint_name(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat",
        "/v1/completions" => "completions",
        "/v1/embeddings" => "embeddings",
        "/v1/models" | "/v1/models/{id}" => "models",
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        "/metrics" => "metrics",
        "/health" => "health",
        "/" => "page",
        _ => "other",
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no endpoint {} {}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::invalid(
            None,
            format!("{} is not allowed on {}", req.method(), req.uri().path()),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers that log themselves

fn self_logged(mut res: Response) -> Response {
    res.extensions_mut().insert(SelfLogged);
    res
}

/// Run a handler body that fills `log`; an error is recorded in it and answered.
async fn logged<F>(s: AppState, endpoint: &'static str, prefix: &str, f: F) -> Response
where
    F: AsyncFnOnce(&mut Option<RequestLog>) -> Result<Response, ApiError>,
{
    let mut log = Some(RequestLog::new(s, endpoint, request::new_id(prefix)));
    let res = match f(&mut log).await {
        Ok(res) => res,
        Err(e) => {
            if let Some(log) = &mut log {
                log.status = e.status.as_u16();
                log.error = Some(e.message.clone());
            }
            e.into_response()
        }
    };
    if let Some(log) = &mut log {
        log.completed = true;
    }
    self_logged(res)
}
