//! The router before a model is loaded: what does not need the model (authentication,
//! body limits, JSON errors, unknown routes, 503 while loading) answered by the real
//! handlers in-process.

use super::*;
use axum::body::Body;
use axum::http::{HeaderMap, Request as HttpRequest};
use serde_json::Value;
use std::sync::atomic::Ordering;
use tower::ServiceExt;

fn app(api_key: Option<&str>) -> (Router, Arc<Shared>) {
    let (tx, _rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared::new(
        4,
        api_key.map(str::to_string),
        1024,
        std::time::Duration::from_millis(500),
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
    let (status, _, body) = call(&app, post("/v1/chat/completions", "{}", Some("sesame"))).await;
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

/// A body that stops arriving (slow-loris) is answered 408 at the read timeout, not waited
/// for.
#[tokio::test]
async fn a_trickled_body_times_out() {
    use futures_util::StreamExt;
    let (app, shared) = app(None);
    let first =
        futures_util::stream::iter([Ok::<_, std::io::Error>(axum::body::Bytes::from("{\"pro"))]);
    let body = Body::from_stream(first.chain(futures_util::stream::pending()));
    let started = std::time::Instant::now();
    let (status, _, body) = call(&app, post("/v1/completions", body, None)).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(body["error"]["code"], "request_timeout");
    assert!(started.elapsed() >= shared.read_timeout);
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

/// CORS is off unless asked for: no `Access-Control-Allow-Origin` by default; with `--cors`
/// the named origin's preflight is answered (before authentication) and its requests carry
/// the header, while another origin gets none; a malformed origin is refused.
#[tokio::test]
async fn cors_only_for_the_origins_given() {
    let preflight = || {
        HttpRequest::options("/v1/chat/completions")
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .body(Body::empty())
            .unwrap()
    };
    let health = |origin: &str| {
        HttpRequest::get("/health")
            .header("origin", origin)
            .body(Body::empty())
            .unwrap()
    };
    let allowed = |headers: &HeaderMap| {
        headers
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_string())
    };

    let (plain, _) = app(Some("secret"));
    let (_, headers, _) = call(&plain, health("https://app.example")).await;
    assert_eq!(allowed(&headers), None);
    let (status, headers, _) = call(&plain, preflight()).await;
    assert_ne!(status, StatusCode::OK);
    assert_eq!(allowed(&headers), None);

    let (plain, _) = app(Some("secret"));
    let open = with_cors(plain, &["https://app.example/".to_string()]).unwrap();
    let (status, headers, _) = call(&open, preflight()).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(allowed(&headers).as_deref(), Some("https://app.example"));
    let (_, headers, _) = call(&open, health("https://app.example")).await;
    assert_eq!(allowed(&headers).as_deref(), Some("https://app.example"));
    let (_, headers, _) = call(&open, health("https://evil.example")).await;
    assert_eq!(allowed(&headers), None);

    let (plain, _) = app(None);
    assert!(with_cors(plain, &["bad\norigin".to_string()]).is_err());
}
