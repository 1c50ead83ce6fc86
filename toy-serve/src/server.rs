//! The axum router and its handlers.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tower_http::catch_panic::CatchPanicLayer;
use toy_core::chat::{self, ChatMessage};
use toy_core::tokenizer::Tokenizer;

use crate::api::{
    ChatRequest, Checked, CompletionRequest, DetokenizeRequest, EmbeddingRequest, PromptItem,
    TokenizeRequest,
};
use crate::engine::{Finish, GenEvent, GenParams, Job, ModelInfo, TokenLogprob};
use crate::error::ApiError;
use crate::state::{Admission, RequestLog, Shared};

type AppState = Arc<Shared>;

/// The chat page served at `/`.
const PAGE: &str = include_str!("page.html");

/// Marks a response whose handler records its own metrics and event (at the end of the body).
#[derive(Clone, Copy)]
struct SelfLogged;

pub fn router(shared: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(shared.clone(), auth))
        .route("/", get(page))
        .route("/health", get(health))
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
// Helpers

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:08x}",
        rand::random::<u64>(),
        rand::random::<u32>()
    )
}

fn fingerprint(s: &Shared) -> String {
    format!("toy-{}-{}", env!("CARGO_PKG_VERSION"), s.backend)
}

/// The loaded model, or 503 while it loads / once shutting down.
fn ready(s: &Shared) -> Result<Arc<ModelInfo>, ApiError> {
    if s.shutting_down.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("the server is shutting down", 5));
    }
    s.info
        .get()
        .cloned()
        .ok_or_else(|| ApiError::unavailable("the model is still loading; retry shortly", 2))
}

fn check_model(info: &ModelInfo, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && m != info.id => Err(ApiError::model_not_found(m, &info.id)),
        _ => Ok(()),
    }
}

