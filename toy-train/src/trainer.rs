//! The training loop of the from-scratch recipe, on `Autodiff<B>`.
//!
//! Each optimizer step: `grad_accum` micro-batches, each forward → cross-entropy (divided by
//! `grad_accum`, so the summed gradients are those of the mean loss) → backward, their gradients
//! summed; the global gradient norm clipped; one AdamW step at the scheduled learning rate. Then,
//! on their cadence: held-out evaluation, a generated sample, a checkpoint. Every event goes to
//! `events.jsonl` and to the caller's observer (the CLI draws its progress bar from them).
//!
//! Determinism: the weights come from the seed ([`crate::init`]), micro-batch `g` is a
//! pure function of `(seed, g)` (see [`crate::data`]), the schedule a pure function of the step,
//! and the samples use their own seeded sampler. On a backend whose ops are deterministic (both
//! CPU backends are) the same seed gives the same loss curve, and a resumed run continues the
//! same curve: the checkpoint restores the weights and AdamW moments exactly (f32 records).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{ElementConversion, Tensor};
use toy_core::gguf::{GgufFile, Value};
use toy_core::sampling::{Sampler, SamplingParams};
use toy_core::tokenizer::Tokenizer;
use toy_kernels::ToyBackend;
use toy_models::generate::{GenerateOptions, generate};
use toy_models::lora::{self, LoraAdapters};
use toy_models::{CausalLm, LlamaConfig, Model};

use crate::TrainError;
use crate::adapter::Adapter;
use crate::checkpoint::{RunDir, TrainState};
use crate::config::{Arch, Recipe, TrainConfig};
use crate::data::{Batch, TokenData, tokenize_files};
use crate::eval::{EvalResult, evaluate_batches};
use crate::events::{Event, EventLog, Record};
use crate::finetune::{Base, start_model};
use crate::model::{DonorEmbedding, ModelSpec, Trainee, init_trainee};
use crate::optim::{OptimRecord, TrainOptimizer, clip_grads};
use crate::parallel::{self, Place};
use crate::schedule::learning_rate;

/// Everything a run needs besides the backend: the config, the tokenizer and its metadata, the
/// tokenized data.
pub struct TrainSetup {
    /// The run's configuration.
    pub config: TrainConfig,
    /// The tokenizer of `config.data.tokenizer`.
    pub tokenizer: Tokenizer,
    /// `tokenizer.*` metadata of the tokenizer GGUF, copied into every checkpoint.
    pub tokenizer_metadata: Vec<(String, Value)>,
    /// The tokenized training and held-out data.
    pub data: TokenData,
    /// The base model of a fine-tuning recipe (`lora`, `qlora`, `full`).
    pub base: Option<Base>,
    /// The donor's token embeddings (warm start).
    pub donor: Option<DonorEmbedding>,
}

impl TrainSetup {
    /// Load the tokenizer and tokenize the data of `config`.
    pub fn prepare(config: TrainConfig) -> Result<Self, TrainError> {
        config.check()?;
        let base = config.recipe.base().map(Base::open).transpose()?;
        if let Some(b) = &base
            && config.optim.seq_len > b.config.context_length
        {
            return Err(TrainError::Config(format!(
                "sequence length {} is longer than the base model's context {}",
                config.optim.seq_len, b.config.context_length
            )));
        }
        let file = GgufFile::open(&config.data.tokenizer).map_err(|e| {
            TrainError::Config(format!(
                "cannot open the tokenizer {}: {e}",
                config.data.tokenizer.display()
            ))
        })?;
        let tokenizer = Tokenizer::from_gguf(&file).map_err(|e| {
            TrainError::Config(format!(
                "{} has no usable tokenizer: {e}",
                config.data.tokenizer.display()
            ))
        })?;
        let tokenizer_metadata = file
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect();
        let donor = match &config.recipe {
            Recipe::WarmStart { donor } => {
                check_same_vocabulary(&file, &config.data.tokenizer, donor)?;
                Some(DonorEmbedding::read(donor)?)
            }
            _ => None,
        };
        let tokens = tokenize_files(&tokenizer, &config.data.files)?;
        let data = TokenData::new(tokens, config.optim.seq_len, config.data.val_fraction)?;
        if data.batches_per_epoch(config.optim.micro_batch_rows()) == 0 {
            return Err(TrainError::Data(format!(
                "{} training sequences of {} tokens are fewer than one batch of {} (--batch-size × devices); add text or lower --batch-size/--seq-len",
                data.n_train(),
                config.optim.seq_len,
                config.optim.micro_batch_rows()
            )));
        }
        Ok(TrainSetup {
            config,
            tokenizer,
            tokenizer_metadata,
            data,
            base,
            donor,
        })
    }

