//! The image-classification commands: `toy train --arch vit-tiny` (from scratch, or `--base` a
//! timm/GGUF ViT to fine-tune), `toy eval MODEL --data DIR` and `toy classify MODEL IMAGE…`.
//!
//! With no `--data`, training uses the bundled corpus: scikit-learn's 1,797 handwritten digits
//! (`fixtures/digits/`, compiled into the binary and written into the run directory).

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use toy_kernels::ToyBackend;
use toy_models::vit::VitConfig;
use toy_models::vit::gguf::load_vit;
use toy_train::config::OptimConfig;
use toy_train::events::{Event, Record};
use toy_train::images::ImageFolder;
use toy_train::vision::eval::{evaluate_images, probabilities};
use toy_train::vision::train::train_vision;
use toy_train::vision::{ImageDataConfig, VisionConfig, class_names, eval_transform, to_tensors};
use toy_train::{RunDir, RunInfo};

use crate::backend::{BackendJob, Compute, dispatch};
use crate::train::{Progress, TrainArgs, default_run_id, git_revision, human, set};

/// The bundled digits: `(train|val/<digit>/<index>.png, PNG bytes)`.
const BUNDLED_DIGITS: &[(&str, &[u8])] = include!(concat!(env!("OUT_DIR"), "/bundled_digits.rs"));

/// `toy train --arch vit-tiny`, or `--resume` of such a run (`resume`).
pub fn train(
    compute: Compute,
    args: TrainArgs,
    resume: Option<(RunDir, VisionConfig)>,
) -> Result<()> {
    let (run, config) = match resume {
        Some(resumed) => {
            if !args.devices.is_empty() {
                bail!("an image-classification run trains on one device; drop --devices");
            }
            resumed
        }
        None => new_run(&args)?,
    };
    let job = TrainJob {
        run,
        config,
        quiet: args.quiet,
        backend: compute.backend.name(),
    };
    dispatch(compute, job)
}

/// Flags of `toy train` that mean nothing to an image classifier.
fn refuse_language_flags(a: &TrainArgs) -> Result<()> {
    let given: Vec<&str> = [
        (a.recipe != "from-scratch", "--recipe"),
        (a.donor.is_some(), "--donor"),
        (a.tokenizer.is_some(), "--tokenizer"),
        (a.kv_heads.is_some(), "--kv-heads"),
        (a.context.is_some(), "--context"),
        (a.grad_accum.is_some(), "--grad-accum"),
        (a.seq_len.is_some(), "--seq-len"),
        (a.sample_every.is_some(), "--sample-every"),
        (a.prompt.is_some(), "--prompt"),
        (a.lora_rank.is_some() || a.lora_alpha.is_some(), "--lora-*"),
        (
            a.lora_dropout.is_some() || a.lora_targets.is_some(),
            "--lora-*",
        ),
        (!a.devices.is_empty(), "--devices"),
    ]
    .into_iter()
    .filter_map(|(given, flag)| given.then_some(flag))
    .collect();
    if let Some(flag) = given.first() {
        bail!("{flag} is for language models; --arch vit-tiny trains an image classifier");
    }
    Ok(())
}

/// The folders of `--data DIR`: `DIR/train` and `DIR/val` when both exist, else `DIR` with
/// `--val-fraction` of each class held out.
fn user_data(dir: &Path, val_fraction: f64) -> Result<(PathBuf, Option<PathBuf>, f64)> {
    if !dir.is_dir() {
        bail!(
            "{}: --data of --arch vit-tiny is a folder with one sub-folder of images per class",
            dir.display()
        );
    }
    let dir = dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dir.display()))?;
    let (train, val) = (dir.join("train"), dir.join("val"));
    Ok(if train.is_dir() && val.is_dir() {
        (train, Some(val), 0.0)
    } else {
        (dir, None, val_fraction)
    })
}