/// Read the body (at most `max_body` bytes; a larger one is drained, up to a bound, and
/// answered with 413 so that the client reads the answer instead of a reset) and parse it.
async fn read_json<T: DeserializeOwned>(
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
    while let Some(chunk) = stream.next().await {
        let chunk: Bytes = chunk
            .map_err(|e| ApiError::invalid(None, format!("cannot read the request body: {e}")))?;
        seen += chunk.len();
        if seen > limit {
            if seen > drain_limit {
                break;
            }
            continue;
        }
        buf.extend_from_slice(&chunk);
    }
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
async fn encode(
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

fn check_ids(info: &ModelInfo, ids: &[u32], param: &str) -> Result<(), ApiError> {
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
fn fit_context(
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

fn token_string(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tok.token_bytes(id)).into_owned()
}

/// Queue `jobs` (after taking their places in the admission count).
fn submit(
    s: &Arc<Shared>,
    jobs: Vec<GenParams>,
) -> Result<(mpsc::UnboundedReceiver<(usize, GenEvent)>, Admission), ApiError> {
    if jobs.len() > s.capacity {
        return Err(ApiError::invalid(
            Some("n"),
            format!(
                "this request needs {} sequences but the server takes at most {} at once (--max-concurrency + --max-queue)",
                jobs.len(),
                s.capacity
            ),
        ));
    }
    let admission = s
        .try_admit(jobs.len())
        .ok_or_else(|| ApiError::overloaded(s.capacity))?;
    let (tx, rx) = mpsc::unbounded_channel();
    for params in jobs {
        if !s.submit(Job::Generate {
            params,
            tx: tx.clone(),
        }) {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
    }
    Ok((rx, admission))
}

fn engine_error(s: &Shared, message: String) -> ApiError {
    if s.shutting_down.load(Ordering::SeqCst) {
        ApiError::unavailable(message, 5)
    } else {
        ApiError::internal(message)
    }
}

/// Everything one choice produced.
#[derive(Default)]
struct ChoiceOut {
    text: String,
    ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    prompt_logprobs: Vec<Option<TokenLogprob>>,
    finish: Option<Finish>,
}

/// Wait for every choice to finish.
async fn collect(
    s: &Shared,
    rx: &mut mpsc::UnboundedReceiver<(usize, GenEvent)>,
    n: usize,
) -> Result<Vec<ChoiceOut>, ApiError> {
    let mut out: Vec<ChoiceOut> = (0..n).map(|_| ChoiceOut::default()).collect();
    let mut done = 0;
    while done < n {
        let Some((i, event)) = rx.recv().await else {
            return Err(engine_error(s, "the engine stopped".into()));
        };
        let c = &mut out[i];
        match event {
            GenEvent::PromptLogprobs(lps) => c.prompt_logprobs = lps,
            GenEvent::Token { id, text, logprob } => {
                c.ids.push(id);
                c.text.push_str(&text);
                c.logprobs.extend(logprob);
            }
            GenEvent::Done(f) => {
                c.text.push_str(&f.tail);
                c.finish = Some(f);
                done += 1;
            }
            GenEvent::Error(e) => return Err(engine_error(s, e)),
        }
    }
    Ok(out)
}

fn note_finish(log: &mut RequestLog, f: &Finish) {
    log.completion_tokens += f.completion_tokens;
    log.finish_reason = Some(f.reason.as_str());
    log.queue_s = Some(log.queue_s.unwrap_or(0.0).max(f.queue_s));
    if let Some(t) = f.ttft_s {
        log.ttft_s = Some(log.ttft_s.map_or(t, |x: f64| x.min(t)));
    }
}

fn self_logged(mut res: Response) -> Response {
    res.extensions_mut().insert(SelfLogged);
    res
}

/// Run a handler body that fills `log`; an error is recorded in it and answered.
async fn logged<F>(s: AppState, endpoint: &'static str, prefix: &str, f: F) -> Response
where
    F: AsyncFnOnce(&mut Option<RequestLog>) -> Result<Response, ApiError>,
{
    let mut log = Some(RequestLog::new(s, endpoint, new_id(prefix)));
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

// ---------------------------------------------------------------------------------------------
// Small endpoints

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn health(State(s): State<AppState>) -> Response {
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

async fn models(State(s): State<AppState>) -> Result<Response, ApiError> {
    let info = ready(&s)?;
    Ok(axum::Json(json!({"object": "list", "data": [model_object(&info)]})).into_response())
}

async fn model(State(s): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let info = ready(&s)?;
    check_model(&info, Some(&id))?;
    Ok(axum::Json(model_object(&info)).into_response())
}

async fn metrics(State(s): State<AppState>) -> Response {
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

/// llama.cpp's `/tokenize`: `{"content", "add_special" (false), "parse_special" (true),
/// "with_pieces" (false)}` → `{"tokens": [ids]}` or `[{"id", "piece"}]`.
async fn tokenize(
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
async fn detokenize(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = read_json(&s, &headers, body).await?;
    let info = ready(&s)?;
    check_ids(&info, &req.tokens, "tokens")?;
    Ok(axum::Json(json!({"content": info.tokenizer.decode(&req.tokens)})).into_response())
}

// ---------------------------------------------------------------------------------------------
// Embeddings

async fn embeddings(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
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

// ---------------------------------------------------------------------------------------------
// Chat completions

fn chat_logprob_entry(tok: &Tokenizer, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, logprob: f32| {
        json!({
            "token": token_string(tok, id),
            "logprob": logprob,
            "bytes": tok.token_bytes(id),
        })
    };
    let mut e = entry(lp.id, lp.logprob);
    e["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
    e
}

async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let s2 = s.clone();
    logged(s, "chat", "chatcmpl", async move |log| {
        let req: ChatRequest = read_json(&s2, &headers, body).await?;
        let info = ready(&s2)?;
        check_model(&info, req.model.as_deref())?;
        if let Some(fmt) = &req.response_format {
            match fmt.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some(kind @ ("json_object" | "json_schema")) => {
                    return Err(ApiError::invalid(
                        Some("response_format"),
                        format!(
                            "response_format {kind:?} is not supported: toy has no constrained (grammar) decoding, so it cannot guarantee JSON; ask for JSON in the prompt and parse the text yourself"
                        ),
                    ));
                }
                _ => {
                    return Err(ApiError::invalid(
                        Some("response_format"),
                        "response_format must be {\"type\": \"text\"}",
                    ));
                }
            }
        }
        if req
            .tools
            .as_ref()
            .is_some_and(|t| t.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(ApiError::invalid(
                Some("tools"),
                "tools (function calling) are not supported by toy serve",
            ));
        }
        if req.messages.is_empty() {
            return Err(ApiError::invalid(
                Some("messages"),
                "messages must contain at least one message",
            ));
        }
        let checked = req.sampling.check(info.vocab)?;
        let top_logprobs = req.top_logprobs.unwrap_or(0);
        if top_logprobs > 20 {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("top_logprobs must be between 0 and 20, got {top_logprobs}"),
            ));
        }
        let want_logprobs = req.logprobs.unwrap_or(false);
        if req.top_logprobs.is_some() && !want_logprobs {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs: true",
            ));
        }
        let max_tokens = req.max_completion_tokens.or(req.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "max_tokens must be at least 1",
            ));
        }
        let mut messages = Vec::with_capacity(req.messages.len());
        for (i, m) in req.messages.iter().enumerate() {
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            messages.push(ChatMessage::new(role, m.text(i)?));
        }
        let template = info.tokenizer.chat_template().ok_or_else(|| {
            ApiError::invalid(
                Some("messages"),
                "this model has no chat template (tokenizer.chat_template): use /v1/completions",
            )
        })?;
        let prompt_text = chat::render(
            template,
            &messages,
            true,
            info.tokenizer.bos_text().unwrap_or_default(),
            info.tokenizer.eos_text().unwrap_or_default(),
        )
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
        // As `toy infer --chat` and llama.cpp tokenize a rendered chat.
        let prompt = encode(&info, prompt_text, true, true).await?;
        let max_new = fit_context(&info, prompt.len(), max_tokens, "messages")?;
        let jobs = gen_jobs(
            std::slice::from_ref(&prompt),
            &checked,
            max_new,
            want_logprobs.then_some(top_logprobs as usize),
            false,
        );
        let (mut rx, admission) = submit(&s2, jobs)?;
        let l = log.as_mut().expect("log");
        l.prompt_tokens = prompt.len();
        l.stream = checked.stream;
        let meta = Meta {
            id: l.id.clone(),
            created: unix_now(),
            model: info.id.clone(),
            fingerprint: fingerprint(&s2),
        };
        if checked.stream {
            let stream = ChatStream {
                meta,
                info: info.clone(),
                shared: s2.clone(),
                rx,
                n: checked.n,
                done: 0,
                prompt_tokens: prompt.len(),
                completion_tokens: 0,
                include_usage: checked.include_usage,
                logprobs: want_logprobs,
                out: VecDeque::new(),
                opened: false,
                finished: false,
                log: log.take(),
                _admission: admission,
            };
            return Ok(sse(stream));
        }
        let choices = collect(&s2, &mut rx, checked.n).await?;
        drop(admission);
        let mut completion_tokens = 0;
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let f = c.finish.expect("collected");
                completion_tokens += f.completion_tokens;
                note_finish(l, &f);
                let logprobs = if want_logprobs {
                    json!({
                        "content": c.logprobs.iter().map(|lp| chat_logprob_entry(&info.tokenizer, lp)).collect::<Vec<_>>(),
                        "refusal": null,
                    })
                } else {
                    Value::Null
                };
                json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text, "refusal": null},
                    "logprobs": logprobs,
                    "finish_reason": f.reason.as_str(),
                })
            })
            .collect();
        Ok(axum::Json(json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": choices,
            "usage": usage(prompt.len(), completion_tokens),
        }))
        .into_response())
    })
    .await
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// One engine job per prompt × `n` (index = prompt × n + choice), seeds seed, seed+1, ….
fn gen_jobs(
    prompts: &[Vec<u32>],
    checked: &Checked,
    max_tokens: usize,
    logprobs: Option<usize>,
    prompt_logprobs: bool,
) -> Vec<GenParams> {
    let mut jobs = Vec::new();
    for prompt in prompts {
        for j in 0..checked.n {
            let mut sampling = checked.params.clone();
            sampling.seed = sampling.seed.wrapping_add(j as u64);
            jobs.push(GenParams {
                index: jobs.len(),
                prompt: prompt.clone(),
                max_tokens,
                sampling,
                logit_bias: checked.logit_bias.clone(),
                stop: checked.stop.clone(),
                logprobs,
                prompt_logprobs,
                ignore_eos: checked.ignore_eos,
            });
        }
    }
    jobs
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
}

