//! The `toy/v1` event log of a run: `runs/<id>/events.jsonl`, one JSON object per line.
//!
//! Every line has `schema` (`"toy/v1"`), `event` (its kind), `time` (Unix seconds, fractional)
//! and the fields of its kind; see `docs/events.md`. Fields are only ever added within `toy/v1`;
//! a change of meaning gets a new schema version.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::TrainError;
use crate::config::TrainConfig;
use crate::vision::VisionConfig;

/// The schema name written on every line.
pub const SCHEMA: &str = "toy/v1";

/// One line of `events.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The schema name (`SCHEMA`).
    pub schema: String,
    /// Unix time in seconds when the event was written.
    pub time: f64,
    /// The event's kind (`event`) and fields, flattened into the line.
    #[serde(flatten)]
    pub event: Event,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A run started, or resumed (`resumed_from_step` is set).
    RunStart {
        /// The run directory's name.
        run_id: String,
        /// The whole configuration, as in `config.json`.
        config: Box<TrainConfig>,
        /// `cpu`, `ndarray`, …
        backend: String,
        /// The device, in burn's words.
        device: String,
        /// The run's seed (also in `config`).
        seed: u64,
        /// `git rev-parse HEAD` of the toy source the binary was built from (with `-dirty` when
        /// it had uncommitted changes), when known.
        git_revision: Option<String>,
        /// Version of the toy crate the binary was built from.
        toy_version: String,
        /// Trainable parameters.
        n_params: usize,
        /// Tokens in the model's vocabulary.
        vocab_size: usize,
        /// Tokens of the training data, and how many sequences they made.
        data_tokens: usize,
        /// Packed sequences of the training split.
        train_sequences: usize,
        /// Packed sequences held out.
        val_sequences: usize,
        /// Tokens predicted per optimizer step.
        tokens_per_step: usize,
        /// Data-parallel replicas (one per device); 0 in logs written before data-parallel training existed.
        #[serde(default)]
        devices: usize,
        /// Sequences per optimizer step: per-device batch × devices × gradient accumulation;
        /// 0 in logs written before data-parallel training existed.
        #[serde(default)]
        global_batch: usize,
        /// The checkpoint's step when resuming; `None` for a new run.
        resumed_from_step: Option<usize>,
    },
    /// An image-classification run started, or resumed (`resumed_from_step` is set). Its
    /// `step`, `eval`, `checkpoint` and `run_end` events are those of a language-model run,
    /// with images where those count tokens.
    VisionRunStart {
        /// The run directory's name.
        run_id: String,
        /// The whole configuration, as in `config.json`.
        config: Box<VisionConfig>,
        /// As in `RunStart`: `cpu`, `ndarray`, …
        backend: String,
        /// The device, in burn's words.
        device: String,
        /// The run's seed (also in `config`).
        seed: u64,
        /// As in `RunStart`: the commit of the toy source, when known.
        git_revision: Option<String>,
        /// Version of the toy crate the binary was built from.
        toy_version: String,
        /// Trainable parameters.
        n_params: usize,
        /// Class folders of the data.
        n_classes: usize,
        /// Images of the training split.
        train_images: usize,
        /// Images held out.
        val_images: usize,
        /// Images per optimizer step.
        images_per_step: usize,
        /// The checkpoint's step when resuming; `None` for a new run.
        resumed_from_step: Option<usize>,
    },
    /// One optimizer step finished. `step` counts from 1.
    Step {
        /// The step's number, from 1.
        step: usize,
        /// Mean cross-entropy (nats per token) of the step's micro-batches, before the update.
        loss: f64,
        /// Learning rate used by the update.
        lr: f64,
        /// Global gradient norm before clipping.
        grad_norm: f64,
        /// Whether the gradients were scaled down to the clip norm.
        clipped: bool,
        /// Tokens predicted in this step, and since the run began.
        tokens: usize,
        /// Tokens predicted since the run began, resumed runs included.
        total_tokens: usize,
        /// Throughput of this step (forward, backward and update).
        tokens_per_s: f64,
        /// Seconds since the run (first) began, not counting time while it was stopped.
        elapsed_s: f64,
        /// Epoch of the step's data, from 0.
        epoch: u64,
    },
    /// Held-out evaluation after `step`.
    Eval {
        /// The step it followed.
        step: usize,
        /// Mean cross-entropy on the held-out data (nats per token, or per image).
        loss: f64,
        /// `exp(loss)`.
        perplexity: f64,
        /// Tokens scored (images, for an image classifier).
        tokens: usize,
        /// Image classifiers: the fraction of held-out images whose top class is right, and
        /// whose true class is among the top five.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        top1: Option<f64>,
        /// Image classifiers: the top-5 accuracy (see `top1`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        top5: Option<f64>,
    },
    /// Text generated from `prompt` after `step` (step 0: before training).
    Sample {
        /// The step it followed (0: before training).
        step: usize,
        /// The sample prompt.
        prompt: String,
        /// The prompt followed by the generated text.
        text: String,
        /// Sampling temperature.
        temperature: f32,
        /// The sampler's seed: the run's seed plus `step`.
        seed: u64,
    },
    /// A checkpoint was written (every file complete and renamed into place).
    Checkpoint {
        /// The step checkpointed.
        step: usize,
        /// The GGUF written: `runs/<id>/model.gguf`, or `adapter.gguf` for a LoRA run.
        model: PathBuf,
        /// The directory with the optimizer state for `--resume`.
        state: PathBuf,
        /// Bytes written: the resume state and the GGUF.
        bytes: u64,
    },
    /// The run finished all its steps.
    RunEnd {
        /// Steps done.
        step: usize,
        /// The last step's training loss.
        final_loss: Option<f64>,
        /// The last held-out loss, if an evaluation ran.
        final_eval_loss: Option<f64>,
        /// Tokens predicted over the whole run (images, for an image classifier).
        total_tokens: usize,
        /// Training seconds, not counting time while the run was stopped.
        elapsed_s: f64,
    },
}