/// Create the run directory and the config of a new run.
fn new_run(args: &TrainArgs) -> Result<(RunDir, VisionConfig)> {
    refuse_language_flags(args)?;
    if args.data.len() > 1 {
        bail!("--arch vit-tiny takes one --data folder");
    }
    let fine_tune = args.base.is_some();
    if fine_tune
        && (args.layers.is_some()
            || args.d_model.is_some()
            || args.heads.is_some()
            || args.ffn.is_some()
            || args.image_size.is_some()
            || args.patch_size.is_some())
    {
        bail!("--base decides the model's shape; drop the model flags");
    }
    let val_fraction = args.val_fraction.unwrap_or(0.1);
    let user = args
        .data
        .first()
        .map(|d| user_data(d, val_fraction))
        .transpose()?;
    let bundled = user.is_none();
    let labels = match &user {
        Some((train, _, _)) => ImageFolder::open(train)?.classes,
        None => bundled_labels(),
    };
    let base = args
        .base
        .as_ref()
        .map(|b| {
            b.canonicalize()
                .with_context(|| format!("cannot resolve {}", b.display()))
        })
        .transpose()?;
    let vit = match &base {
        Some(path) => VitConfig {
            n_classes: labels.len(),
            ..load_vit::<burn::backend::Flex>(path, &Default::default())?.config
        },
        None => {
            let mut vit = VitConfig::vit_tiny(labels.len());
            if bundled {
                // The digits are 8×8: at 16 pixels a 4×4 patch is 2×2 of theirs, and a step
                // costs a quarter of one at 32.
                vit.image_size = 16;
            }
            set(&mut vit.image_size, args.image_size);
            set(&mut vit.patch_size, args.patch_size);
            set(&mut vit.n_layer, args.layers);
            set(&mut vit.d_model, args.d_model);
            set(&mut vit.n_head, args.heads);
            set(&mut vit.d_ff, args.ffn);
            vit
        }
    };
    let mut optim = OptimConfig {
        steps: if fine_tune { 100 } else { 400 },
        batch_size: 64,
        grad_accum: 1,
        seq_len: 1,
        lr: if fine_tune { 1e-4 } else { 2e-3 },
        min_lr: if fine_tune { 1e-6 } else { 2e-5 },
        warmup_steps: if fine_tune { 10 } else { 40 },
        weight_decay: 0.05,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-8,
        grad_clip: 1.0,
        devices: 1,
    };
    args.override_optim(&mut optim);
    let placeholder = PathBuf::from("(bundled)");
    let (train, val, val_fraction) = user.unwrap_or((placeholder, None, 0.0));
    let mut config = VisionConfig {
        data: ImageDataConfig {
            train,
            val,
            val_fraction,
            crop_padding: args
                .crop_padding
                .unwrap_or(if bundled { 0 } else { vit.image_size / 8 }),
            flip: args.flip,
        },
        vit,
        labels,
        optim,
        eval_every: args.eval_every.unwrap_or(50),
        checkpoint_every: args.checkpoint_every.unwrap_or(100),
        base,
        seed: args.seed,
    };
    // Refuse a bad shape or schedule before creating anything on disk.
    config.check()?;
    let run = RunDir::create(
        &args.runs_dir,
        &args.run_id.clone().unwrap_or_else(default_run_id),
    )?;
    if args.data.is_empty() {
        let root = write_bundled(&run)?;
        config.data.train = root.join("train");
        config.data.val = Some(root.join("val"));
    }
    Ok((run, config))
}

/// The bundled digits' class names: `0` … `9`.
fn bundled_labels() -> Vec<String> {
    let mut labels: Vec<String> = BUNDLED_DIGITS
        .iter()
        .filter_map(|(name, _)| name.split('/').nth(1).map(str::to_string))
        .collect();
    labels.sort();
    labels.dedup();
    labels
}