    /// The architecture and shape of the model: the base's, or the config's with the
    /// tokenizer's vocabulary.
    pub fn model_spec(&self) -> ModelSpec {
        match (&self.base, self.config.model.arch) {
            (Some(base), _) => base.spec(&self.config.recipe),
            (None, Arch::Llama) => ModelSpec::Llama(self.llama_config()),
            (None, Arch::Gpt2) => {
                ModelSpec::Gpt2(self.config.model.gpt2(self.tokenizer.vocab_size()))
            }
        }
    }

    /// The llama config of the run: its base's when that is a llama-family model, else the
    /// config's with the tokenizer's vocabulary.
    pub fn llama_config(&self) -> LlamaConfig {
        match self.base.as_ref().map(|b| b.spec(&self.config.recipe)) {
            Some(ModelSpec::Llama(c)) => c,
            _ => self.config.model.llama(self.tokenizer.vocab_size()),
        }
    }

    /// Whether the run trains LoRA adapters (and checkpoints only them).
    fn trains_adapters(&self) -> bool {
        self.config.recipe.adapter().is_some()
    }

    /// What a checkpoint leaves for users: `model.gguf`, or `adapter.gguf` (with its PEFT
    /// twins) for a LoRA run.
    pub fn output_path(&self, run: &RunDir) -> PathBuf {
        if self.trains_adapters() {
            run.path.join("adapter.gguf")
        } else {
            run.model_path()
        }
    }

    /// Write the checkpoint's user-facing files (see [`Self::output_path`]).
    fn write_outputs<B: ToyBackend>(
        &self,
        model: &Model<B>,
        spec: &ModelSpec,
        meta: &[(String, Value)],
        run: &RunDir,
    ) -> Result<u64, TrainError> {
        match (&self.base, self.config.recipe.adapter(), model) {
            (Some(base), Some(a), model) => {
                let adapter = Adapter::from_model(model, a.alpha, a.dropout)?;
                adapter.write_all(
                    &run.path,
                    base.qk_layout(),
                    base.architecture(),
                    &base.name(),
                    &format!("toy {} {}", self.config.recipe, run.id),
                )
            }
            // A full fine-tune keeps the base's architecture (its metadata and tensor set;
            // GPT-2 has one tensor set, which `spec.save` writes with the base's tokenizer).
            (Some(base), None, Model::Llama(model)) => {
                let ModelSpec::Llama(config) = spec else {
                    unreachable!("a llama-family base gives a llama spec")
                };
                Ok(toy_models::save_like_base(
                    model,
                    config,
                    &base.file,
                    meta,
                    run.model_path(),
                )?)
            }
            _ => spec.save(model, meta, &run.model_path()),
        }
    }

    /// The metadata written into checkpoints besides the model's own keys.
    fn gguf_metadata(&self, run_id: &str) -> Vec<(String, Value)> {
        let mut meta = vec![(
            "general.name".to_string(),
            Value::String(format!("toy {} {run_id}", self.config.recipe)),
        )];
        meta.extend(self.tokenizer_metadata.iter().cloned());
        meta
    }
}

