//! toy-serve: an OpenAI-compatible HTTP server (axum + tokio) for any model toy loads, on any
//! backend.
//!
//! [`serve`] binds the address, starts the engine thread (which loads the model: `/health`
//! answers 503 until it is ready) and serves until SIGINT/SIGTERM. The engine
//! ([`engine`]) owns the model; handlers ([`server`]) queue jobs to it and stream tokens back.
//! See `docs/server.md`.

pub mod api;
pub mod engine;
pub mod error;
mod gbnf;
pub mod grammar;
mod http;
pub mod metrics;
pub mod prefix_cache;
pub mod server;
pub mod state;
pub mod tools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use tokio::sync::oneshot;
use toy_kernels::ToyBackend;

use crate::engine::EngineConfig;
use crate::state::{EventLog, Shared};

/// Everything `toy serve` takes.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub model: PathBuf,
    /// The name clients use (default: the file name without `.gguf`).
    pub model_id: Option<String>,
    pub host: String,
    /// 0 picks a free port (the URL printed says which).
    pub port: u16,
    pub api_key: Option<String>,
    /// Sequences generated at once (`--parallel`), batched into one forward pass per step.
    pub max_concurrency: usize,
    /// Most tokens in one forward pass (decode tokens and prompt chunks together).
    pub batch_tokens: usize,
    /// Requests that may wait for a slot before new ones get 429.
    pub max_queue: usize,
    /// Context per request (None: the model's).
    pub ctx: Option<usize>,
    pub max_body_bytes: usize,
    /// How long a client has to send a request's headers, and then its body (`--read-timeout`):
    /// a slower one is disconnected (headers) or answered 408 (body).
    pub read_timeout: Duration,
    /// Origins whose web pages may call the server (`--cors`; `*`: any). Empty: none.
    pub cors_origins: Vec<String>,
    /// Write `toy/v1` events under this directory (`<dir>/<id>/events.jsonl`).
    pub events_dir: Option<PathBuf>,
    /// How long in-flight requests may take to finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// `cpu`, `ndarray`, … (reported in `system_fingerprint` and events).
    pub backend: String,
    /// A Jinja chat template used instead of the model's `tokenizer.chat_template`.
    pub chat_template: Option<String>,
    /// MiB of keys and values the prefix cache may keep (`--cache-ram`; 0: off).
    pub cache_ram_mib: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source} (is another server using the port? try --port)")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("cannot start the server: {0}")]
    Runtime(std::io::Error),
    #[error("cannot create the event log under {dir}: {source}")]
    Events {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Model(String),
    #[error("--parallel must be at least 1")]
    Concurrency,
    #[error("--batch-tokens must be at least 1")]
    BatchTokens,
    #[error("{0}")]
    Options(String),
}

/// Serve `options.model` on backend `B` until SIGINT/SIGTERM. Prints
/// `toy serve: listening on http://ADDR/` on stdout once the model is ready.
pub fn serve<B: ToyBackend>(options: ServeOptions, device: B::Device) -> Result<(), ServeError> {
    if options.max_concurrency == 0 {
        return Err(ServeError::Concurrency);
    }
    if options.batch_tokens == 0 {
        return Err(ServeError::BatchTokens);
    }
    let model_id = options.model_id.clone().unwrap_or_else(|| {
        options
            .model
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "model".into())
    });
    let events = match &options.events_dir {
        Some(dir) => Some(EventLog::create(dir).map_err(|source| ServeError::Events {
            dir: dir.clone(),
            source,
        })?),
        None => None,
    };
    let (job_tx, job_rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared::new(
        options.max_concurrency + options.max_queue,
        options.api_key.clone(),
        options.max_body_bytes,
        options.read_timeout,
        options.backend.clone(),
        events,
        job_tx,
    ));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("toy-http")
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((
            options.host.as_str(),
            options.port,
        )))
        .map_err(|source| ServeError::Bind {
            addr: format!("{}:{}", options.host, options.port),
            source,
        })?;
    let addr = listener.local_addr().map_err(ServeError::Runtime)?;

    let (ready_tx, ready_rx) = oneshot::channel();
    let engine_config = EngineConfig {
        model_path: options.model.clone(),
        model_id,
        ctx: options.ctx,
        max_concurrency: options.max_concurrency,
        batch_tokens: options.batch_tokens,
        chat_template: options.chat_template.clone(),
        cache_ram: options.cache_ram_mib.saturating_mul(1 << 20),
    };
    let engine_shared = shared.clone();
    let engine = std::thread::Builder::new()
        .name("toy-engine".into())
        .spawn(move || engine::run::<B>(engine_config, device, engine_shared, job_rx, ready_tx))
        .map_err(ServeError::Runtime)?;

    let result = runtime.block_on(run_server(
        listener,
        addr,
        shared.clone(),
        ready_rx,
        &options,
    ));
    // Whatever happened, stop the engine: fail what is left, close its queue, wait for it.
    shared.abort.store(true, Ordering::SeqCst);
    shared.close_jobs();
    let _ = engine.join();
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_server(
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    shared: Arc<Shared>,
    ready: oneshot::Receiver<Result<(), String>>,
    options: &ServeOptions,
) -> Result<(), ServeError> {
    let app = server::with_cors(server::router(shared.clone()), &options.cors_origins)
        .map_err(ServeError::Options)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(http::serve_http(
        listener,
        app,
        options.read_timeout,
        stop_rx.clone(),
    ));
    eprintln!(
        "toy serve: loading {} on {} …",
        options.model.display(),
        options.backend
    );
    let loaded = ready
        .await
        .unwrap_or_else(|_| Err("the engine thread stopped while loading".into()));
    if let Err(e) = loaded {
        let _ = stop_tx.send(true);
        let _ = server.await;
        return Err(ServeError::Model(e));
    }
    let info = shared.info.get().cloned().expect("ready means loaded");
    if let Some(log) = &shared.events {
        log.write(
            "serve_start",
            json!({
                "run_id": log.run_id,
                "model": options.model,
                "model_id": info.id,
                "backend": options.backend,
                "address": addr.to_string(),
                "context": info.context,
                "max_concurrency": options.max_concurrency,
                "batch_tokens": options.batch_tokens,
                "max_queue": options.max_queue,
                "toy_version": env!("CARGO_PKG_VERSION"),
            }),
        );
        eprintln!("toy serve: request events in {}", log.path.display());
    }
    println!(
        "toy serve: listening on http://{addr}/ (model {}, context {}, {} at once; Ctrl-C stops)",
        info.id, info.context, options.max_concurrency
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let started = std::time::Instant::now();
    shutdown_signal().await;
    let in_flight = shared.in_flight.load(Ordering::SeqCst);
    eprintln!(
        "toy serve: shutting down; {in_flight} request(s) in flight get up to {:.0} s to finish",
        options.shutdown_grace.as_secs_f64()
    );
    shared.shutting_down.store(true, Ordering::SeqCst);
    let _ = stop_tx.send(true);
    // After the grace period the engine fails what is left, which ends those responses.
    let grace = options.shutdown_grace;
    let abort_shared = shared.clone();
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        abort_shared.abort.store(true, Ordering::SeqCst);
    });
    let served = server.await;
    if let Some(log) = &shared.events {
        log.write(
            "serve_end",
            json!({"elapsed_s": started.elapsed().as_secs_f64()}),
        );
    }
    served.map_err(|e| ServeError::Runtime(std::io::Error::other(e)))
}

/// SIGINT (Ctrl-C) or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
