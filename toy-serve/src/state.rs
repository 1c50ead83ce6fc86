//! State shared by the HTTP handlers and the engine thread, the `request` event log, and the
//! guard that holds a request's place in the admission count.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::engine::{Job, ModelInfo};
use crate::metrics::Metrics;

pub struct Shared {
    /// Set once the model is loaded.
    pub info: OnceLock<Arc<ModelInfo>>,
    /// Set by SIGINT/SIGTERM: new requests get 503.
    pub shutting_down: AtomicBool,
    /// Set when the shutdown grace period is over: the engine fails what is left.
    pub abort: AtomicBool,
    /// Generation and embedding requests accepted and not yet answered.
    pub in_flight: AtomicUsize,
    /// Most requests accepted at once (`max_concurrency` running + `max_queue` waiting).
    pub capacity: usize,
    pub api_key: Option<String>,
    /// Largest request body, in bytes.
    pub max_body: usize,
    /// How long reading a request's body may take (a trickled one gets 408).
    pub read_timeout: Duration,
    pub backend: String,
    pub metrics: Metrics,
    pub events: Option<EventLog>,
    jobs: Mutex<Option<Sender<(Job, Instant)>>>,
}

impl Shared {
    pub fn new(
        capacity: usize,
        api_key: Option<String>,
        max_body: usize,
        read_timeout: Duration,
        backend: String,
        events: Option<EventLog>,
        jobs: Sender<(Job, Instant)>,
    ) -> Self {
        Shared {
            info: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            abort: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            capacity,
            api_key,
            max_body,
            read_timeout,
            backend,
            metrics: Metrics::default(),
            events,
            jobs: Mutex::new(Some(jobs)),
        }
    }

    /// Queue a job for the engine; false when the engine is gone.
    pub fn submit(&self, job: Job) -> bool {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.as_ref() {
            Some(tx) => tx.send((job, Instant::now())).is_ok(),
            None => false,
        }
    }

    /// Close the job channel: the engine finishes what it has and exits.
    pub fn close_jobs(&self) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Take `n` places in the admission count, or none if that would go over capacity.
    pub fn try_admit(self: &Arc<Self>, n: usize) -> Option<Admission> {
        let mut cur = self.in_flight.load(Ordering::SeqCst);
        loop {
            if cur + n > self.capacity {
                return None;
            }
            match self
                .in_flight
                .compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    return Some(Admission {
                        shared: self.clone(),
                        n,
                    });
                }
                Err(now) => cur = now,
            }
        }
    }
}

/// Places in the admission count, given back when dropped (response sent, stream ended or
/// client gone).
pub struct Admission {
    shared: Arc<Shared>,
    n: usize,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(self.n, Ordering::SeqCst);
    }
}

/// `runs/<id>/events.jsonl` of a `toy serve --events` run: `toy/v1` lines (see docs/events.md).
pub struct EventLog {
    file: Mutex<File>,
    pub path: PathBuf,
    pub run_id: String,
}

impl EventLog {
    /// Create `dir/<id>/events.jsonl` with a fresh id (`serve-<unix time>-<pid>`).
    pub fn create(dir: &std::path::Path) -> std::io::Result<Self> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let run_id = format!("serve-{secs}-{}", std::process::id());
        let run_dir = dir.join(&run_id);
        std::fs::create_dir_all(&run_dir)?;
        let path = run_dir.join("events.jsonl");
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)?;
        Ok(EventLog {
            file: Mutex::new(file),
            path,
            run_id,
        })
    }

    /// Write `{"schema":"toy/v1","time":…,"event":kind, …fields}` as one line. A failed write
    /// is reported in the log and otherwise ignored: serving matters more than the log.
    pub fn write(&self, kind: &str, fields: Value) {
        let mut line = json!({
            "schema": "toy/v1",
            "time": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
            "event": kind,
        });
        if let (Some(obj), Value::Object(extra)) = (line.as_object_mut(), fields) {
            obj.extend(extra);
        }
        let mut text = line.to_string();
        text.push('\n');
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = file.write_all(text.as_bytes()).and_then(|_| file.flush()) {
            tracing::warn!("cannot write to {}: {e}", self.path.display());
        }
    }
}

/// What a request did, recorded in `/metrics` and as a `request` event when it is dropped:
/// after the response, at the end of a stream, or when the client goes away.
pub struct RequestLog {
    shared: Arc<Shared>,
    pub id: String,
    pub endpoint: &'static str,
    start: Instant,
    pub status: u16,
    pub stream: bool,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: Option<&'static str>,
    pub ttft_s: Option<f64>,
    pub queue_s: Option<f64>,
    /// The response was not delivered completely (client gone mid-stream).
    pub completed: bool,
    pub error: Option<String>,
}

impl RequestLog {
    pub fn new(shared: Arc<Shared>, endpoint: &'static str, id: String) -> Self {
        RequestLog {
            shared,
            id,
            endpoint,
            start: Instant::now(),
            status: 200,
            stream: false,
            prompt_tokens: 0,
            completion_tokens: 0,
            finish_reason: None,
            ttft_s: None,
            queue_s: None,
            completed: false,
            error: None,
        }
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let seconds = self.start.elapsed().as_secs_f64();
        // A client that left before the end is counted under 499 (nginx's "client closed").
        let status = if self.completed || self.status != 200 {
            self.status
        } else {
            499
        };
        self.shared.metrics.request(self.endpoint, status, seconds);
        if let Some(log) = &self.shared.events {
            log.write(
                "request",
                json!({
                    "id": self.id,
                    "endpoint": self.endpoint,
                    "status": status,
                    "stream": self.stream,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "finish_reason": self.finish_reason,
                    "queue_s": self.queue_s,
                    "ttft_s": self.ttft_s,
                    "latency_s": seconds,
                    "error": self.error,
                }),
            );
        }
    }
}
