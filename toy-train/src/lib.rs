//! toy-train: training and evaluation of toy's burn models.
//!
//! - [`config`]: a run's configuration (presets, model shape, optimizer, data, cadence).
//! - [`data`]: text files → tokens → packed sequences → seeded micro-batches, with a held-out
//!   split.
//! - [`init`]: seeded weight initialization, independent of burn's global RNG.
//! - [`model`]: the trained model of any architecture ([`model::Trainee`]), warm-start donors.
//! - [`optim`]: the loss, AdamW with weight decay on matrices only, global-norm clipping.
//! - [`schedule`]: linear warmup + cosine decay.
//! - [`trainer`]: the from-scratch recipe's loop on `Autodiff<B>`, with evaluation, samples and
//!   checkpoints.
//! - [`checkpoint`]: the run directory, atomic checkpoints and `--resume`.
//! - [`events`]: the `toy/v1` event log (`docs/events.md`).
//! - [`eval`]: cross-entropy and perplexity with documented windowing (`toy eval`).
//! - [`images`]: image-folder classification data (torchvision's `ImageFolder`) and transforms.
//! - [`vision`]: training and evaluating a ViT image classifier on such data.

pub mod adapter;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod eval;
pub mod events;
pub mod finetune;
pub mod images;
pub mod init;
pub mod lmc;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod report;
pub mod schedule;
pub mod trainer;
pub mod vision;

pub use checkpoint::RunDir;
pub use config::{CadenceConfig, DataConfig, ModelShape, OptimConfig, Preset, Recipe, TrainConfig};
pub use trainer::{RunInfo, RunSummary, TrainSetup, train, train_data_parallel};

/// Everything that can stop a run or an evaluation.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Data(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("checkpoint: {0}")]
    Record(String),
    #[error("cannot write the model: {0}")]
    Save(#[from] toy_models::SaveError),
    #[error("{0}")]
    Gguf(#[from] toy_core::gguf::GgufError),
    #[error("training diverged at step {step}: the gradient norm is {grad_norm}; lower --lr")]
    Diverged { step: usize, grad_norm: f64 },
    #[error("backend error: {0}")]
    Backend(String),
}

/// `map_err` for an I/O failure: `TrainError::Io` saying what was being done.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TrainError {
    let what = what.into();
    move |source| TrainError::Io { what, source }
}