/// Server-sent events from a stream state: each `next` returns one `data:` line.
trait SseSource: Send + 'static {
    /// The next event's data, or None at the end.
    fn next_data(&mut self) -> impl std::future::Future<Output = Option<String>> + Send;
}

fn sse<S: SseSource>(source: S) -> Response {
    let stream = futures_util::stream::unfold(source, |mut src| async move {
        src.next_data()
            .await
            .map(|data| (Ok::<_, Infallible>(Event::default().data(data)), src))
    });
    let mut res = Sse::new(stream).into_response();
    res.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    res
}

struct ChatStream {
    meta: Meta,
    info: Arc<ModelInfo>,
    shared: AppState,
    rx: mpsc::UnboundedReceiver<(usize, GenEvent)>,
    n: usize,
    done: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    include_usage: bool,
    logprobs: bool,
    out: VecDeque<String>,
    opened: bool,
    finished: bool,
    log: Option<RequestLog>,
    _admission: Admission,
}

impl ChatStream {
    fn chunk(&self, choices: Value) -> String {
        let mut c = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": choices,
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }

    fn delta(&self, index: usize, delta: Value, logprobs: Value, finish: Option<&str>) -> String {
        self.chunk(json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }]))
    }
}

impl SseSource for ChatStream {
    async fn next_data(&mut self) -> Option<String> {
        if !self.opened {
            // Open every choice with the assistant role, as OpenAI does.
            self.opened = true;
            for i in 0..self.n {
                let d = self.delta(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    None,
                );
                self.out.push_back(d);
            }
        }
        if self.out.is_empty() && !self.finished {
            self.fill().await;
        }
        self.out.pop_front()
    }
}

