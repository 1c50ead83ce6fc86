//! The generation engine: the model lives on one dedicated thread; HTTP handlers send it jobs
//! over a channel and get tokens back over per-request channels.
//!
//! Scheduling (continuous batching, as llama-server's unified batch): up to `max_concurrency`
//! sequences are active at once, in the generation core that `toy infer` also runs
//! ([`toy_models::Batch`]: each sequence's KV cache and queued tokens). Each turn samples every
//! generating sequence's next token, queues it, and runs **one forward pass over all of them**:
//! the decode tokens plus whole prompt pieces of the ones still reading their prompt while they
//! fit in `batch_tokens` (the first always goes) — so a long prompt cannot stall the streams.
//! Decode is bound by reading the weights, so a pass over many sequences costs little more than
//! a pass over one. Each sequence's logits are those it gets alone — its rows are declared to
//! the kernels (`CausalLm::forward_batch_last`) and its prompt runs in `toy infer`'s pieces —
//! so its tokens are `toy infer`'s. Jobs beyond `max_concurrency` wait in arrival order. A sequence whose receiver is gone (the
//! client disconnected, the handler was dropped) is removed before the next pass: its slot is
//! free at once. Prompts scored for `echo` + `logprobs` need every position's logits and run
//! on their own pass.
//!
//! A new sequence starts from the longest prefix of its prompt that a finished one left in
//! the [`PrefixCache`] (a shared system prompt, the earlier turns of a chat); a finished or
//! cancelled sequence leaves its keys and values there.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use burn::tensor::{Int, Tensor, TensorData};
use tokio::sync::{mpsc, oneshot};
use toy_core::gguf::GgufFile;
use toy_core::sampling::{Sampler, SamplingParams, StopStrings};
use toy_core::tokenizer::{StreamDecoder, Tokenizer};
use toy_kernels::ToyBackend;
use toy_models::{Batch, CausalLm, KvCache, Model, SeqId};

use crate::grammar::{Constraint, Grammars};
use crate::prefix_cache::{Hit, PrefixCache};
use crate::state::Shared;

/// Prompt chunk when every position's logits are needed (echo with logprobs): `vocab × chunk`
/// floats come to the host.
const SCORE_CHUNK: usize = 32;

/// What the HTTP side knows about the loaded model.
pub struct ModelInfo {
    /// The name clients pass as `model` (the file name without `.gguf`, or `--model-id`).
    pub id: String,
    pub tokenizer: Tokenizer,
    /// Context the server allows per request (`--ctx`, at most the model's).
    pub context: usize,
    /// The model's own context length.
    pub model_context: usize,
    pub d_model: usize,
    pub vocab: usize,
    pub n_params: usize,
    /// Unix time the model was loaded (the `created` of `/v1/models`).
    pub created: u64,
    /// Structured output's view of the vocabulary (built on the first request that needs it).
    pub grammars: Grammars,
}

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct GenParams {
    /// Index of this choice in the response (`n` > 1 sends several jobs).
    pub index: usize,
    pub prompt: Vec<u32>,
    /// Most new tokens (0: only score the prompt).
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Added to the logits before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub stop: Vec<String>,
    /// Log-probabilities of the chosen tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
    /// Log-probabilities of the prompt tokens too (completions with `echo`).
    pub prompt_logprobs: bool,
    pub ignore_eos: bool,
    /// Start from the prefix cache, and leave this sequence's keys and values there.
    pub cache_prompt: bool,
    /// The grammar the output must follow (`response_format`, `json_schema`, `grammar`).
    pub constraint: Option<Constraint>,
}

/// A token's log-probability under the model (log-softmax of the raw logits) and the most
/// likely alternatives at its position.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Finish {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Text still to show (held back by the stop-string check or an unfinished character).
    pub tail: String,
    /// Seconds waiting for a slot, until the first token, and in all.
    pub queue_s: f64,
    pub ttft_s: Option<f64>,
    pub total_s: f64,
}

/// What the engine sends back for a [`GenParams`], tagged with its `index`.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// The prompt's tokens with their log-probabilities (the first has none).
    PromptLogprobs(Vec<Option<TokenLogprob>>),
    /// A new token and the text it completes (may be empty: part of a character, or held back
    /// as the possible start of a stop string).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done(Finish),
    /// The generation failed (the sequence is gone).
    Error(String),
}