/// Write the bundled digits into `run/bundled/digits`; returns that folder.
fn write_bundled(run: &RunDir) -> Result<PathBuf> {
    let root = run
        .path
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", run.path.display()))?
        .join("bundled/digits");
    for (name, bytes) in BUNDLED_DIGITS {
        let path = root.join(name);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        toy_core::atomic::write_atomic(&path, bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(root)
}

struct TrainJob {
    run: RunDir,
    config: VisionConfig,
    quiet: bool,
    backend: &'static str,
}

impl BackendJob for TrainJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let TrainJob {
            run,
            config,
            quiet,
            backend,
        } = self;
        if !quiet {
            eprintln!("run {} ({})", run.id, run.path.display());
        }
        let progress = Progress::new(config.optim.steps, quiet);
        let (bar, plain) = (&progress.bar, progress.plain);
        let say = |line: String| progress.say(line);
        let v = &config.vit;
        let show = |record: &Record| match &record.event {
            Event::VisionRunStart {
                n_params,
                n_classes,
                train_images,
                val_images,
                resumed_from_step,
                ..
            } => {
                bar.set_position(resumed_from_step.unwrap_or(0) as u64);
                bar.reset_eta();
                let from = match &config.base {
                    Some(base) => format!("fine-tuning {}", base.display()),
                    None => "vit from scratch".to_string(),
                };
                say(format!(
                    "{from} | {} params, {} layers × d {}, {}×{} images in {}×{} patches | {n_classes} classes, {train_images} training and {val_images} held-out images | {} steps × {} images{}",
                    human(*n_params as f64),
                    v.n_layer,
                    v.d_model,
                    v.image_size,
                    v.image_size,
                    v.patch_size,
                    v.patch_size,
                    config.optim.steps,
                    config.optim.batch_size,
                    resumed_from_step
                        .map(|s| format!(" | resumed after step {s}"))
                        .unwrap_or_default(),
                ));
            }
            Event::Step {
                step,
                loss,
                lr,
                tokens_per_s,
                ..
            } => {
                bar.set_position(*step as u64);
                bar.set_message(format!(
                    "loss {loss:.3} lr {lr:.1e} {tokens_per_s:.0} img/s"
                ));
                if plain && (*step % 50 == 0 || *step == 1) {
                    eprintln!("step {step}: loss {loss:.3} lr {lr:.1e} {tokens_per_s:.0} img/s");
                }
            }
            Event::Eval {
                step,
                loss,
                top1,
                top5,
                ..
            } => say(format!(
                "eval after step {step}: loss {loss:.3}, top-1 {:.1}%, top-5 {:.1}%",
                100.0 * top1.unwrap_or(f64::NAN),
                100.0 * top5.unwrap_or(f64::NAN)
            )),
            _ => {}
        };
        let mut observer = |record: &Record| {
            show(record);
            ControlFlow::Continue(())
        };
        let info = RunInfo {
            backend: backend.to_string(),
            git_revision: git_revision(),
        };
        let summary = train_vision::<B>(&run, &config, &info, &device, &mut observer)
            .with_context(|| format!("run {}", run.path.display()))?;
        bar.finish_and_clear();
        let eval = summary
            .final_eval
            .as_ref()
            .map(|e| {
                format!(
                    ", held-out top-1 {:.1}% (top-5 {:.1}%) of {} images",
                    100.0 * e.top1,
                    100.0 * e.top5,
                    e.images
                )
            })
            .unwrap_or_default();
        let model = summary.model_path.display();
        let example = config
            .data
            .val
            .as_ref()
            .unwrap_or(&config.data.train)
            .display();
        writeln!(
            std::io::stderr().lock(),
            "trained {} steps in {:.1} s: loss {:.3}{eval}\nmodel: {model}\n  try: toy eval {model} --data {example}\n       toy classify {model} IMAGE…",
            summary.steps,
            summary.elapsed_s,
            summary.final_loss.unwrap_or(f64::NAN),
        )?;
        Ok(())
    }
}

/// `toy eval MODEL --data DIR` with a ViT: accuracy, cross-entropy and the confusion matrix.
pub fn eval(compute: Compute, model: &Path, data: &Path, json: bool) -> Result<()> {
    dispatch(
        compute,
        EvalJob {
            model: model.to_path_buf(),
            data: data.to_path_buf(),
            json,
        },
    )
}

struct EvalJob {
    model: PathBuf,
    data: PathBuf,
    json: bool,
}