impl ChatStream {
    async fn fill(&mut self) {
        while self.out.is_empty() && !self.finished {
            let Some((i, event)) = self.rx.recv().await else {
                let e = engine_error(&self.shared, "the engine stopped".into());
                self.fail(e);
                return;
            };
            match event {
                GenEvent::PromptLogprobs(_) => {}
                GenEvent::Token { text, logprob, .. } => {
                    let lp = match (&logprob, self.logprobs) {
                        (Some(lp), true) => json!({
                            "content": [chat_logprob_entry(&self.info.tokenizer, lp)],
                            "refusal": null,
                        }),
                        _ => Value::Null,
                    };
                    if !text.is_empty() || !lp.is_null() {
                        let d = self.delta(i, json!({"content": text}), lp, None);
                        self.out.push_back(d);
                    }
                }
                GenEvent::Done(f) => {
                    if !f.tail.is_empty() {
                        let d = self.delta(i, json!({"content": f.tail}), Value::Null, None);
                        self.out.push_back(d);
                    }
                    let d = self.delta(i, json!({}), Value::Null, Some(f.reason.as_str()));
                    self.out.push_back(d);
                    self.completion_tokens += f.completion_tokens;
                    if let Some(log) = &mut self.log {
                        note_finish(log, &f);
                    }
                    self.done += 1;
                    if self.done == self.n {
                        if self.include_usage {
                            let mut c: Value =
                                serde_json::from_str(&self.chunk(json!([]))).unwrap_or_default();
                            c["usage"] = usage(self.prompt_tokens, self.completion_tokens);
                            self.out.push_back(c.to_string());
                        }
                        self.out.push_back("[DONE]".into());
                        self.finished = true;
                        if let Some(log) = &mut self.log {
                            log.completed = true;
                        }
                    }
                }
                GenEvent::Error(message) => {
                    let e = engine_error(&self.shared, message);
                    self.fail(e);
                }
            }
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.out.push_back(e.body().to_string());
        self.finished = true;
        if let Some(log) = &mut self.log {
            log.status = e.status.as_u16();
            log.error = Some(e.message);
            log.completed = true;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Completions

/// OpenAI's legacy `logprobs` object for a run of tokens starting at text offset `offset`.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, tok: &Tokenizer, id: u32, lp: Option<&TokenLogprob>, offset: &mut usize) {
        let s = token_string(tok, id);
        self.text_offset.push(*offset);
        *offset += s.chars().count();
        self.tokens.push(s);
        self.token_logprobs.push(lp.map(|l| l.logprob));
        self.top_logprobs.push(match lp {
            None => Value::Null,
            Some(l) => {
                let mut m = serde_json::Map::new();
                for &(id, v) in &l.top {
                    m.entry(token_string(tok, id)).or_insert(json!(v));
                }
                Value::Object(m)
            }
        });
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let s2 = s.clone();
    logged(s, "completions", "cmpl", async move |log| {
        let req: CompletionRequest = read_json(&s2, &headers, body).await?;
        let info = ready(&s2)?;
        check_model(&info, req.model.as_deref())?;
        if req.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
            return Err(ApiError::invalid(
                Some("suffix"),
                "suffix (insertion) is not supported by toy serve",
            ));
        }
        if req.best_of.is_some_and(|b| b > 1) {
            return Err(ApiError::invalid(
                Some("best_of"),
                "best_of is not supported by toy serve; use n",
            ));
        }
        let checked = req.sampling.check(info.vocab)?;
        let logprobs = req.logprobs.map(|k| k as usize);
        if logprobs.is_some_and(|k| k > 20) {
            return Err(ApiError::invalid(
                Some("logprobs"),
                "logprobs must be between 0 and 20",
            ));
        }
        let echo = req.echo.unwrap_or(false);
        let items = req.prompt.items();
        if items.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "prompt is an empty list"));
        }
        if items.len() * checked.n > 64 {
            return Err(ApiError::invalid(
                Some("prompt"),
                "at most 64 sequences (prompts × n) per request",
            ));
        }
        // OpenAI's default for completions is 16 tokens.
        let max_tokens = req.max_tokens.unwrap_or(16);
        if max_tokens == 0 && !echo {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "max_tokens 0 only makes sense with echo (scoring the prompt)",
            ));
        }
        let mut prompts = Vec::new();
        let mut echo_texts = Vec::new();
        for item in items {
            let (ids, text) = match item {
                PromptItem::Text(t) => (encode(&info, t.clone(), true, true).await?, t),
                PromptItem::Ids(ids) => {
                    check_ids(&info, &ids, "prompt")?;
                    let text = info.tokenizer.decode(&ids);
                    (ids, text)
                }
            };
            if ids.is_empty() {
                return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
            }
            fit_context(&info, ids.len(), Some(max_tokens), "prompt")?;
            prompts.push(ids);
            echo_texts.push(text);
        }
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        let jobs = gen_jobs(
            &prompts,
            &checked,
            max_tokens as usize,
            logprobs,
            echo && logprobs.is_some(),
        );
        let (mut rx, admission) = submit(&s2, jobs)?;
        let l = log.as_mut().expect("log");
        l.prompt_tokens = prompt_tokens;
        l.stream = checked.stream;
        let meta = Meta {
            id: l.id.clone(),
            created: unix_now(),
            model: info.id.clone(),
            fingerprint: fingerprint(&s2),
        };
        let n = checked.n;
        if checked.stream {
            let total = prompts.len() * n;
            let stream = CompletionStream {
                meta,
                info: info.clone(),
                shared: s2.clone(),
                rx,
                total,
                done: 0,
                prompt_tokens,
                completion_tokens: 0,
                include_usage: checked.include_usage,
                logprobs: logprobs.is_some(),
                echo: echo.then(|| (0..total).map(|i| echo_texts[i / n].clone()).collect()),
                prompts: (0..total).map(|i| prompts[i / n].clone()).collect(),
                offsets: vec![0; total],
                out: VecDeque::new(),
                finished: false,
                log: log.take(),
                _admission: admission,
            };
            return Ok(sse(stream));
        }
        let outs = collect(&s2, &mut rx, prompts.len() * n).await?;
        drop(admission);
        let mut completion_tokens = 0;
        let mut choices = Vec::new();
        for (i, c) in outs.into_iter().enumerate() {
            let f = c.finish.expect("collected");
            completion_tokens += f.completion_tokens;
            note_finish(l, &f);
            let mut text = String::new();
            let mut lps = LegacyLogprobs::default();
            let mut offset = 0;
            if echo {
                text.push_str(&echo_texts[i / n]);
                if logprobs.is_some() {
                    let p = &prompts[i / n];
                    for (k, &id) in p.iter().enumerate() {
                        let lp = c.prompt_logprobs.get(k).and_then(Option::as_ref);
                        lps.push(&info.tokenizer, id, lp, &mut offset);
                    }
                }
            }
            text.push_str(&c.text);
            if logprobs.is_some() {
                for (id, lp) in c.ids.iter().zip(&c.logprobs) {
                    lps.push(&info.tokenizer, *id, Some(lp), &mut offset);
                }
            }
            choices.push(json!({
                "text": text,
                "index": i,
                "logprobs": if logprobs.is_some() { lps.json() } else { Value::Null },
                "finish_reason": f.reason.as_str(),
            }));
        }
        Ok(axum::Json(json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }))
        .into_response())
    })
    .await
}

