//! toy-serve: an OpenAI-compatible HTTP server (axum + tokio) for any model toy loads, on any
//! backend.
//!
//! [`serve`] binds the address, starts the engine thread (which loads the model: `/health`
//! answers 503 until it is ready) and serves until SIGINT/SIGTERM. The engine
//! ([`engine`]) owns the model; handlers ([`server`]) queue jobs to it and stream tokens back.
//! [`ModelService`] is the same engine and API as an axum `Router` for an app of your own
//! (`examples/own_app.rs`). See `docs/server.md`.

pub mod api;
pub mod engine;
pub mod error;
mod gbnf;
pub mod grammar;
mod http;
pub mod metrics;
pub mod prefix_cache;
pub mod server;
mod service;
pub mod state;
pub mod tools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use toy_kernels::ToyBackend;

pub use crate::service::ModelService;

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

impl ServeOptions {
    // `toy serve`'s defaults: the CLI's flags take theirs from here.
    pub const DEFAULT_HOST: &'static str = "127.0.0.1";
    pub const DEFAULT_PORT: u16 = 8080;
    pub const DEFAULT_PARALLEL: usize = 8;
    pub const DEFAULT_BATCH_TOKENS: usize = 512;
    pub const DEFAULT_MAX_QUEUE: usize = 64;
    pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
    pub const DEFAULT_READ_TIMEOUT_S: f64 = 30.0;
    pub const DEFAULT_SHUTDOWN_GRACE_S: f64 = 10.0;
    pub const DEFAULT_CACHE_RAM_MIB: usize = 1024;

    /// `toy serve`'s defaults for `model`: 127.0.0.1:8080, no key, 8 sequences at once, 512
    /// tokens per pass, 64 waiting, the model's context, 4 MiB bodies, 30 s read timeout, no
    /// CORS, no events, 10 s shutdown grace, a 1 GiB prefix cache.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        ServeOptions {
            model: model.into(),
            model_id: None,
            host: Self::DEFAULT_HOST.into(),
            port: Self::DEFAULT_PORT,
            api_key: None,
            max_concurrency: Self::DEFAULT_PARALLEL,
            batch_tokens: Self::DEFAULT_BATCH_TOKENS,
            max_queue: Self::DEFAULT_MAX_QUEUE,
            ctx: None,
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            read_timeout: Duration::from_secs_f64(Self::DEFAULT_READ_TIMEOUT_S),
            cors_origins: Vec::new(),
            events_dir: None,
            shutdown_grace: Duration::from_secs_f64(Self::DEFAULT_SHUTDOWN_GRACE_S),
            backend: "cpu".into(),
            chat_template: None,
            cache_ram_mib: Self::DEFAULT_CACHE_RAM_MIB,
        }
    }

    fn check(&self) -> Result<(), ServeError> {
        if self.max_concurrency == 0 {
            return Err(ServeError::Concurrency);
        }
        if self.batch_tokens == 0 {
            return Err(ServeError::BatchTokens);
        }
        Ok(())
    }
}

/// Serve `options.model` on backend `B` until SIGINT/SIGTERM. Prints
/// `toy serve: listening on http://ADDR/` on stdout once the model is ready.
pub fn serve<B: ToyBackend>(options: ServeOptions, device: B::Device) -> Result<(), ServeError> {
    options.check()?;
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
    let mut service = ModelService::start::<B>(&options, device)?;
    let result = runtime.block_on(run_server(listener, addr, &mut service, &options));
    // Whatever happened, stop the engine (dropping the service fails what is left and joins it).
    drop(service);
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_server(
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    service: &mut ModelService,
    options: &ServeOptions,
) -> Result<(), ServeError> {
    let shared = service.shared().clone();
    let app = service.router(&options.cors_origins)?;
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
    if let Err(e) = service.ready().await {
        let _ = stop_tx.send(true);
        let _ = server.await;
        return Err(e);
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