/// Facts about the environment recorded in `run_start`.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// The backend's name (`cpu`, `ndarray`, …).
    pub backend: String,
    /// The commit of the toy source the binary was built from (`-dirty` with uncommitted
    /// changes), when known.
    pub git_revision: Option<String>,
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// Optimizer steps done.
    pub steps: usize,
    /// The last step's training loss.
    pub final_loss: Option<f64>,
    /// The last held-out evaluation since the run (re)started, if any.
    pub final_eval: Option<EvalResult>,
    /// Tokens predicted over the whole run.
    pub total_tokens: usize,
    /// Training seconds, not counting time while the run was stopped.
    pub elapsed_s: f64,
    /// What the run leaves for users: `model.gguf`, or `adapter.gguf` for a LoRA run.
    pub model_path: PathBuf,
}

type Ad<B> = Autodiff<B>;

/// Train `setup` in `run` (a new run, or `--resume` when it holds a checkpoint). Events go to
/// `runs/<id>/events.jsonl` and to `observer`, which may stop the run early by returning
/// `ControlFlow::Break` (after a `checkpoint` event, the run can then be resumed from there);
/// a run stopped early writes no `run_end`.
pub fn train<B: ToyBackend>(
    run: &RunDir,
    setup: &TrainSetup,
    info: &RunInfo,
    device: &B::Device,
    observer: &mut dyn FnMut(&Record) -> ControlFlow<()>,
) -> Result<RunSummary, TrainError> {
    train_data_parallel::<B>(run, setup, info, std::slice::from_ref(device), observer)
}