struct CompletionStream {
    meta: Meta,
    info: Arc<ModelInfo>,
    shared: AppState,
    rx: mpsc::UnboundedReceiver<(usize, GenEvent)>,
    total: usize,
    done: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    include_usage: bool,
    logprobs: bool,
    /// Prompt texts still to echo, per choice.
    echo: Option<Vec<String>>,
    prompts: Vec<Vec<u32>>,
    offsets: Vec<usize>,
    out: VecDeque<String>,
    finished: bool,
    log: Option<RequestLog>,
    _admission: Admission,
}

impl CompletionStream {
    fn chunk(&self, index: usize, text: &str, logprobs: Value, finish: Option<&str>) -> String {
        let mut c = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }

    fn fail(&mut self, e: ApiError) {
        self.out.push_back(e.body().to_string());
        self.finished = true;
        if let Some(log) = &mut self.log {
            log.status = e.status.as_u16();
            log.error = Some(e.message);
            log.completed = true;
        }
    }

    async fn fill(&mut self) {
        // Echoed prompts come first (without logprobs, those come with PromptLogprobs).
        // (With logprobs the prompt is sent when its logprobs arrive.)
        if !self.logprobs
            && let Some(echo) = self.echo.take()
        {
            for (i, text) in echo.iter().enumerate() {
                let c = self.chunk(i, text, Value::Null, None);
                self.out.push_back(c);
            }
        }
        while self.out.is_empty() && !self.finished {
            let Some((i, event)) = self.rx.recv().await else {
                let e = engine_error(&self.shared, "the engine stopped".into());
                self.fail(e);
                return;
            };
            match event {
                GenEvent::PromptLogprobs(lps) => {
                    let text = self.echo.as_ref().map(|e| e[i].clone()).unwrap_or_default();
                    let mut l = LegacyLogprobs::default();
                    let prompt = self.prompts[i].clone();
                    for (k, id) in prompt.into_iter().enumerate() {
                        let lp = lps.get(k).and_then(Option::as_ref);
                        l.push(&self.info.tokenizer, id, lp, &mut self.offsets[i]);
                    }
                    let c = self.chunk(i, &text, l.json(), None);
                    self.out.push_back(c);
                }
                GenEvent::Token { id, text, logprob } => {
                    let lp = if self.logprobs {
                        let mut l = LegacyLogprobs::default();
                        l.push(
                            &self.info.tokenizer,
                            id,
                            logprob.as_ref(),
                            &mut self.offsets[i],
                        );
                        l.json()
                    } else {
                        Value::Null
                    };
                    if !text.is_empty() || self.logprobs {
                        let c = self.chunk(i, &text, lp, None);
                        self.out.push_back(c);
                    }
                }
                GenEvent::Done(f) => {
                    let c = self.chunk(i, &f.tail, Value::Null, Some(f.reason.as_str()));
                    self.out.push_back(c);
                    self.completion_tokens += f.completion_tokens;
                    if let Some(log) = &mut self.log {
                        note_finish(log, &f);
                    }
                    self.done += 1;
                    if self.done == self.total {
                        if self.include_usage {
                            let c = json!({
                                "id": self.meta.id,
                                "object": "text_completion",
                                "created": self.meta.created,
                                "model": self.meta.model,
                                "system_fingerprint": self.meta.fingerprint,
                                "choices": [],
                                "usage": usage(self.prompt_tokens, self.completion_tokens),
                            });
                            self.out.push_back(c.to_string());
                        }
                        self.out.push_back("[DONE]".into());
                        self.finished = true;
                        if let Some(log) = &mut self.log {
                            log.completed = true;
                        }
                    }
                }
                GenEvent::Error(message) => {
                    let e = engine_error(&self.shared, message);
                    self.fail(e);
                }
            }
        }
    }
}

