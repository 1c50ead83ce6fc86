//! OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` with the matching
//! HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is wrong (names the offending parameter when there is one).
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        ApiError {
            param: param.map(str::to_string),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message).code("invalid_api_key")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            ..Self::not_found(format!(
                "The model `{model}` does not exist: this server serves `{served}` (GET /v1/models)"
            ))
            .code("model_not_found")
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request body is larger than {limit} bytes (the server's --max-body-bytes)"
            ),
        )
        .code("request_too_large")
    }

    /// 408: the body did not arrive within the server's read timeout.
    pub fn timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {:.0} s (the server's --read-timeout)",
                limit.as_secs_f64()
            ),
        )
        .code("request_timeout")
    }

    pub fn overloaded(capacity: usize) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!(
                    "the server is at capacity ({capacity} requests running or queued); retry later"
                ),
            )
            .code("server_overloaded")
        }
    }

    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                .code("service_unavailable")
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        res
    }
}