impl Event {
    /// This event as a line of the log, stamped with the current time.
    pub fn record(self) -> Record {
        Record {
            schema: SCHEMA.to_string(),
            time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            event: self,
        }
    }
}

/// Appends events to `events.jsonl`, one flushed line each.
#[derive(Debug)]
pub struct EventLog {
    file: File,
    path: PathBuf,
}

impl EventLog {
    /// Open `path` for appending, first cutting it to `keep_bytes` when given: a resumed run
    /// drops the lines written after its last checkpoint (they describe steps it will redo), and
    /// any partial line a kill left behind.
    pub fn open(path: &Path, keep_bytes: Option<u64>) -> Result<Self, TrainError> {
        let io = |source| TrainError::Io {
            what: format!("cannot open the event log {}", path.display()),
            source,
        };
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        if let Some(len) = keep_bytes {
            file.set_len(len).map_err(io)?;
            file.seek(SeekFrom::End(0)).map_err(io)?;
        }
        Ok(EventLog {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Write one event as a line.
    pub fn write(&mut self, event: &Record) -> Result<(), TrainError> {
        let mut line = serde_json::to_string(event).map_err(|e| TrainError::Io {
            what: "cannot encode an event".into(),
            source: std::io::Error::other(e),
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(|source| TrainError::Io {
                what: format!("cannot write to {}", self.path.display()),
                source,
            })
    }

    /// Bytes in the log so far, flushed to disk (recorded in a checkpoint).
    pub fn durable_len(&mut self) -> Result<u64, TrainError> {
        let io = |source| TrainError::Io {
            what: format!("cannot sync {}", self.path.display()),
            source,
        };
        self.file.sync_data().map_err(io)?;
        Ok(self.file.metadata().map_err(io)?.len())
    }
}

/// Read every event of a log; a partial last line (a run killed mid-write) is skipped.
pub fn read_events(path: &Path) -> Result<Vec<Record>, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
        what: format!("cannot read {}", path.display()),
        source,
    })?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|e| {
                TrainError::Data(format!(
                    "{} line {}: not a toy/v1 event: {e}",
                    path.display(),
                    i + 1
                ))
            })
        })
        .collect()
}
