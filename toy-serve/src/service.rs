//! toy's OpenAI-compatible API as a value: the engine thread that owns the model, and the axum
//! [`Router`] that answers the API. `toy serve` ([`crate::serve`]) puts it behind its own
//! accept loop; an axum app of your own can mount it beside its routes
//! (`toy-serve/examples/own_app.rs`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;

use axum::Router;
use tokio::sync::oneshot;
use toy_kernels::ToyBackend;

use crate::engine::{self, EngineConfig};
use crate::state::{EventLog, Shared};
use crate::{ServeError, ServeOptions, server};

/// One model behind the OpenAI API. Dropping it stops the engine: requests still running fail
/// with an error event, and the thread is joined.
pub struct ModelService {
    shared: Arc<Shared>,
    ready: Option<oneshot::Receiver<Result<(), String>>>,
    engine: Option<JoinHandle<()>>,
}

impl ModelService {
    /// Start the engine thread, which loads `options.model` on `B`, and return at once: until
    /// the model is ready the API answers 503 (`/health` says "loading"); [`Self::ready`] waits
    /// for it. The listening options (`host`, `port`, `read_timeout`, `shutdown_grace`) are
    /// `toy serve`'s, not used here.
    pub fn start<B: ToyBackend>(
        options: &ServeOptions,
        device: B::Device,
    ) -> Result<Self, ServeError> {
        options.check()?;
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
        Ok(ModelService {
            shared,
            ready: Some(ready_rx),
            engine: Some(engine),
        })
    }

    /// Wait until the model is loaded; its load error otherwise. Later calls return at once.
    pub async fn ready(&mut self) -> Result<(), ServeError> {
        let Some(ready) = self.ready.take() else {
            return match self.shared.info.get() {
                Some(_) => Ok(()),
                None => Err(ServeError::Model("the model did not load".into())),
            };
        };
        ready
            .await
            .unwrap_or_else(|_| Err("the engine thread stopped while loading".into()))
            .map_err(ServeError::Model)
    }

    /// The API — `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`,
    /// `/tokenize`, `/detokenize`, `/health`, `/metrics` and the chat page at `/` — with CORS
    /// for `cors_origins` (none: off). Mount it at the root or under a prefix (`nest`).
    pub fn router(&self, cors_origins: &[String]) -> Result<Router, ServeError> {
        server::with_cors(server::router(self.shared.clone()), cors_origins)
            .map_err(ServeError::Options)
    }

    /// The model's name in the API and its context per request, once loaded.
    pub fn model(&self) -> Option<(&str, usize)> {
        self.shared
            .info
            .get()
            .map(|info| (info.id.as_str(), info.context))
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for ModelService {
    fn drop(&mut self) {
        // Fail what is left, close the queue, wait for the thread.
        self.shared.abort.store(true, Ordering::SeqCst);
        self.shared.close_jobs();
        if let Some(engine) = self.engine.take() {
            let _ = engine.join();
        }
    }
}
