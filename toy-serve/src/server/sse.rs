//! The one server-sent-events stream type: a stream state ([`SseSource`]) turned into an SSE
//! response ([`sse`]), and the fields ([`Meta`]) every chunk of a completion stream repeats.

use std::convert::Infallible;

use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};

pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) fingerprint: String,
}

/// Server-sent events from a stream state: each `next` returns one `data:` line.
pub(super) trait SseSource: Send + 'static {
    /// The next event's data, or None at the end.
    fn next_data(&mut self) -> impl std::future::Future<Output = Option<String>> + Send;
}

pub(super) fn sse<S: SseSource>(source: S) -> Response {
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