pub type GenSender = mpsc::UnboundedSender<(usize, GenEvent)>;

pub enum Job {
    Generate {
        params: GenParams,
        tx: GenSender,
    },
    /// Mean-pooled, L2-normalized final hidden states of each input.
    Embed {
        inputs: Vec<Vec<u32>>,
        tx: oneshot::Sender<Result<Vec<Vec<f32>>, String>>,
    },
}

impl Job {
    fn cancelled(&self) -> bool {
        match self {
            Job::Generate { tx, .. } => tx.is_closed(),
            Job::Embed { tx, .. } => tx.is_closed(),
        }
    }

    fn fail(self, message: &str) {
        match self {
            Job::Generate { params, tx } => {
                let _ = tx.send((params.index, GenEvent::Error(message.to_string())));
            }
            Job::Embed { tx, .. } => {
                let _ = tx.send(Err(message.to_string()));
            }
        }
    }
}

/// How the engine thread starts.
pub struct EngineConfig {
    pub model_path: PathBuf,
    pub model_id: String,
    /// `--ctx` (None: the model's context length).
    pub ctx: Option<usize>,
    pub max_concurrency: usize,
    /// Most tokens in one forward pass (`--batch-tokens`; decode tokens count one each).
    pub batch_tokens: usize,
    /// `--chat-template-file`: replaces the model's chat template.
    pub chat_template: Option<String>,
    /// Bytes of keys and values the prefix cache may keep (`--cache-ram`; 0: off).
    pub cache_ram: usize,
}

/// The engine thread's body: load the model (reporting the outcome on `ready`), then serve jobs
/// until the job channel closes or `shared.abort` is set.
pub fn run<B: ToyBackend>(
    config: EngineConfig,
    device: B::Device,
    shared: Arc<Shared>,
    jobs: Receiver<(Job, Instant)>,
    ready: oneshot::Sender<Result<(), String>>,
) {
    let loaded = catch_unwind(AssertUnwindSafe(|| load::<B>(&config, &device)))
        .unwrap_or_else(|_| Err("the model loader panicked".to_string()));
    let (info, model) = match loaded {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let info = Arc::new(info);
    let _ = shared.info.set(info.clone());
    let _ = ready.send(Ok(()));
    Engine {
        model: &model,
        tokenizer: &info.tokenizer,
        shared: &shared,
        max_concurrency: config.max_concurrency.max(1),
        batch: Batch::new(config.batch_tokens),
        queue: VecDeque::new(),
        active: Vec::new(),
        prefix: PrefixCache::new(config.cache_ram),
    }
    .serve(&jobs);
}

fn load<B: ToyBackend>(
    config: &EngineConfig,
    device: &B::Device,
) -> Result<(ModelInfo, Model<B>), String> {
    let path = &config.model_path;
    let file = GgufFile::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut tokenizer = Tokenizer::from_gguf(&file)
        .map_err(|e| format!("cannot build the tokenizer of {}: {e}", path.display()))?;
    if let Some(template) = &config.chat_template {
        tokenizer.set_chat_template(template.clone());
    }
    let (model_config, model) = toy_models::load_model::<B>(&file, device, |_, _| {})
        .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    let model_context = model.context_length();
    let context = match config.ctx {
        None => model_context,
        Some(c) if c >= 2 && c <= model_context => c,
        Some(c) => {
            return Err(format!(
                "--ctx {c} is outside what the model supports (2 to {model_context} tokens)"
            ));
        }
    };
    let c = &model_config;
    let n_params = c.vocab_size * c.d_model * if c.tied_embeddings { 1 } else { 2 }
        + c.n_layer
            * (c.d_model * (c.n_head + 2 * c.n_head_kv) * c.head_dim
                + c.n_head * c.head_dim * c.d_model
                + 3 * c.d_model * c.d_ff);
    Ok((
        ModelInfo {
            id: config.model_id.clone(),
            vocab: c.vocab_size,
            d_model: c.d_model,
            n_params,
            tokenizer,
            context,
            model_context,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            grammars: Grammars::default(),
        },
        model,
    ))
}

struct Engine<'m, B: ToyBackend> {
    model: &'m Model<B>,
    tokenizer: &'m Tokenizer,
    shared: &'m Shared,
    max_concurrency: usize,
    /// The active sequences' caches and queued tokens; each turn is one of its steps.
    batch: Batch<B>,
    queue: VecDeque<(Job, Instant)>,
    active: Vec<Sequence<'m>>,
    prefix: PrefixCache<B>,
}