/// [`train`] with one replica of the model per device of `devices` (as many as the config's
/// `optim.devices`), each on its own thread: every optimizer step, each replica computes the
/// gradients of its shard of every micro-batch, the replicas average them through burn's
/// collective ([`crate::parallel`]), and each steps its own optimizer with the same mean — so
/// the replicas stay equal without copying weights. The replica on `devices[0]` evaluates,
/// samples, writes the events and the checkpoints; the others wait for its next step.
pub fn train_data_parallel<B: ToyBackend>(
    run: &RunDir,
    setup: &TrainSetup,
    info: &RunInfo,
    devices: &[B::Device],
    observer: &mut dyn FnMut(&Record) -> ControlFlow<()>,
) -> Result<RunSummary, TrainError> {
    let config = &setup.config;
    if devices.len() != config.optim.devices {
        return Err(TrainError::Config(format!(
            "the run has {} data-parallel replicas but {} devices were given",
            config.optim.devices,
            devices.len()
        )));
    }
    let device = &devices[0];
    let o = &config.optim;
    let spec = setup.model_spec();
    let meta = setup.gguf_metadata(&run.id);
    let checkpoint = run.latest()?;

    // The model and optimizer: fresh from the seed (or the base), or restored exactly.
    let mut model: Trainee<Ad<B>> = match &setup.base {
        Some(base) => Trainee {
            model: start_model(config, base, device)?,
            embd_proj: None,
        },
        None => init_trainee(&spec, config.seed, setup.donor.as_ref(), device)?,
    };
    let mut optim = TrainOptimizer::<Ad<B>, Trainee<Ad<B>>>::new(o);
    let donor = donor_table(setup, &model, device);
    let mut state = TrainState::default();
    let resumed = checkpoint.is_some();
    if let Some(dir) = &checkpoint {
        // A LoRA checkpoint records the adapters only (the base is the base GGUF).
        let (saved, optim_record) = if setup.trains_adapters() {
            let (saved, record, optim_record) = RunDir::read_checkpoint::<
                Ad<B>,
                <LoraAdapters<Ad<B>> as Module<Ad<B>>>::Record,
                OptimRecord<Ad<B>>,
            >(dir, device)?;
            let restored = lora::adapters(&model.model).load_record(record);
            model.model = lora::install(model.model, restored)
                .map_err(|e| TrainError::Record(e.to_string()))?;
            (saved, optim_record)
        } else {
            let (saved, model_record, optim_record) =
                RunDir::read_checkpoint::<Ad<B>, _, OptimRecord<Ad<B>>>(dir, device)?;
            model = model.load_record(model_record);
            (saved, optim_record)
        };
        optim = optim.load_record(optim_record);
        state = saved;
        // A kill between the checkpoint and the GGUF leaves an older model.gguf: bring it level.
        setup.write_outputs(&plain(&model, donor.as_ref()), &spec, &meta, run)?;
    } else {
        run.write_config(config)?;
    }
    let mut events = Events::open(run, resumed.then_some(state.events_len), observer)?;

    events.emit(Event::RunStart {
        run_id: run.id.clone(),
        config: Box::new(config.clone()),
        backend: info.backend.clone(),
        device: match devices {
            [one] => format!("{one:?}"),
            all => format!("{all:?}"),
        },
        seed: config.seed,
        git_revision: info.git_revision.clone(),
        toy_version: env!("CARGO_PKG_VERSION").to_string(),
        n_params: model.num_params(),
        vocab_size: spec.vocab_size(),
        data_tokens: setup.data.n_tokens(),
        train_sequences: setup.data.n_train(),
        val_sequences: setup.data.n_val(),
        tokens_per_step: o.tokens_per_step(),
        devices: o.devices,
        global_batch: o.global_batch(),
        resumed_from_step: resumed.then_some(state.step),
    })?;
    if !resumed {
        events.emit(sample(&plain(&model, donor.as_ref()), setup, 0)?)?;
    }

    // The other replicas: forks of this one's weights and optimizer state, one thread each,
    // told each step to take by a channel (closed when this replica stops, for any reason).
    let group = (devices.len() > 1).then(parallel::Group::<B>::open);
    let place = |rank: usize| Place {
        rank,
        count: devices.len(),
    };
    std::thread::scope(|scope| {
        let (followers, threads): (Vec<_>, Vec<_>) = devices[1..]
            .iter()
            .enumerate()
            .map(|(i, device)| {
                let model = model.clone().fork(device);
                let replica = Replica {
                    donor: donor_table(setup, &model, device),
                    model,
                    optim: TrainOptimizer::new(o).load_record(optim.to_record()),
                    place: place(i + 1),
                    device: device.clone(),
                };
                let (steps, next) = mpsc::channel::<usize>();
                let group = group.as_ref().expect("a group for several devices");
                let thread = scope.spawn(move || replica.follow(setup, next, group));
                (steps, thread)
            })
            .unzip();
        let leader = Replica {
            model,
            optim,
            donor,
            place: place(0),
            device: device.clone(),
        };
        let ended = lead(
            leader,
            &followers,
            setup,
            run,
            &spec,
            &meta,
            &mut state,
            &mut events,
        );
        // Closing the channels ends the followers that wait for a step; a reset of the
        // collective fails the all-reduce of any that went ahead without this replica.
        drop(followers);
        if let (Err(_), Some(group)) = (&ended, &group) {
            while !threads.iter().all(|t| t.is_finished()) {
                group.abort();
                std::thread::sleep(ABORT_EVERY);
            }
        }
        let mut first_error = None;
        for thread in threads {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        // A follower's own failure is the cause of the leader's (a failed all-reduce).
        match (ended, first_error) {
            (Ok(s), None) => Ok(s),
            (Err(e), None) | (_, Some(e)) => Err(e),
        }
    })
}

/// How often a failed data-parallel run resets the collective until every replica has stopped.
const ABORT_EVERY: std::time::Duration = std::time::Duration::from_millis(20);

/// One replica of a data-parallel run (or the only one): its weights, optimizer state and the
/// donor table of a warm start, on its device.
struct Replica<B: ToyBackend> {
    model: Trainee<Ad<B>>,
    optim: TrainOptimizer<Ad<B>, Trainee<Ad<B>>>,
    donor: Option<Tensor<Ad<B>, 2>>,
    place: Place,
    device: B::Device,
}

/// What an optimizer step reports (the same on every replica).
struct StepOutcome {
    lr: f64,
    loss: f64,
    grad_norm: f64,
    clipped: bool,
    epoch: u64,
}

impl<B: ToyBackend> Replica<B> {
    /// One optimizer step: this replica's shard of each of the step's micro-batches, the
    /// gradients averaged with the other replicas', clipped by their global norm, one AdamW
    /// step. By value: the optimizer takes the only handle on the weights, so that its
    /// updates may reuse their buffers.
    fn step(mut self, setup: &TrainSetup, step: usize) -> Result<(Self, StepOutcome), TrainError> {
        let (config, o, place) = (&setup.config, &setup.config.optim, self.place);
        let lr = learning_rate(o, step);
        let batches = (0..o.grad_accum)
            .map(|m| {
                let g = (step * o.grad_accum + m) as u64;
                let all = setup
                    .data
                    .train_batch(config.seed, g, o.micro_batch_rows())?;
                Ok(all.shard(place.rank, place.count))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
        let epoch = batches[0].epoch;
        // LoRA dropout masks: a function of the seed and the step.
        lora::set_dropout_seed(
            &mut self.model.model,
            config.seed ^ (step as u64).wrapping_mul(0x2545_F491_4F6C_DD1D),
        );
        let (mut grads, loss) =
            accumulate_grads(&self.model, self.donor.as_ref(), &batches, &self.device);
        let loss = place.mean_over_replicas::<B, _>(&self.model, &mut grads, loss, &self.device)?;
        let (norm, clipped) = clip_grads::<Ad<B>, _>(&self.model, &mut grads, o.grad_clip, step)?;
        self.model = self.optim.step(lr, self.model, grads);
        let outcome = StepOutcome {
            lr,
            loss,
            grad_norm: norm,
            clipped,
            epoch,
        };
        Ok((self, outcome))
    }

    /// The steps the leader sends, until it closes the channel.
    fn take_steps(
        mut self,
        setup: &TrainSetup,
        steps: &mpsc::Receiver<usize>,
    ) -> Result<(), TrainError> {
        self.place.join::<B>(&self.device)?;
        while let Ok(step) = steps.recv() {
            self = self.step(setup, step)?.0;
        }
        Ok(())
    }

    /// A follower's run: the steps the leader sends, until it closes the channel. A follower
    /// that fails keeps failing the collective's pending operations until the leader has
    /// stopped: the leader (or another follower) may be waiting in an all-reduce for it, or
    /// enter one after a single reset.
    fn follow(
        self,
        setup: &TrainSetup,
        steps: mpsc::Receiver<usize>,
        group: &parallel::Group<B>,
    ) -> Result<(), TrainError> {
        let place = self.place;
        let result = self.take_steps(setup, &steps);
        match &result {
            Ok(()) => place.leave::<B>(),
            Err(_) => loop {
                group.abort();
                match steps.recv_timeout(ABORT_EVERY) {
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                }
            },
        }
        result
    }
}

/// The leader's run: each step (sent to the followers first), then on their cadence the
/// evaluation, the sample and the checkpoint, all from this replica.
#[allow(clippy::too_many_arguments)]
fn lead<B: ToyBackend>(
    mut replica: Replica<B>,
    followers: &[mpsc::Sender<usize>],
    setup: &TrainSetup,
    run: &RunDir,
    spec: &ModelSpec,
    meta: &[(String, Value)],
    state: &mut TrainState,
    events: &mut Events<'_>,
) -> Result<RunSummary, TrainError> {
    let (config, o) = (&setup.config, &setup.config.optim);
    replica.place.join::<B>(&replica.device)?;
    let cadence = &config.cadence;
    let due = |every: usize, step: usize| every > 0 && step.is_multiple_of(every);
    let mut last_eval = None;
    let run_clock = Instant::now();
    let elapsed_before = state.elapsed_s;
    for step in state.step..o.steps {
        let started = Instant::now();
        for steps in followers {
            // A follower that has stopped has its error waiting at the join.
            let _ = steps.send(step);
        }
        let outcome;
        (replica, outcome) = replica.step(setup, step)?;
        let StepOutcome {
            lr,
            loss,
            grad_norm: norm,
            clipped,
            epoch,
        } = outcome;
        let (model, donor) = (&replica.model, replica.donor.as_ref());

        let done = step + 1;
        let tokens = o.tokens_per_step();
        state.step = done;
        state.total_tokens += tokens;
        state.last_loss = Some(loss);
        state.elapsed_s = elapsed_before + run_clock.elapsed().as_secs_f64();
        events.emit(Event::Step {
            step: done,
            loss,
            lr,
            grad_norm: norm,
            clipped,
            tokens,
            total_tokens: state.total_tokens,
            tokens_per_s: tokens as f64 / started.elapsed().as_secs_f64().max(1e-9),
            elapsed_s: state.elapsed_s,
            epoch,
        })?;

        let last = done == o.steps;
        if (due(cadence.eval_every, done) || last) && setup.data.n_val() > 0 {
            let batches = setup.data.val_batches(o.batch_size, cadence.eval_batches);
            let result = evaluate_batches(&plain(model, donor), &batches)?;
            state.last_eval_loss = Some(result.mean_nll);
            events.emit(Event::Eval {
                step: done,
                loss: result.mean_nll,
                perplexity: result.perplexity,
                tokens: result.scored,
                top1: None,
                top5: None,
            })?;
            last_eval = Some(result);
        }
        if due(cadence.sample_every, done) || last {
            events.emit(sample(&plain(model, donor), setup, done)?)?;
        }
        if due(cadence.checkpoint_every, done) || last {
            state.events_len = events.log.durable_len()?;
            let valid = plain(model, donor);
            let write = |_: &Path| setup.write_outputs(&valid, spec, meta, run);
            let (dir, bytes) = if setup.trains_adapters() {
                let adapters = lora::adapters(&model.model);
                run.write_checkpoint::<Ad<B>, _, _>(
                    state,
                    &adapters,
                    replica.optim.to_record(),
                    write,
                )?
            } else {
                run.write_checkpoint::<Ad<B>, _, _>(state, model, replica.optim.to_record(), write)?
            };
            events.emit(Event::Checkpoint {
                step: done,
                model: setup.output_path(run),
                state: dir,
                bytes,
            })?;
        }
        if events.stop {
            replica.place.leave::<B>();
            return Ok(summary(state, last_eval, setup.output_path(run)));
        }
    }

    events.emit(state.run_end())?;
    replica.place.leave::<B>();
    Ok(summary(state, last_eval, setup.output_path(run)))
}

/// The donor's table on `device`, when `model`'s token embedding is computed from it (a warm
/// start across widths): a constant of the graph.
fn donor_table<B: ToyBackend>(
    setup: &TrainSetup,
    model: &Trainee<Ad<B>>,
    device: &B::Device,
) -> Option<Tensor<Ad<B>, 2>> {
    match (&setup.donor, &model.embd_proj) {
        (Some(d), Some(_)) => Some(d.tensor(device)),
        _ => None,
    }
}

/// The plain model on the inner backend — what is evaluated, sampled and saved: with a
/// projection, its token embedding folded from the donor's table.
fn plain<B: ToyBackend>(model: &Trainee<Ad<B>>, donor: Option<&Tensor<Ad<B>, 2>>) -> Model<B> {
    let valid = model.valid();
    match donor {
        Some(d) => valid.folded(&d.clone().inner()),
        None => valid.model,
    }
}

fn summary(state: &TrainState, final_eval: Option<EvalResult>, model_path: PathBuf) -> RunSummary {
    RunSummary {
        steps: state.step,
        final_loss: state.last_loss,
        final_eval,
        total_tokens: state.total_tokens,
        elapsed_s: state.elapsed_s,
        model_path,
    }
}

/// The event log and the caller's observer.
pub(crate) struct Events<'a> {
    pub(crate) log: EventLog,
    pub(crate) observer: &'a mut dyn FnMut(&Record) -> ControlFlow<()>,
    /// The observer asked to stop.
    pub(crate) stop: bool,
}

impl<'a> Events<'a> {
    /// `run`'s event log, cut back to `resumed_len` bytes when resuming.
    pub(crate) fn open(
        run: &RunDir,
        resumed_len: Option<u64>,
        observer: &'a mut dyn FnMut(&Record) -> ControlFlow<()>,
    ) -> Result<Self, TrainError> {
        Ok(Events {
            log: EventLog::open(&run.events_path(), resumed_len)?,
            observer,
            stop: false,
        })
    }

    pub(crate) fn emit(&mut self, event: Event) -> Result<(), TrainError> {
        let record = event.record();
        self.log.write(&record)?;
        self.stop |= (self.observer)(&record).is_break();
        Ok(())
    }
}

/// Gradients of the mean cross-entropy over `batches` (micro-batches of equal size), summed one
/// micro-batch at a time so that only one micro-batch's activations are alive at once; and that
/// mean loss. The result equals the gradient of one forward over all the batches' sequences.
///
/// `donor`: the donor's embedding table when `model` has a projection of it (a warm start).
pub fn accumulate_grads<B: ToyBackend>(
    model: &Trainee<Ad<B>>,
    donor: Option<&Tensor<Ad<B>, 2>>,
    batches: &[Batch],
    device: &B::Device,
) -> (GradientsParams, f64) {
    let mut accumulator = GradientsAccumulator::<Trainee<Ad<B>>>::new();
    let mut loss_sum = 0.0;
    for (m, batch) in batches.iter().enumerate() {
        // Each micro-batch draws its own LoRA dropout masks.
        let reseeded;
        let model = if m > 0 && lora::has_dropout(&model.model) {
            let mut clone = model.model.clone();
            lora::advance_dropout(&mut clone, m as u64);
            reseeded = Trainee {
                model: clone,
                embd_proj: model.embd_proj.clone(),
            };
            &reseeded
        } else {
            model
        };
        let (inputs, targets) = batch.tensors::<Ad<B>>(device);
        let loss = model.loss(inputs, targets, donor);
        loss_sum += loss.clone().into_scalar().elem::<f64>();
        // Each micro-batch's share of the mean: the summed gradients are the mean's gradient.
        let grads = loss.div_scalar(batches.len() as f64).backward();
        accumulator.accumulate(model, GradientsParams::from_grads(grads, model));
    }
    (accumulator.grads(), loss_sum / batches.len() as f64)
}

/// Generate a sample from the configured prompt (seeded by the run's seed and the step).
fn sample<B: ToyBackend>(
    model: &impl CausalLm<B>,
    setup: &TrainSetup,
    step: usize,
) -> Result<Event, TrainError> {
    let c = &setup.config.cadence;
    let tok = &setup.tokenizer;
    let prompt = tok
        .encode(&c.sample_prompt, true, true)
        .map_err(|e| TrainError::Config(format!("cannot tokenize the sample prompt: {e}")))?;
    let room = model.context_length().saturating_sub(prompt.len());
    let seed = setup.config.seed.wrapping_add(step as u64);
    let mut text = c.sample_prompt.clone();
    if !prompt.is_empty() && room > 0 {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: c.sample_temperature,
            seed,
            ..SamplingParams::default()
        });
        let options = GenerateOptions {
            max_new_tokens: c.sample_tokens.min(room),
            stop_at_eog: true,
        };
        let (ids, _) = generate(
            model,
            &prompt,
            &options,
            &mut sampler,
            |id| tok.is_eog(id),
            |_| ControlFlow::Continue(()),
        )
        .map_err(|e| TrainError::Backend(e.to_string()))?;
        text.push_str(&tok.decode(&ids));
    }
    Ok(Event::Sample {
        step,
        prompt: c.sample_prompt.clone(),
        text,
        temperature: c.sample_temperature,
        seed,
    })
}

/// A warm start's vocabulary is the donor's: the tokenizer must be the donor's own (the CLI
/// takes it from the donor), or one with the identical token list.
fn check_same_vocabulary(
    tokenizer_file: &GgufFile,
    tokenizer_path: &Path,
    donor: &Path,
) -> Result<(), TrainError> {
    let donor_file = GgufFile::open(donor).map_err(|e| {
        TrainError::Config(format!("cannot open the donor {}: {e}", donor.display()))
    })?;
    let tokens = |f: &GgufFile| f.get("tokenizer.ggml.tokens").cloned();
    if tokens(&donor_file).is_none() || tokens(&donor_file) != tokens(tokenizer_file) {
        return Err(TrainError::Config(format!(
            "warm-start uses the donor's tokenizer, and {} has another vocabulary than the donor {}; drop --tokenizer",
            tokenizer_path.display(),
            donor.display()
        )));
    }
    Ok(())
}
