//! The training loop of an image classifier: AdamW with warmup + cosine decay, global-norm
//! clipping, held-out evaluation, atomic checkpoints and `--resume` — the language models'
//! optimizer, schedule, run directory and event log, over a ViT.
//!
//! `runs/<id>/model.gguf` is the ViT GGUF (`general.architecture = "vit"`, the class names
//! in `vit.class_labels`), which `toy eval --data` and `toy classify` read.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::backend::Backend;
use toy_kernels::ToyBackend;
use toy_models::vit::gguf::load_vit;
use toy_models::vit::{Init, Vit, VitConfig};

use super::eval::{ImageEval, evaluate_images};
use super::{ImageSplit, VisionConfig, eval_transform};
use crate::TrainError;
use crate::checkpoint::{RunDir, TrainState};
use crate::events::{Event, Record};
use crate::optim::{OptimRecord, TrainOptimizer, clip_grads};
use crate::schedule::learning_rate;
use crate::trainer::{Events, RunInfo};

type Ad<B> = Autodiff<B>;

/// How an image-classification run ended.
#[derive(Debug, Clone)]
pub struct VisionSummary {
    /// Optimizer steps done.
    pub steps: usize,
    /// The last step's training loss.
    pub final_loss: Option<f64>,
    /// The last held-out evaluation since the run (re)started, if any.
    pub final_eval: Option<ImageEval>,
    /// Training seconds, not counting time while the run was stopped.
    pub elapsed_s: f64,
    /// The run's ViT GGUF (`runs/<id>/model.gguf`).
    pub model_path: PathBuf,
}

/// The image-classification config of `run`, or `None` when it is a language-model run (its
/// config has no `vit`).
pub fn read_vision_config(run: &RunDir) -> Result<Option<VisionConfig>, TrainError> {
    let value: serde_json::Value = run.read_config()?;
    if value.get("vit").is_none() {
        return Ok(None);
    }
    run.read_config().map(Some)
}

/// Train the ViT of `run`'s config (a new run whose config is written, or `--resume` when the
/// run holds a checkpoint). Events go to `runs/<id>/events.jsonl` and to `observer`, which may
/// stop the run after any event (it can be resumed from its last checkpoint).
pub fn train_vision<B: ToyBackend>(
    run: &RunDir,
    config: &VisionConfig,
    info: &RunInfo,
    device: &B::Device,
    observer: &mut dyn FnMut(&Record) -> ControlFlow<()>,
) -> Result<VisionSummary, TrainError> {
    config.check()?;
    let o = &config.optim;
    let split = ImageSplit::open(&config.data, config.seed)?;
    if split.classes != config.labels {
        return Err(TrainError::Data(format!(
            "{}: the class folders {:?} are not the run's {:?}",
            config.data.train.display(),
            split.classes,
            config.labels
        )));
    }
    let checkpoint = run.latest()?;
    let mut model = start_model::<B>(config, device)?;
    let mut optim = TrainOptimizer::<Ad<B>, Vit<Ad<B>>>::new(o);
    let mut state = TrainState::default();
    let resumed = checkpoint.is_some();
    if let Some(dir) = &checkpoint {
        let (saved, model_record, optim_record) =
            RunDir::read_checkpoint::<Ad<B>, _, OptimRecord<Ad<B>>>(dir, device)?;
        model = model.load_record(model_record);
        optim = optim.load_record(optim_record);
        state = saved;
        // A kill between the checkpoint and the GGUF leaves an older model.gguf: bring it level.
        save_model(&model.valid(), config, &run.model_path())?;
    } else {
        run.write_config(config)?;
    }
    // timm's ViT recipe: no weight decay on the position embeddings and the class token. (Named
    // after the checkpoint loads: a loaded record brings its own parameter ids.)
    optim = optim.without_decay([model.pos_embed.id, model.cls_token.id]);
    let mut events = Events::open(run, resumed.then_some(state.events_len), observer)?;
    events.emit(Event::VisionRunStart {
        run_id: run.id.clone(),
        config: Box::new(config.clone()),
        backend: info.backend.clone(),
        device: format!("{device:?}"),
        seed: config.seed,
        git_revision: info.git_revision.clone(),
        toy_version: env!("CARGO_PKG_VERSION").to_string(),
        n_params: model.num_params(),
        n_classes: split.classes.len(),
        train_images: split.train.len(),
        val_images: split.val.len(),
        images_per_step: o.batch_size,
        resumed_from_step: resumed.then_some(state.step),
    })?;

    let train_transform = config.train_transform();
    let val_transform = eval_transform(&config.vit);
    let due = |every: usize, step: usize| every > 0 && step.is_multiple_of(every);
    let mut last_eval = None;
    let run_clock = Instant::now();
    let elapsed_before = state.elapsed_s;
    for step in state.step..o.steps {
        let started = Instant::now();
        let lr = learning_rate(o, step);
        let (images, labels, epoch) = split.train_batch::<Ad<B>>(
            &train_transform,
            config.seed,
            step,
            o.batch_size,
            device,
        )?;
        let loss = model.loss(images, labels);
        let loss_value: f64 = loss.clone().into_scalar().elem();
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let (norm, clipped) = clip_grads::<Ad<B>, _>(&model, &mut grads, o.grad_clip, step)?;
        if !loss_value.is_finite() {
            return Err(TrainError::Diverged {
                step: step + 1,
                grad_norm: norm,
            });
        }
        model = optim.step(lr, model, grads);

        let done = step + 1;
        state.step = done;
        state.total_tokens += o.batch_size;
        state.last_loss = Some(loss_value);
        state.elapsed_s = elapsed_before + run_clock.elapsed().as_secs_f64();
        events.emit(Event::Step {
            step: done,
            loss: loss_value,
            lr,
            grad_norm: norm,
            clipped,
            tokens: o.batch_size,
            total_tokens: state.total_tokens,
            tokens_per_s: o.batch_size as f64 / started.elapsed().as_secs_f64().max(1e-9),
            elapsed_s: state.elapsed_s,
            epoch,
        })?;

        let last = done == o.steps;
        if (due(config.eval_every, done) || last) && !split.val.is_empty() {
            let result = evaluate_images(&model.valid(), &split.val, &val_transform, 64)?;
            state.last_eval_loss = Some(result.loss);
            events.emit(Event::Eval {
                step: done,
                loss: result.loss,
                perplexity: result.loss.exp(),
                tokens: result.images,
                top1: Some(result.top1),
                top5: Some(result.top5),
            })?;
            last_eval = Some(result);
        }
        if due(config.checkpoint_every, done) || last {
            state.events_len = events.log.durable_len()?;
            let valid = model.valid();
            let write = |path: &Path| save_model(&valid, config, path);
            let (dir, bytes) =
                run.write_checkpoint::<Ad<B>, _, _>(&state, &model, optim.to_record(), write)?;
            events.emit(Event::Checkpoint {
                step: done,
                model: run.model_path(),
                state: dir,
                bytes,
            })?;
        }
        if events.stop {
            return Ok(summary(&state, last_eval, run));
        }
    }
    events.emit(state.run_end())?;
    Ok(summary(&state, last_eval, run))
}

