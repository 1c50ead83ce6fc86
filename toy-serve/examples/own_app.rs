//! toy's OpenAI-compatible API inside an axum app of your own.
//!
//! ```sh
//! cargo run --release -p toy-serve --example own_app -- MODEL.gguf
//! ```
//!
//! `ModelService` is what `toy serve` runs: an engine thread that owns the model and batches
//! requests, and an axum `Router` for the API. Here the router is mounted under `/llm` beside a
//! route of the app's own; the example then asks its own server one question (as any OpenAI
//! client would, at `http://ADDR/llm/v1`) and exits.

use std::io::{Read, Write};

use axum::Router;
use axum::routing::get;
use toy_serve::{ModelService, ServeOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let model = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: own_app MODEL.gguf"))?;
    // `toy serve`'s defaults; any field can change (`max_concurrency`, `api_key`, `ctx`, …).
    let options = ServeOptions::new(model);
    let mut llm = ModelService::start::<burn::backend::Flex>(&options, Default::default())?;
    llm.ready().await?;
    let (model_id, context) = llm.model().expect("loaded");
    println!("{model_id} loaded ({context} tokens of context)");

    let app = Router::new()
        .route(
            "/",
            get(|| async { "my app; the model answers under /llm/v1" }),
        )
        .nest("/llm", llm.router(&[])?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}/ (OpenAI base URL: http://{addr}/llm/v1)");
    tokio::spawn(async move { axum::serve(listener, app).await });

    // One chat request, as plain HTTP/1.1 (an OpenAI client library would do the same).
    let body = r#"{"messages": [{"role": "user", "content": "Name three colors."}],
                   "max_tokens": 16, "temperature": 0}"#;
    let answer = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
        let mut stream = std::net::TcpStream::connect(addr)?;
        write!(
            stream,
            "POST /llm/v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    })
    .await??;
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let reply: serde_json::Value = serde_json::from_str(json)?;
    println!("{}", reply["choices"][0]["message"]["content"]);
    Ok(())
}
