//! Counters behind `GET /metrics`, written out in Prometheus' text format (version 0.0.4).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::engine::Sequence;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (c, b) in self.counts.iter().zip(&BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {}", braces(labels), self.sum);
        let _ = writeln!(out, "{name}_count{} {}", braces(labels), self.count);
    }
}

#[derive(Debug, Default)]
struct Tables {
    /// (endpoint, status) → requests.
    requests: BTreeMap<(String, u16), u64>,
    /// endpoint → latency until the response is complete.
    latency: BTreeMap<String, Histogram>,
    /// Time to the first generated token, queueing included.
    ttft: Histogram,
    /// Time waiting for a slot.
    queue: Histogram,
}

#[derive(Debug, Default)]
pub struct Metrics {
    tables: Mutex<Tables>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    prefix_cache_bytes: AtomicUsize,
    prefix_cache_entries: AtomicUsize,
    generated_tokens: AtomicU64,
    sequences_finished: AtomicU64,
    sequences_cancelled: AtomicU64,
    sequences_failed: AtomicU64,
    passes: AtomicU64,
    pass_sequences: AtomicU64,
    active: AtomicUsize,
    queued: AtomicUsize,
}

impl Metrics {
    pub fn prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Prompt tokens a sequence took from the prefix cache instead of running them.
    pub fn cached_tokens(&self, n: usize) {
        self.cached_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn set_prefix_cache(&self, bytes: usize, entries: usize) {
        self.prefix_cache_bytes.store(bytes, Ordering::Relaxed);
        self.prefix_cache_entries.store(entries, Ordering::Relaxed);
    }

    pub fn generated_tokens(&self, n: usize) {
        self.generated_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A forward pass over `sequences` sequences (continuous batching).
    pub fn pass(&self, sequences: usize) {
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.pass_sequences
            .fetch_add(sequences as u64, Ordering::Relaxed);
    }

    pub fn cancelled(&self, n: u64) {
        self.sequences_cancelled.fetch_add(n, Ordering::Relaxed);
    }

    pub fn failed(&self, n: u64) {
        self.sequences_failed.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn finished(&self, seq: &Sequence<'_>) {
        self.sequences_finished.fetch_add(1, Ordering::Relaxed);
        let mut t = self.lock();
        t.queue.observe((seq.started - seq.enqueued).as_secs_f64());
        if let Some(first) = seq.first_token {
            t.ttft.observe((first - seq.enqueued).as_secs_f64());
        }
    }

    pub fn set_gauges(&self, active: usize, queued: usize) {
        self.active.store(active, Ordering::Relaxed);
        self.queued.store(queued, Ordering::Relaxed);
    }

    /// A finished HTTP request: its endpoint, status and latency (to the end of its body).
    pub fn request(&self, endpoint: &str, status: u16, seconds: f64) {
        let mut t = self.lock();
        *t.requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
        t.latency
            .entry(endpoint.to_string())
            .or_default()
            .observe(seconds);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        // A panic while holding the lock leaves plain counters: keep using them.
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The Prometheus text exposition.
    pub fn render(&self, in_flight: usize) -> String {
        let mut out = String::new();
        let t = self.lock();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let _ = writeln!(
            out,
            "# HELP toy_requests_total HTTP requests answered, by endpoint and status.\n# TYPE toy_requests_total counter"
        );
        for ((endpoint, status), n) in &t.requests {
            let _ = writeln!(
                out,
                "toy_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP toy_request_duration_seconds Time from the request to the end of its response.\n# TYPE toy_request_duration_seconds histogram"
        );
        for (endpoint, h) in &t.latency {
            h.write(
                &mut out,
                "toy_request_duration_seconds",
                &format!("endpoint=\"{endpoint}\""),
            );
        }
        let _ = writeln!(
            out,
            "# HELP toy_time_to_first_token_seconds Time from a sequence's arrival to its first generated token.\n# TYPE toy_time_to_first_token_seconds histogram"
        );
        t.ttft
            .write(&mut out, "toy_time_to_first_token_seconds", "");
        let _ = writeln!(
            out,
            "# HELP toy_queue_wait_seconds Time a sequence waited for a slot.\n# TYPE toy_queue_wait_seconds histogram"
        );
        t.queue.write(&mut out, "toy_queue_wait_seconds", "");
        drop(t);
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "toy_prompt_tokens_total",
            "Prompt tokens run through the model (generation and embeddings).",
            load(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "toy_prompt_tokens_cached_total",
            "Prompt tokens taken from the prefix cache instead of run.",
            load(&self.cached_tokens),
        );
        counter(
            &mut out,
            "toy_generated_tokens_total",
            "Tokens generated.",
            load(&self.generated_tokens),
        );
        counter(
            &mut out,
            "toy_sequences_finished_total",
            "Sequences generated to the end (stop or length).",
            load(&self.sequences_finished),
        );
        counter(
            &mut out,
            "toy_sequences_cancelled_total",
            "Sequences dropped because their client went away.",
            load(&self.sequences_cancelled),
        );
        counter(
            &mut out,
            "toy_sequences_failed_total",
            "Sequences that ended in an error.",
            load(&self.sequences_failed),
        );
        counter(
            &mut out,
            "toy_batch_passes_total",
            "Forward passes run for generation (each carries every active sequence).",
            load(&self.passes),
        );
        counter(
            &mut out,
            "toy_batch_sequences_total",
            "Sequences summed over those passes (divided by the passes: the mean batch).",
            load(&self.pass_sequences),
        );
        gauge(
            &mut out,
            "toy_sequences_active",
            "Sequences being generated now.",
            self.active.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "toy_sequences_queued",
            "Sequences waiting for a slot.",
            self.queued.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "toy_prefix_cache_bytes",
            "Bytes of keys and values the prefix cache holds.",
            self.prefix_cache_bytes.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "toy_prefix_cache_entries",
            "Token sequences the prefix cache holds.",
            self.prefix_cache_entries.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "toy_requests_in_flight",
            "Generation and embedding requests accepted and not yet answered.",
            in_flight,
        );
        out
    }
}