impl BackendJob for EvalJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let vit = load_vit::<B>(&self.model, &device)?;
        let folder = ImageFolder::open(&self.data)?;
        let labels = class_names(vit.labels.as_deref(), vit.config.n_classes);
        if vit.labels.is_some() && folder.classes != labels {
            bail!(
                "{}: its class folders {:?} are not the classes of {} ({:?})",
                self.data.display(),
                folder.classes,
                self.model.display(),
                labels
            );
        }
        if folder.classes.len() > vit.config.n_classes {
            bail!(
                "{}: {} class folders, but {} has {} classes",
                self.data.display(),
                folder.classes.len(),
                self.model.display(),
                vit.config.n_classes
            );
        }
        let result = evaluate_images(
            &vit.model,
            &folder.samples,
            &eval_transform(&vit.config),
            64,
        )?;
        let mut out = std::io::stdout().lock();
        if self.json {
            let json = serde_json::json!({
                "model": self.model,
                "data": self.data,
                "images": result.images,
                "classes": labels,
                "loss": result.loss,
                "top1": result.top1,
                "top5": result.top5,
                "confusion": result.confusion,
            });
            writeln!(out, "{json}")?;
            return Ok(());
        }
        writeln!(
            out,
            "{} images of {} classes: top-1 {:.2}%, top-5 {:.2}%, cross-entropy {:.4} nats",
            result.images,
            folder.classes.len(),
            100.0 * result.top1,
            100.0 * result.top5,
            result.loss
        )?;
        if labels.len() <= 20 {
            let width = labels.iter().map(|l| l.len()).max().unwrap_or(1).max(5);
            writeln!(out, "confusion (rows: true class, columns: predicted):")?;
            write!(out, "{:>width$}", "")?;
            for l in &labels {
                write!(out, " {l:>width$}")?;
            }
            writeln!(out)?;
            for (l, row) in labels.iter().zip(&result.confusion) {
                write!(out, "{l:>width$}")?;
                for n in row {
                    write!(out, " {n:>width$}")?;
                }
                writeln!(out)?;
            }
        }
        Ok(())
    }
}

#[derive(Args, Debug, Clone)]
pub struct ClassifyArgs {
    /// The ViT: a GGUF from `toy train --arch vit-tiny`, or a timm `.safetensors`.
    pub model: PathBuf,
    /// Images to classify (PNG or JPEG).
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    /// How many of the most likely classes to print per image.
    #[arg(long, short = 'k', default_value_t = 5)]
    pub top: usize,
    /// Print one JSON object per image instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn classify(compute: Compute, args: ClassifyArgs) -> Result<()> {
    dispatch(compute, ClassifyJob(args))
}

struct ClassifyJob(ClassifyArgs);

impl BackendJob for ClassifyJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let vit = load_vit::<B>(&args.model, &device)?;
        let labels = class_names(vit.labels.as_deref(), vit.config.n_classes);
        let transform = eval_transform(&vit.config);
        let mut out = std::io::stdout().lock();
        // One forward pass per batch of images, as `toy eval` scores them.
        let samples: Vec<(PathBuf, usize)> = args.images.iter().map(|p| (p.clone(), 0)).collect();
        for chunk in samples.chunks(64) {
            let (images, _) = to_tensors::<B>(chunk, &transform, &device, |_| {
                toy_core::rng::SplitMix64::new(0)
            })?;
            for ((path, _), probs) in chunk.iter().zip(probabilities(&vit.model, images)?) {
                let mut order: Vec<usize> = (0..probs.len()).collect();
                order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
                order.truncate(args.top.max(1));
                if args.json {
                    let top: Vec<_> = order
                        .iter()
                        .map(|&c| serde_json::json!({"class": c, "label": labels[c], "probability": probs[c]}))
                        .collect();
                    writeln!(out, "{}", serde_json::json!({"image": path, "top": top}))?;
                } else {
                    let top: Vec<String> = order
                        .iter()
                        .map(|&c| format!("{} {:.1}%", labels[c], 100.0 * probs[c]))
                        .collect();
                    writeln!(out, "{}: {}", path.display(), top.join(", "))?;
                }
            }
        }
        Ok(())
    }
}
