// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by toy-train's tests: fixture paths, scratch directories, a small run on the bundled
//! corpus, its loss curve, and the language-model loss the gradient checks differentiate.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::Flex;
use toy_train::events::{Event, Record, read_events};
use toy_train::{DataConfig, ModelShape, Preset, RunDir, RunInfo, TrainConfig, TrainSetup, train};

#[path = "../../../test-support/next_token_loss.rs"]
mod next_token_loss;
#[path = "../../../test-support/smollm2.rs"]
mod smollm2_path;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use next_token_loss::next_token_loss;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use smollm2_path::smollm2;

/// `fixtures/` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The bundled corpus and its tokenizer.
pub fn corpus_dir() -> PathBuf {
    fixtures().join("corpus")
}

/// A fresh directory, unique per test and process.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A small llama (2 × 64) and a short schedule on the bundled corpus: a second or two per run.
pub fn small_config(steps: usize) -> TrainConfig {
    let data = DataConfig {
        files: vec![corpus_dir().join("stories.txt")],
        tokenizer: corpus_dir().join("tokenizer.gguf"),
        val_fraction: 0.05,
    };
    let mut c = TrainConfig::from_preset(Preset::Tiny, data, 7);
    c.model = ModelShape {
        n_layer: 2,
        d_model: 64,
        n_head: 4,
        n_head_kv: 2,
        d_ff: 128,
        context_length: 64,
        ..c.model
    };
    c.optim.steps = steps;
    c.optim.batch_size = 4;
    c.optim.seq_len = 32;
    c.optim.warmup_steps = 2;
    c.cadence.eval_every = 0;
    c.cadence.eval_batches = 2;
    c.cadence.checkpoint_every = 0;
    c.cadence.sample_tokens = 8;
    c
}

pub fn info() -> RunInfo {
    RunInfo {
        backend: "cpu".into(),
        git_revision: None,
    }
}

/// Run `config` in a new run directory `root/id` on the CPU; stop after the first checkpoint at
/// or past `stop_at`.
pub fn run(root: &Path, id: &str, config: TrainConfig, stop_at: Option<usize>) -> RunDir {
    let run = RunDir::create(root, id).unwrap();
    let setup = TrainSetup::prepare(config).unwrap();
    train::<Flex>(
        &run,
        &setup,
        &info(),
        &Default::default(),
        &mut |r: &Record| match (&r.event, stop_at) {
            (Event::Checkpoint { step, .. }, Some(at)) if *step >= at => ControlFlow::Break(()),
            _ => ControlFlow::Continue(()),
        },
    )
    .unwrap();
    run
}

/// The `step` events' training losses, in order.
pub fn losses(run: &RunDir) -> Vec<f64> {
    events(run)
        .filter_map(|e| match e {
            Event::Step { loss, .. } => Some(loss),
            _ => None,
        })
        .collect()
}

/// The `eval` events' held-out losses, in order.
pub fn eval_losses(run: &RunDir) -> Vec<f64> {
    events(run)
        .filter_map(|e| match e {
            Event::Eval { loss, .. } => Some(loss),
            _ => None,
        })
        .collect()
}

fn events(run: &RunDir) -> impl Iterator<Item = Event> {
    read_events(&run.events_path())
        .unwrap()
        .into_iter()
        .map(|r| r.event)
}
