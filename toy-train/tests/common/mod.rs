// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by toy-train's tests: fixture paths, scratch directories, a small run on the bundled
//! corpus, its loss curve, and the language-model loss the gradient checks differentiate.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData, activation};
use toy_kernels::ToyBackend;
use toy_models::CausalLm;
use toy_train::events::{Event, Record, read_events};
use toy_train::{DataConfig, ModelShape, Preset, RunDir, RunInfo, TrainConfig, TrainSetup, train};

/// `fixtures/` of the repository.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The bundled corpus and its tokenizer.
pub fn corpus_dir() -> PathBuf {
    fixtures().join("corpus")
}

/// `SmolLM2-135M-Instruct.<kind>.gguf` in the model cache (`TOY_MODEL_CACHE`, default
/// `~/.cache/toy-models`), as `scripts/fetch-smollm2.sh` leaves it.
pub fn smollm2(kind: &str) -> PathBuf {
    let cache = std::env::var_os("TOY_MODEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/toy-models")
        });
    let path = cache.join(format!("SmolLM2-135M-Instruct.{kind}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-smollm2.sh first",
        path.display()
    );
    path
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

/// The `step` events' losses, in order.
pub fn losses(run: &RunDir) -> Vec<f64> {
    read_events(&run.events_path())
        .unwrap()
        .into_iter()
        .filter_map(|r| match r.event {
            Event::Step { loss, .. } => Some(loss),
            _ => None,
        })
        .collect()
}

/// Mean next-token cross-entropy of `batch` equal rows of `tokens`, from an empty cache.
pub fn lm_loss<B: ToyBackend>(
    model: &impl CausalLm<B>,
    tokens: &[i64],
    batch: usize,
) -> Tensor<B, 1> {
    let device = model.device();
    let t = tokens.len() / batch;
    let all = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens.to_vec(), [batch, t]), &device);
    let input = all.clone().narrow(1, 0, t - 1);
    let target = all.narrow(1, 1, t - 1).reshape([batch * (t - 1), 1]);
    let logits = model.forward(input, &mut model.new_cache());
    let vocab = logits.dims()[2];
    let logp = activation::log_softmax(logits.reshape([batch * (t - 1), vocab]), 1);
    logp.gather(1, target).mean().neg()
}
