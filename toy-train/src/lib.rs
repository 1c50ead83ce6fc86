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
//! - `finetune`: the starting models of the `lora`, `qlora` and `full` recipes, from a base GGUF.
//! - `adapter`: LoRA adapter files (PEFT and GGUF) and folding one into its base (`toy merge`).
//! - `parallel`: data-parallel training, gradients averaged by burn's collective all-reduce.
//! - [`checkpoint`]: the run directory, atomic checkpoints and `--resume`.
//! - [`events`]: the `toy/v1` event log (`docs/events.md`).
//! - `report`: what `toy runs` shows: run summaries and loss-curve plots from the event log.
//! - [`eval`]: cross-entropy and perplexity with documented windowing (`toy eval`).
//! - `lmc`: linear mode connectivity, the loss along the line between two checkpoints
//!   (`toy eval lmc`).
//! - [`images`]: image-folder classification data (torchvision's `ImageFolder`) and transforms.
//! - [`vision`]: training and evaluating a ViT image classifier on such data.

#![warn(missing_docs)]

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
    /// A configuration, flag or input file the run cannot use; the message says why.
    #[error("{0}")]
    Config(String),
    /// Training or evaluation data that cannot be used: malformed, too little, or outside the
    /// vocabulary.
    #[error("{0}")]
    Data(String),
    /// An I/O failure.
    #[error("{what}: {source}")]
    Io {
        /// What was being done (`cannot read …`).
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A checkpoint's state or burn records that cannot be encoded or read back.
    #[error("checkpoint: {0}")]
    Record(String),
    /// The model GGUF could not be written.
    #[error("cannot write the model: {0}")]
    Save(#[from] toy_models::SaveError),
    /// A GGUF file that cannot be read or written.
    #[error("{0}")]
    Gguf(#[from] toy_core::gguf::GgufError),
    /// A step's gradient norm (or, training an image classifier, its loss) was NaN or infinite.
    #[error("training diverged at step {step}: the gradient norm is {grad_norm}; lower --lr")]
    Diverged {
        /// The 1-based step that diverged.
        step: usize,
        /// The step's global gradient norm (or its loss, for the image classifier).
        grad_norm: f64,
    },
    /// A failure of the backend: reading a tensor back, a collective operation, generation.
    #[error("backend error: {0}")]
    Backend(String),
}

/// `map_err` for an I/O failure: `TrainError::Io` saying what was being done.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TrainError {
    let what = what.into();
    move |source| TrainError::Io { what, source }
}