fn summary(state: &TrainState, final_eval: Option<ImageEval>, run: &RunDir) -> VisionSummary {
    VisionSummary {
        steps: state.step,
        final_loss: state.last_loss,
        final_eval,
        elapsed_s: state.elapsed_s,
        model_path: run.model_path(),
    }
}

/// The run's GGUF, with the class names.
fn save_model<B: ToyBackend>(
    model: &Vit<B>,
    config: &VisionConfig,
    path: &Path,
) -> Result<u64, TrainError> {
    model
        .save_gguf(&config.vit, Some(&config.labels), path)
        .map_err(|e| TrainError::Config(e.to_string()))
}

/// The model a run starts from: drawn from the seed, or the base's weights with the
/// classifier head drawn anew when the base has another class count.
fn start_model<B: ToyBackend>(
    config: &VisionConfig,
    device: &B::Device,
) -> Result<Vit<Ad<B>>, TrainError> {
    Ad::<B>::seed(device, config.seed);
    let Some(base_path) = &config.base else {
        return Ok(config.vit.init::<Ad<B>>(device));
    };
    let base = load_vit::<B>(base_path, device).map_err(|e| TrainError::Config(e.to_string()))?;
    let same_shape = VitConfig {
        n_classes: config.vit.n_classes,
        ..base.config.clone()
    };
    if same_shape != config.vit {
        return Err(TrainError::Config(format!(
            "{}: the base's shape is not the run's",
            base_path.display()
        )));
    }
    let mut weights: HashMap<String, Vec<f32>> = base
        .model
        .timm_tensors()
        .into_iter()
        .map(|(name, _, values)| (name, values))
        .collect();
    let new_head = base.config.n_classes != config.vit.n_classes;
    let source = |name: &str, shape: &[usize], init: Init| {
        let n: usize = shape.iter().product();
        Ok::<_, std::convert::Infallible>(if new_head && name.starts_with("head.") {
            init.draw::<B>(n, device)
        } else {
            weights.remove(name).expect("the base has every tensor")
        })
    };
    match config.vit.build::<Ad<B>, _>(device, source) {
        Ok(vit) => Ok(vit),
        Err(never) => match never {},
    }
}