impl SseSource for CompletionStream {
    async fn next_data(&mut self) -> Option<String> {
        if self.out.is_empty() && !self.finished {
            self.fill().await;
        }
        self.out.pop_front()
    }
}

#[cfg(test)]
mod tests {
    //! The router before a model is loaded: what does not need the model (authentication,
    //! body limits, JSON errors, unknown routes, 503 while loading) answered by the real
    //! handlers in-process.

    use super::*;
    use axum::http::Request as HttpRequest;
    use tower::ServiceExt;

    fn app(api_key: Option<&str>) -> (Router, Arc<Shared>) {
        let (tx, _rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::new(
            4,
            api_key.map(str::to_string),
            1024,
            "cpu".into(),
            None,
            tx,
        ));
        (router(shared.clone()), shared)
    }

    async fn call(app: &Router, req: HttpRequest<Body>) -> (StatusCode, HeaderMap, Value) {
        let res = app.clone().oneshot(req).await.expect("infallible");
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .expect("body");
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, headers, json)
    }

    fn post(path: &str, body: impl Into<Body>, key: Option<&str>) -> HttpRequest<Body> {
        let mut b = HttpRequest::post(path).header("content-type", "application/json");
        if let Some(k) = key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        b.body(body.into()).expect("request")
    }

    #[tokio::test]
    async fn loading_answers_503_with_retry_after() {
        let (app, _) = app(None);
        let (status, headers, body) = call(
            &app,
            HttpRequest::get("/health").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(headers.contains_key(header::RETRY_AFTER));
        assert_eq!(body["status"], "loading model");
        let (status, headers, body) = call(
            &app,
            HttpRequest::get("/v1/models").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(headers.contains_key(header::RETRY_AFTER));
        assert_eq!(body["error"]["code"], "service_unavailable");
        let req = post(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"hi"}]}"#,
            None,
        );
        assert_eq!(call(&app, req).await.0, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn api_key_is_required_on_the_api_only() {
        let (app, _) = app(Some("sesame"));
        let (status, _, body) = call(&app, post("/v1/chat/completions", "{}", None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");
        let (status, _, _) = call(&app, post("/v1/embeddings", "{}", Some("wrong"))).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        // The right key gets through to the handler (here: 400 for a body without messages).
        let (status, _, body) =
            call(&app, post("/v1/chat/completions", "{}", Some("sesame"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        // The page and the health check stay open.
        let (status, _, _) = call(&app, HttpRequest::get("/").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        let (status, _, _) = call(
            &app,
            HttpRequest::get("/health").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn bad_bodies_get_openai_errors() {
        let (app, _) = app(None);
        let (status, _, body) =
            call(&app, post("/v1/chat/completions", "{\"messages\": [", None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "invalid_json");
        let (status, _, body) = call(&app, post("/v1/completions", "", None)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body["error"]["message"].as_str().unwrap().contains("empty"));
        let (status, _, body) = call(
            &app,
            post("/v1/chat/completions", r#"{"messages": 3}"#, None),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("invalid request")
        );
        let big = format!("{{\"prompt\": \"{}\"}}", "x".repeat(4096));
        let (status, _, body) = call(&app, post("/v1/completions", big, None)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(body["error"]["code"], "request_too_large");
    }

    #[tokio::test]
    async fn unknown_routes_and_methods() {
        let (app, _) = app(None);
        let (status, _, body) = call(
            &app,
            HttpRequest::get("/v1/nothing").body(Body::empty()).unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body["error"]["type"], "not_found_error");
        let (status, _, body) = call(
            &app,
            HttpRequest::get("/v1/chat/completions")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert!(body["error"]["message"].is_string());
    }

    #[tokio::test]
    async fn metrics_count_requests_by_endpoint_and_status() {
        let (app, shared) = app(None);
        call(&app, post("/v1/chat/completions", "not json", None)).await;
        call(&app, post("/v1/chat/completions", "not json", None)).await;
        let res = app
            .clone()
            .oneshot(HttpRequest::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert!(
            res.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .starts_with("text/plain; version=0.0.4")
        );
        let text = String::from_utf8(
            axum::body::to_bytes(res.into_body(), 1 << 20)
                .await
                .unwrap()
                .to_vec(),
        )
        .unwrap();
        assert!(
            text.contains("toy_requests_total{endpoint=\"chat\",status=\"400\"} 2"),
            "{text}"
        );
        assert!(text.contains("toy_request_duration_seconds_count{endpoint=\"chat\"} 2"));
        assert!(text.contains("toy_requests_in_flight 0"));
        assert_eq!(shared.in_flight.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn admission_is_bounded_and_given_back() {
        let (_, shared) = app(None);
        let a = shared.try_admit(3).expect("3 of 4");
        assert!(shared.try_admit(2).is_none(), "5 > 4");
        let b = shared.try_admit(1).expect("4 of 4");
        drop(a);
        assert!(shared.try_admit(3).is_some());
        drop(b);
        assert_eq!(shared.in_flight.load(Ordering::SeqCst), 0);
    }
}