/// Hand back to the system the memory the sequences that just ended freed. glibc keeps freed
/// chunks in its per-thread arenas for reuse and returns only the top of a heap, so a server
/// that ran long prompts side by side would sit idle on hundreds of MiB it no longer uses
/// (measured with four ~950-token prompts at once, SmolLM2 Q8_0: idle RSS 473 MiB, 237 MiB after
/// one `malloc_trim`). Called when the engine runs out of work, not on every step.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks and releases the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl<'m, B: ToyBackend> Engine<'m, B> {
    fn serve(mut self, jobs: &Receiver<(Job, Instant)>) {
        let mut open = true;
        loop {
            if self.shared.abort.load(Ordering::SeqCst) {
                self.abort_all("the server is shutting down");
                return;
            }
            // Take what has arrived; sleep on the channel only when there is nothing to do.
            if self.active.is_empty() && self.queue.is_empty() {
                if !open {
                    return;
                }
                match jobs.recv_timeout(Duration::from_millis(100)) {
                    Ok(job) => self.queue.push_back(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match jobs.try_recv() {
                    Ok(job) => self.queue.push_back(job),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.admit();
            self.turn();
            self.publish_gauges();
            if self.active.is_empty() && self.queue.is_empty() {
                release_freed_memory();
            }
        }
    }

    /// Move queued jobs into free slots (embeddings run right away, in one go).
    fn admit(&mut self) {
        while self.active.len() < self.max_concurrency {
            let Some((job, enqueued)) = self.queue.pop_front() else {
                break;
            };
            if job.cancelled() {
                self.shared.metrics.cancelled(1);
                continue;
            }
            match job {
                Job::Embed { inputs, tx } => {
                    let out = catch_unwind(AssertUnwindSafe(|| self.embed(&inputs)))
                        .unwrap_or_else(|_| Err("the model panicked while embedding".into()));
                    let _ = tx.send(out);
                }
                Job::Generate { params, tx } => {
                    // Scoring the prompt needs every position's logits: no reuse.
                    let hit = (params.cache_prompt && !params.prompt_logprobs)
                        .then(|| self.prefix.lookup(&params.prompt))
                        .flatten();
                    if let Some(hit) = &hit {
                        self.shared.metrics.cached_tokens(hit.len);
                    }
                    self.active.push(Sequence::new(
                        params,
                        tx,
                        enqueued,
                        self.tokenizer,
                        self.model,
                        hit,
                        &mut self.batch,
                    ));
                }
            }
        }
    }

    /// One forward pass for all active sequences: each generating one samples its next token
    /// and queues it, prompt pieces fill the rest of the token budget.
    fn turn(&mut self) {
        let tokenizer = self.tokenizer;
        let model = self.model;
        let metrics = &self.shared.metrics;
        let mut ended: Vec<(SeqId, Result<(), String>)> = Vec::new();
        for seq in self.active.iter_mut() {
            if seq.tx.is_closed() {
                ended.push((seq.slot, Err(String::new())));
                continue;
            }
            let next = catch_unwind(AssertUnwindSafe(|| seq.next(tokenizer, metrics)))
                .unwrap_or_else(|_| Err("the sampler panicked".into()));
            match next {
                Ok(Next::Finished) => ended.push((seq.slot, Ok(()))),
                Ok(Next::Decode(id)) => self.batch.push(seq.slot, &[id]),
                Ok(Next::Prompt) => {} // queued in the batch when it was admitted
                Ok(Next::Score) => {
                    // Every position's logits: a pass of its own.
                    let cache = self.batch.cache_mut(seq.slot).expect("an active sequence");
                    let outcome =
                        catch_unwind(AssertUnwindSafe(|| seq.score_chunk(model, cache, metrics)))
                            .unwrap_or_else(|_| Err("the model panicked during the prompt".into()));
                    if let Err(e) = outcome {
                        ended.push((seq.slot, Err(e)));
                    }
                }
                Err(e) => ended.push((seq.slot, Err(e))),
            }
        }
        // A sequence that ended does not run again.
        let mut removed: Vec<(Sequence<'m>, KvCache<B>, Result<(), String>)> = Vec::new();
        for (slot, outcome) in ended {
            if let Some(i) = self.active.iter().position(|s| s.slot == slot) {
                let seq = self.active.swap_remove(i);
                let cache = self.batch.remove(slot).expect("an active sequence");
                removed.push((seq, cache, outcome));
            }
        }
        match self.batch.step(model) {
            Ok(ran) => {
                if !ran.is_empty() {
                    self.shared.metrics.pass(ran.len());
                }
                for r in ran {
                    if let Some(seq) = self.active.iter_mut().find(|s| s.slot == r.id) {
                        seq.take_logits(r.tokens, r.logits, metrics);
                    }
                }
            }
            Err(e) => {
                for slot in e.ids {
                    if let Some(i) = self.active.iter().position(|s| s.slot == slot) {
                        let seq = self.active.swap_remove(i);
                        let cache = self.batch.remove(slot).expect("an active sequence");
                        removed.push((seq, cache, Err(e.message.clone())));
                    }
                }
            }
        }
        for (seq, cache, outcome) in removed {
            match outcome {
                Ok(()) => {
                    self.shared.metrics.finished(&seq);
                    self.keep_prefix(seq, cache);
                }
                Err(message) if message.is_empty() => {
                    self.shared.metrics.cancelled(1);
                    self.keep_prefix(seq, cache);
                }
                Err(message) => {
                    // Its cache may hold a pass's keys in some layers only: not kept.
                    let _ = seq.tx.send((seq.params.index, GenEvent::Error(message)));
                    self.shared.metrics.failed(1);
                }
            }
        }
    }

    /// Leave an ended sequence's keys and values in the prefix cache.
    fn keep_prefix(&mut self, seq: Sequence<'m>, cache: KvCache<B>) {
        if !seq.params.cache_prompt {
            return;
        }
        // The cache holds the prompt and every generated token but the last (sampled, not run);
        // less of the prompt when cancelled while reading it.
        let mut tokens = seq.params.prompt;
        tokens.extend(seq.generated);
        tokens.truncate(cache.len());
        self.prefix.insert(tokens, cache);
        let (bytes, entries) = self.prefix.usage();
        self.shared.metrics.set_prefix_cache(bytes, entries);
    }

    fn publish_gauges(&self) {
        self.shared
            .metrics
            .set_gauges(self.active.len(), self.queue.len());
    }

    fn abort_all(&mut self, message: &str) {
        for seq in self.active.drain(..) {
            self.batch.remove(seq.slot);
            let _ = seq
                .tx
                .send((seq.params.index, GenEvent::Error(message.to_string())));
        }
        for (job, _) in self.queue.drain(..) {
            job.fail(message);
        }
        self.publish_gauges();
    }

    fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, String> {
        inputs
            .iter()
            .map(|ids| {
                let v = self.model.embed(ids).map_err(|e| e.to_string())?;
                self.shared.metrics.prompt_tokens(ids.len());
                Ok(v)
            })
            .collect()
    }
}

fn ids_tensor<B: ToyBackend>(model: &Model<B>, ids: &[u32]) -> Tensor<B, 2, Int> {
    let v: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let n = v.len();
    Tensor::from_data(TensorData::new(v, [1, n]), &model.device())
}

fn host<B: ToyBackend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>, String> {
    t.into_data()
        .convert::<f32>() // f16 activations (`--dtype f16`)
        .into_vec::<f32>()
        .map_err(|e| format!("backend error: {e:?}"))
}

/// What a sequence puts in the next pass.
enum Next {
    /// It finished (its `Done` is sent); the slot is free.
    Finished,
    /// The token it just sampled.
    Decode(u32),
    /// It is still reading its prompt, queued in the batch (the step runs its next piece).
    Prompt,
    /// Its next prompt chunk with every position's logits, on a pass of its own.
    Score,
}

/// One sequence being generated.
pub(crate) struct Sequence<'t> {
    pub(crate) params: GenParams,
    tx: GenSender,
    /// Its place in the engine's [`Batch`] (which holds its cache).
    slot: SeqId,
    /// Prompt tokens already in the cache.
    prefilled: usize,
    /// Of those, the ones the prefix cache gave.
    cached: usize,
    /// Logits for the next token, once the prompt is in.
    logits: Option<Vec<f32>>,
    generated: Vec<u32>,
    sampler: Sampler,
    /// The grammar the output must follow, advanced token by token.
    constraint: Option<Constraint>,
    decoder: StreamDecoder<'t>,
    stops: StopStrings,
    prompt_logprobs: Vec<Option<TokenLogprob>>,
    pub(crate) enqueued: Instant,
    pub(crate) started: Instant,
    pub(crate) first_token: Option<Instant>,
}

impl<'t> Sequence<'t> {
    fn new<B: ToyBackend>(
        mut params: GenParams,
        tx: GenSender,
        enqueued: Instant,
        tokenizer: &'t Tokenizer,
        model: &Model<B>,
        hit: Option<Hit<B>>,
        batch: &mut Batch<B>,
    ) -> Self {
        let (mut cache, cached) = match hit {
            Some(hit) => (hit.cache, hit.len),
            None => (model.new_cache(), 0),
        };
        // Room for the prompt and the first tokens up front; a longer answer regrows the
        // buffers (doubling), so a large `max_tokens` does not hold memory it may never use.
        cache.reserve(params.prompt.len() + params.max_tokens.min(256));
        let slot = batch.add(cache);
        // The prompt is queued now, unless scored outside the batch's steps (`score_chunk`).
        if !params.prompt_logprobs && params.max_tokens > 0 {
            batch.push(slot, &params.prompt[cached..]);
        }
        Sequence {
            sampler: Sampler::new(params.sampling.clone()),
            constraint: params.constraint.take(),
            stops: StopStrings::new(params.stop.clone()),
            decoder: StreamDecoder::new(tokenizer),
            slot,
            prefilled: cached,
            cached,
            logits: None,
            generated: Vec::with_capacity(params.max_tokens.min(4096)),
            prompt_logprobs: Vec::new(),
            params,
            tx,
            enqueued,
            started: Instant::now(),
            first_token: None,
        }
    }

    fn send(&self, event: GenEvent) {
        // A closed receiver is noticed before the next step.
        let _ = self.tx.send((self.params.index, event));
    }

    /// What this sequence needs next: sample a token from the last logits (and run it), more
    /// of its prompt, or nothing (it finished; [`GenEvent::Done`] is sent).
    fn next(
        &mut self,
        tokenizer: &Tokenizer,
        metrics: &crate::metrics::Metrics,
    ) -> Result<Next, String> {
        let prompt_len = self.params.prompt.len();
        if self.params.max_tokens == 0 && !self.params.prompt_logprobs {
            // Nothing to generate and nothing to score.
            self.finish(FinishReason::Length);
            return Ok(Next::Finished);
        }
        if self.prefilled < prompt_len {
            return Ok(if self.params.prompt_logprobs {
                Next::Score
            } else {
                Next::Prompt
            });
        }
        if self.params.max_tokens == 0 {
            self.finish(FinishReason::Length);
            return Ok(Next::Finished);
        }
        let Some(mut logits) = self.logits.take() else {
            return Err("internal error: no logits after the prompt".into());
        };
        let logprob_of =
            |id: u32, logits: &[f32]| self.params.logprobs.map(|k| token_logprob(logits, id, k));
        // The log-probabilities describe the model's own distribution (before biases and
        // penalties), so compute them from the untouched logits.
        let raw = self.params.logprobs.map(|_| logits.clone());
        for &(id, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if let Some(c) = &mut self.constraint {
            c.mask(&mut logits)?;
        }
        let id = self.sampler.sample(&logits, &self.generated);
        // Under a grammar, end-of-generation is allowed only where the grammar is complete.
        if (!self.params.ignore_eos || self.constraint.is_some()) && tokenizer.is_eog(id) {
            self.finish(FinishReason::Stop);
            return Ok(Next::Finished);
        }
        if let Some(c) = &mut self.constraint {
            c.accept(id)?;
        }
        self.generated.push(id);
        metrics.generated_tokens(1);
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        let logprob = raw.as_deref().and_then(|raw| logprob_of(id, raw));
        let piece = self.decoder.push(id);
        let (text, stopped) = self.stops.push(&piece);
        self.send(GenEvent::Token { id, text, logprob });
        if stopped || self.constraint.as_ref().is_some_and(Constraint::done) {
            self.finish(FinishReason::Stop);
            return Ok(Next::Finished);
        }
        if self.generated.len() >= self.params.max_tokens {
            self.finish(FinishReason::Length);
            return Ok(Next::Finished);
        }
        Ok(Next::Decode(id))
    }

    /// After a step that ran `n` of this sequence's queued tokens: `logits` are its next
    /// token's once everything queued has run.
    fn take_logits(
        &mut self,
        n: usize,
        logits: Option<Vec<f32>>,
        metrics: &crate::metrics::Metrics,
    ) {
        if self.prefilled < self.params.prompt.len() {
            self.prefilled += n;
            metrics.prompt_tokens(n);
        }
        if logits.is_some() {
            self.logits = logits;
        }
    }

    /// Run the next prompt chunk alone, keeping every position's log-probability (`echo` with
    /// `logprobs`).
    fn score_chunk<B: ToyBackend>(
        &mut self,
        model: &Model<B>,
        cache: &mut KvCache<B>,
        metrics: &crate::metrics::Metrics,
    ) -> Result<(), String> {
        let prompt = &self.params.prompt;
        let start = self.prefilled;
        let end = (start + SCORE_CHUNK).min(prompt.len());
        let last = end == prompt.len();
        let tokens = ids_tensor(model, &prompt[start..end]);
        if start == 0 {
            self.prompt_logprobs.push(None);
        }
        let logits = host(model.forward(tokens, cache))?;
        let vocab = logits.len() / (end - start);
        let k = self.params.logprobs.unwrap_or(0);
        for (row, pos) in logits.chunks(vocab).zip(start..end) {
            if let Some(&next) = prompt.get(pos + 1) {
                self.prompt_logprobs.push(Some(token_logprob(row, next, k)));
            }
        }
        metrics.prompt_tokens(end - start);
        self.prefilled = end;
        if last {
            self.logits = Some(logits[logits.len() - vocab..].to_vec());
            let lps = std::mem::take(&mut self.prompt_logprobs);
            self.send(GenEvent::PromptLogprobs(lps));
        }
        Ok(())
    }

    fn finish(&mut self, reason: FinishReason) {
        let tail = if self.stops.stopped() {
            String::new()
        } else {
            let rest = self.decoder.finish();
            self.stops.finish(&rest)
        };
        let now = Instant::now();
        let finish = Finish {
            reason,
            prompt_tokens: self.params.prompt.len(),
            cached_tokens: self.cached,
            completion_tokens: self.generated.len(),
            tail,
            queue_s: (self.started - self.enqueued).as_secs_f64(),
            ttft_s: self.first_token.map(|t| (t - self.enqueued).as_secs_f64()),
            total_s: (now - self.enqueued).as_secs_f64(),
        };
        self.send(GenEvent::Done(finish));
    }
}

/// log-softmax of `logits` at `id`, and the `k` most likely tokens (ties: lowest id first).
pub fn token_logprob(logits: &[f32], id: u32, k: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    let lse = max + sum.ln();
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32)
    };
    let mut top = Vec::new();
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let by = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, by);
        idx.truncate(k);
        idx.sort_unstable_by(by);
        top = idx.into_iter().map(|i| (i, lp(i))).collect();
    }
    TokenLogprob {
        id,
        logprob: lp(id),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let t = token_logprob(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        // Ties go to the lowest id.
        assert_eq!(t.top.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let total: f64 = (0..4)
            .map(|i| (token_logprob(&logits, i, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
