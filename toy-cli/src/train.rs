//! `toy train`: train a model from scratch (the `from-scratch` recipe) with a progress bar.
//!
//! With no arguments it trains the `tiny` preset on the bundled corpus with the bundled
//! tokenizer (both compiled into the binary and written into the run directory, so the run can
//! be resumed from anywhere).

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use toy_kernels::ToyBackend;
use toy_train::config::{Arch, LoraSettings, OptimConfig};
use toy_train::events::{Event, Record};
use toy_train::vision::train::read_vision_config;
use toy_train::{
    DataConfig, Preset, Recipe, RunDir, RunInfo, TrainConfig, TrainSetup, train_data_parallel,
};

use crate::backend::{BackendJob, BackendKind, Compute, FloatKind, dispatch};

/// The bundled corpus and tokenizer (`fixtures/corpus/`, made by `make_corpus.py`).
const BUNDLED_CORPUS: &[u8] = include_bytes!("../../fixtures/corpus/stories.txt");
const BUNDLED_TOKENIZER: &[u8] = include_bytes!("../../fixtures/corpus/tokenizer.gguf");

#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Continue the run in this directory from its last checkpoint (its config.json decides
    /// everything; other training flags are refused).
    #[arg(long, value_name = "RUN_DIR")]
    pub resume: Option<PathBuf>,
    /// How the starting weights are made: from-scratch (drawn from --seed), or warm-start (a new
    /// model whose token embeddings start from --donor's, through a trained projection when the
    /// widths differ; the tokenizer is the donor's).
    #[arg(long, default_value = "from-scratch", value_parser = parse_recipe)]
    pub recipe: String,
    /// The GGUF whose token embeddings (and tokenizer) a warm start takes.
    #[arg(long, value_name = "GGUF")]
    pub donor: Option<PathBuf>,
    /// The base model of --recipe lora (adapters over the base, frozen, in f32), qlora (the same
    /// with the base kept in its GGUF blocks) or full (every weight of the base trained, in
    /// f32): any family toy loads, gpt2 included. Its tokenizer is the run's.
    #[arg(long, value_name = "GGUF")]
    pub base: Option<PathBuf>,
    /// Model shape and optimizer settings to start from: tiny (~1 minute on 2 CPU cores) or
    /// small.
    #[arg(long, default_value = "tiny", value_parser = parse_preset)]
    pub preset: Preset,
    /// Architecture of the new model: llama, or gpt2 (learned positions, LayerNorm, GELU MLP,
    /// as many kv heads as heads, MLP of 4 × d_model unless --ffn is given) [default: llama];
    /// or vit-tiny, an image classifier (ViT for 32×32 images; with no --data, on the bundled
    /// handwritten digits, ~2 minutes on 2 CPU cores; --data DIR: a folder of class folders,
    /// or one with train/ and val/ such folders; --base a timm .safetensors or ViT GGUF to
    /// fine-tune).
    #[arg(long, value_parser = parse_arch)]
    pub arch: Option<ArchChoice>,
    /// Training data files: UTF-8 text, or pre-tokenized little-endian u32 ids (`*.u32`,
    /// `*.bin`; every id below the tokenizer's vocabulary); default: the bundled corpus of short
    /// stories.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// GGUF whose tokenizer to use (a model or a tokenizer-only file; default: the bundled one).
    #[arg(long, value_name = "GGUF")]
    pub tokenizer: Option<PathBuf>,
    /// Where run directories are created.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Name of the run directory (default: the UTC date and time).
    #[arg(long)]
    pub run_id: Option<String>,
    /// Seed of the weights, the data order and the samples.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// No progress bar or samples; only the final summary.
    #[arg(long, short)]
    pub quiet: bool,

    // Per-field overrides of the preset.
    /// Transformer blocks.
    #[arg(long, help_heading = "Model")]
    pub layers: Option<usize>,
    /// Width of the residual stream.
    #[arg(long, help_heading = "Model")]
    pub d_model: Option<usize>,
    /// Attention (query) heads.
    #[arg(long, help_heading = "Model")]
    pub heads: Option<usize>,
    /// Key/value heads (grouped-query attention when fewer than --heads).
    #[arg(long, help_heading = "Model")]
    pub kv_heads: Option<usize>,
    /// Hidden width of the MLP.
    #[arg(long, help_heading = "Model")]
    pub ffn: Option<usize>,
    /// Longest context of the model (written to the GGUF).
    #[arg(long, help_heading = "Model")]
    pub context: Option<usize>,

    /// Optimizer steps.
    #[arg(long, help_heading = "Optimization")]
    pub steps: Option<usize>,
    /// Sequences per micro-batch.
    #[arg(long, help_heading = "Optimization")]
    pub batch_size: Option<usize>,
    /// Micro-batches per optimizer step (gradients summed).
    #[arg(long, help_heading = "Optimization")]
    pub grad_accum: Option<usize>,
    /// Tokens per training sequence.
    #[arg(long, help_heading = "Optimization")]
    pub seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long, help_heading = "Optimization")]
    pub lr: Option<f64>,
    /// Final learning rate of the cosine decay.
    #[arg(long, help_heading = "Optimization")]
    pub min_lr: Option<f64>,
    /// Linear warmup steps.
    #[arg(long, help_heading = "Optimization")]
    pub warmup: Option<usize>,
    /// AdamW weight decay (matrices only).
    #[arg(long, help_heading = "Optimization")]
    pub weight_decay: Option<f32>,
    /// Clip the global gradient norm (0 = off).
    #[arg(long, help_heading = "Optimization")]
    pub grad_clip: Option<f32>,
    /// Fraction of the data held out for evaluation.
    #[arg(long, help_heading = "Optimization")]
    pub val_fraction: Option<f64>,

    /// Evaluate on the held-out data every N steps (0 = only at the end).
    #[arg(long, help_heading = "Cadence")]
    pub eval_every: Option<usize>,
    /// Print and log a generated sample every N steps (0 = only before and after).
    #[arg(long, help_heading = "Cadence")]
    pub sample_every: Option<usize>,
    /// Write a checkpoint every N steps (0 = only at the end).
    #[arg(long, help_heading = "Cadence")]
    pub checkpoint_every: Option<usize>,
    /// Prompt of the samples.
    #[arg(long, help_heading = "Cadence")]
    pub prompt: Option<String>,

    /// Rank r of the adapters [default: 8].
    #[arg(long, help_heading = "LoRA (--recipe lora|qlora)")]
    pub lora_rank: Option<usize>,
    /// Adapter outputs are scaled by alpha / r [default: 16].
    #[arg(long, help_heading = "LoRA (--recipe lora|qlora)")]
    pub lora_alpha: Option<f32>,
    /// Dropout on each adapter's input during training [default: 0].
    #[arg(long, help_heading = "LoRA (--recipe lora|qlora)")]
    pub lora_dropout: Option<f32>,
    /// Projections that get adapters, comma-separated among q,k,v,o,gate,up,down, or for the
    /// fused matrices of phi3 and gpt2 qkv and gate_up (phi3) [default: q,v; qkv where fused].
    #[arg(
        long,
        value_delimiter = ',',
        help_heading = "LoRA (--recipe lora|qlora)"
    )]
    pub lora_targets: Option<Vec<String>>,

    /// Train data-parallel, one replica of the model per device: `cpu:0,cpu:1`,
    /// `wgpu:0,wgpu:1` or `cuda:0,cuda:1,…` (one backend; it replaces --backend). Each replica
    /// takes --batch-size sequences of every micro-batch and the replicas average their
    /// gradients every step (burn's collective all-reduce), so a step sees --batch-size ×
    /// devices × --grad-accum sequences: 2 devices at --batch-size 8 follow the curve of one
    /// at 16. With --resume, another device count keeps the run's global batch (the
    /// per-device batch is divided anew).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "BACKEND:N,…",
        value_parser = parse_device,
        help_heading = "Devices"
    )]
    pub devices: Vec<DeviceSpec>,

    /// Side of the square images the ViT sees (pixels) [default: 32; 16 on the bundled 8×8
    /// digits].
    #[arg(long, help_heading = "Vision (--arch vit-tiny)")]
    pub image_size: Option<usize>,
    /// Side of a square patch (pixels) [default: 4].
    #[arg(long, help_heading = "Vision (--arch vit-tiny)")]
    pub patch_size: Option<usize>,
    /// Augment with random crops of the image padded by N zero pixels on each side [default:
    /// image size / 8 with --data, 0 on the bundled digits].
    #[arg(long, value_name = "N", help_heading = "Vision (--arch vit-tiny)")]
    pub crop_padding: Option<usize>,
    /// Augment with random horizontal flips (for images whose class does not depend on the
    /// side, unlike digits).
    #[arg(long, help_heading = "Vision (--arch vit-tiny)")]
    pub flip: bool,
}

/// `--arch`: a language-model architecture, or the image classifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchChoice {
    Language(Arch),
    VitTiny,
}

/// One device of `--devices`: a backend and the device's index on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpec {
    pub backend: BackendKind,
    pub index: u16,
}

fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    let (name, index) = s.split_once(':').unwrap_or((s, "0"));
    let backend = BackendKind::from_str(name, true).map_err(|_| {
        format!("unknown backend {name:?} in {s:?} (use cpu, ndarray, wgpu, metal or cuda)")
    })?;
    let index = index
        .parse()
        .map_err(|_| format!("{s:?}: the device index after ':' must be a number"))?;
    Ok(DeviceSpec { backend, index })
}

fn parse_arch(s: &str) -> Result<ArchChoice, String> {
    if s == "vit-tiny" {
        return Ok(ArchChoice::VitTiny);
    }
    Arch::from_name(s).map(ArchChoice::Language).ok_or_else(|| {
        let mut names: Vec<_> = Arch::ALL.iter().map(|a| a.name()).collect();
        names.push("vit-tiny");
        format!(
            "unknown architecture {s:?} (available: {})",
            names.join(", ")
        )
    })
}

fn parse_recipe(s: &str) -> Result<String, String> {
    if Recipe::NAMES.contains(&s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "unknown recipe {s:?} (available: {})",
            Recipe::NAMES.join(", ")
        ))
    }
}

fn parse_preset(s: &str) -> Result<Preset, String> {
    Preset::from_name(s).ok_or_else(|| {
        let names: Vec<_> = Preset::ALL.iter().map(|p| p.name()).collect();
        format!("unknown preset {s:?} (available: {})", names.join(", "))
    })
}

impl TrainArgs {
    /// Whether any flag that shapes a new run was given (refused with --resume).
    fn shapes_a_run(&self) -> bool {
        !self.data.is_empty()
            || self.recipe != "from-scratch"
            || self.donor.is_some()
            || self.arch.is_some()
            || self.tokenizer.is_some()
            || self.run_id.is_some()
            || self.layers.is_some()
            || self.d_model.is_some()
            || self.heads.is_some()
            || self.kv_heads.is_some()
            || self.ffn.is_some()
            || self.context.is_some()
            || self.steps.is_some()
            || self.batch_size.is_some()
            || self.grad_accum.is_some()
            || self.seq_len.is_some()
            || self.lr.is_some()
            || self.min_lr.is_some()
            || self.warmup.is_some()
            || self.weight_decay.is_some()
            || self.grad_clip.is_some()
            || self.val_fraction.is_some()
            || self.eval_every.is_some()
            || self.sample_every.is_some()
            || self.checkpoint_every.is_some()
            || self.prompt.is_some()
            || self.base.is_some()
            || self.has_lora_flags()
            || self.has_vision_flags()
    }

    fn has_vision_flags(&self) -> bool {
        self.image_size.is_some()
            || self.patch_size.is_some()
            || self.crop_padding.is_some()
            || self.flip
    }

    /// The language-model architecture of `--arch` (llama by default).
    fn language_arch(&self) -> Arch {
        match self.arch {
            Some(ArchChoice::Language(a)) => a,
            _ => Arch::default(),
        }
    }

    fn has_lora_flags(&self) -> bool {
        self.lora_rank.is_some()
            || self.lora_alpha.is_some()
            || self.lora_dropout.is_some()
            || self.lora_targets.is_some()
    }

    /// The adapters of --recipe lora/qlora over `base`: the defaults, then the flags. The
    /// default targets are the attention's query and value: `q,v`, or the fused `qkv` matrix
    /// of a base that stores one (phi3, gpt2), as PEFT's defaults for those models.
    fn lora_settings(&self, base: &Path) -> LoraSettings {
        let mut a = LoraSettings::default();
        let fused_qkv = toy_core::gguf::GgufFile::open(base)
            .ok()
            .and_then(|f| toy_core::config::ModelConfig::from_gguf(&f).ok())
            .is_some_and(|c| c.fused_qkv || c.norm == toy_core::config::NormKind::Layer);
        if fused_qkv {
            a.targets = vec!["qkv".into()];
        }
        set(&mut a.rank, self.lora_rank);
        set(&mut a.alpha, self.lora_alpha);
        set(&mut a.dropout, self.lora_dropout);
        set(&mut a.targets, self.lora_targets.clone());
        a
    }

    /// Refuse flags that a fine-tuning recipe decides from its base.
    fn check_fine_tuning_flags(&self) -> Result<()> {
        if self.layers.is_some()
            || self.d_model.is_some()
            || self.heads.is_some()
            || self.kv_heads.is_some()
            || self.ffn.is_some()
            || self.context.is_some()
            || self.arch.is_some()
        {
            bail!(
                "--recipe {} takes the model's shape from --base; drop the model flags",
                self.recipe
            );
        }
        if self.tokenizer.is_some() {
            bail!(
                "--recipe {} uses the tokenizer of --base; drop --tokenizer",
                self.recipe
            );
        }
        Ok(())
    }

    /// The config of a new run: the preset, then every override.
    fn config(&self, recipe: Recipe, data: DataConfig) -> TrainConfig {
        let mut c = TrainConfig::from_preset(self.preset, data, self.seed);
        if let Some(base) = recipe.base() {
            // Fine-tuning: the base's shape and tokenizer, a short and gentle schedule.
            c.data.tokenizer = base.to_path_buf();
            c.preset = None;
            let full = matches!(recipe, Recipe::Full { .. });
            c.optim = OptimConfig {
                steps: 100,
                batch_size: 4,
                grad_accum: 1,
                seq_len: 128,
                lr: if full { 5e-5 } else { 2e-4 },
                min_lr: if full { 5e-6 } else { 2e-5 },
                warmup_steps: 10,
                weight_decay: 0.0,
                ..OptimConfig::default()
            };
            c.cadence.eval_every = 25;
            c.cadence.checkpoint_every = 25;
        }
        c.recipe = recipe;
        c.optim.devices = self.devices.len().max(1);
        c.model = c.model.clone().with_arch(self.language_arch());
        let m = &mut c.model;
        set(&mut m.n_layer, self.layers);
        set(&mut m.d_model, self.d_model);
        set(&mut m.n_head, self.heads);
        set(&mut m.n_head_kv, self.kv_heads);
        set(&mut m.d_ff, self.ffn);
        set(&mut m.context_length, self.context);
        set(&mut c.optim.grad_accum, self.grad_accum);
        set(&mut c.optim.seq_len, self.seq_len);
        self.override_optim(&mut c.optim);
        set(&mut c.data.val_fraction, self.val_fraction);
        let k = &mut c.cadence;
        set(&mut k.eval_every, self.eval_every);
        set(&mut k.sample_every, self.sample_every);
        set(&mut k.checkpoint_every, self.checkpoint_every);
        if let Some(p) = &self.prompt {
            k.sample_prompt = p.clone();
        }
        c
    }

    /// The optimization flags every kind of run shares, over `o`'s defaults.
    pub(crate) fn override_optim(&self, o: &mut OptimConfig) {
        set(&mut o.steps, self.steps);
        set(&mut o.batch_size, self.batch_size);
        set(&mut o.lr, self.lr);
        set(&mut o.min_lr, self.min_lr);
        set(&mut o.warmup_steps, self.warmup);
        set(&mut o.weight_decay, self.weight_decay);
        set(&mut o.grad_clip, self.grad_clip);
        // A lower peak than the preset's floor would make the decay go up.
        if self.lr.is_some() && self.min_lr.is_none() {
            o.min_lr = o.min_lr.min(o.lr / 10.0);
        }
        // A short run keeps its warmup short.
        if self.steps.is_some() && self.warmup.is_none() {
            o.warmup_steps = o.warmup_steps.min(o.steps / 10);
        }
    }
}

/// A run's progress: a bar on a terminal; otherwise (CI, a pipe) no redraws, and `plain` says
/// milestones are to be printed as lines.
pub(crate) struct Progress {
    pub bar: ProgressBar,
    pub quiet: bool,
    pub plain: bool,
}

impl Progress {
    pub(crate) fn new(steps: usize, quiet: bool) -> Self {
        let bar = ProgressBar::new(steps as u64);
        if quiet || !std::io::stderr().is_terminal() {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        bar.set_style(
            ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:25}] {msg} ETA {eta}")
                .expect("static template")
                .progress_chars("=> "),
        );
        let plain = !quiet && bar.is_hidden();
        Progress { bar, quiet, plain }
    }

    /// Print a line above the bar (nothing when quiet).
    pub(crate) fn say(&self, line: String) {
        if self.quiet {
            return;
        }
        if self.bar.is_hidden() {
            eprintln!("{line}");
        } else {
            self.bar.println(line);
        }
    }
}

pub(crate) fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}

/// A run id from the UTC clock: `YYYYMMDD-HHMMSS`.
pub(crate) fn default_run_id() -> String {
    toy_core::clock::strftime("%Y%m%d-%H%M%S", toy_core::clock::unix_now())
}

/// The git revision of the source this binary was built from, when it is a checkout.
pub(crate) fn git_revision() -> Option<String> {
    let dir = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("git")
        .args(["-C", dir, "rev-parse", "HEAD"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let rev = String::from_utf8(out.stdout).ok()?.trim().to_string();
    let dirty = Command::new("git")
        .args(["-C", dir, "status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .is_some_and(|o| !o.stdout.is_empty());
    Some(if dirty { format!("{rev}-dirty") } else { rev })
}

/// Create the run directory of a new run and its data config (materializing the bundled corpus
/// and tokenizer into it when they are used).
fn new_run(args: &TrainArgs) -> Result<(RunDir, TrainConfig)> {
    let id = args.run_id.clone().unwrap_or_else(default_run_id);
    // Absolute paths, so that `--resume` works from any directory.
    let absolute = |path: &PathBuf| -> Result<PathBuf> {
        if !path.is_file() {
            bail!("{} does not exist or is not a file", path.display());
        }
        path.canonicalize()
            .with_context(|| format!("cannot resolve {}", path.display()))
    };
    let data_files = args.data.iter().map(absolute).collect::<Result<Vec<_>>>()?;
    let mut tokenizer_file = args.tokenizer.as_ref().map(absolute).transpose()?;
    let recipe = match (args.recipe.as_str(), &args.donor) {
        ("warm-start", Some(donor)) => {
            let donor = absolute(donor)?;
            // The vocabulary is the donor's (a --tokenizer with another is refused later).
            tokenizer_file.get_or_insert_with(|| donor.clone());
            Recipe::WarmStart { donor }
        }
        ("warm-start", None) => bail!("--recipe warm-start needs --donor GGUF"),
        (_, Some(_)) => bail!("--donor is for --recipe warm-start"),
        ("lora" | "qlora" | "full", None) => {
            let base = args
                .base
                .as_ref()
                .with_context(|| format!("--recipe {} needs --base GGUF", args.recipe))?;
            args.check_fine_tuning_flags()?;
            let base = absolute(base)?;
            tokenizer_file = Some(base.clone());
            let adapter = || args.lora_settings(&base);
            match args.recipe.as_str() {
                "lora" => Recipe::Lora {
                    adapter: adapter(),
                    base,
                },
                "qlora" => Recipe::Qlora {
                    adapter: adapter(),
                    base,
                },
                _ => Recipe::Full { base },
            }
        }
        _ => Recipe::FromScratch,
    };
    if args.base.is_some() && recipe.base().is_none() {
        bail!("--base is for --recipe lora, qlora or full");
    }
    if args.has_lora_flags() && recipe.adapter().is_none() {
        bail!("--lora-* flags are for --recipe lora or qlora");
    }
    // Refuse a bad shape or schedule before creating anything on disk.
    args.config(
        recipe.clone(),
        DataConfig {
            files: vec![PathBuf::from("(checked later)")],
            tokenizer: PathBuf::new(),
            val_fraction: 0.05,
        },
    )
    .check()?;
    let run = RunDir::create(&args.runs_dir, &id)?;
    let bundled = run
        .path
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", run.path.display()))?
        .join("bundled");
    let write_bundled = |name: &str, bytes: &[u8]| -> Result<PathBuf> {
        std::fs::create_dir_all(&bundled)
            .with_context(|| format!("cannot create {}", bundled.display()))?;
        let path = bundled.join(name);
        toy_core::atomic::write_atomic(&path, bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(path)
    };
    let files = if data_files.is_empty() {
        vec![write_bundled("stories.txt", BUNDLED_CORPUS)?]
    } else {
        data_files
    };
    let tokenizer = match tokenizer_file {
        Some(t) => t,
        None => write_bundled("tokenizer.gguf", BUNDLED_TOKENIZER)?,
    };
    let data = DataConfig {
        files,
        tokenizer,
        val_fraction: 0.05,
    };
    Ok((run, args.config(recipe, data)))
}

struct TrainJob {
    args: TrainArgs,
    backend: BackendKind,
}

impl BackendJob for TrainJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.args;
        let (run, config) = match &args.resume {
            Some(dir) => {
                if args.shapes_a_run() {
                    bail!(
                        "--resume continues a run with its own config.json; drop the other training flags"
                    );
                }
                let run = RunDir::open(dir)?;
                let mut config = run.read_config()?;
                reshard(&mut config, args.devices.len())?;
                (run, config)
            }
            None => new_run(&args)?,
        };
        let quiet = args.quiet;
        if !quiet {
            eprintln!("run {} ({})", run.id, run.path.display());
        }
        let setup = TrainSetup::prepare(config)
            .with_context(|| format!("cannot prepare run {}", run.path.display()))?;
        let info = RunInfo {
            backend: self.backend.name().to_string(),
            git_revision: git_revision(),
        };

        let progress = Progress::new(setup.config.optim.steps, quiet);
        let (bar, plain) = (&progress.bar, progress.plain);
        let say = |line: String| progress.say(line);
        let show = |record: &Record| match &record.event {
            Event::RunStart {
                n_params,
                vocab_size,
                data_tokens,
                train_sequences,
                resumed_from_step,
                ..
            } => {
                bar.set_position(resumed_from_step.unwrap_or(0) as u64);
                bar.reset_eta();
                let c = &setup.config;
                let shape = match (&setup.base, c.recipe.base()) {
                    (Some(b), Some(path)) => format!(
                        "base {} ({} layers × d {})",
                        path.display(),
                        b.config.n_layer,
                        b.config.d_model
                    ),
                    _ => format!(
                        "{} {} layers × d {}",
                        c.model.arch.name(),
                        c.model.n_layer,
                        c.model.d_model
                    ),
                };
                let parallel = match c.optim.devices {
                    1 => String::new(),
                    n => format!(
                        " ({n} devices × {} sequences{})",
                        c.optim.batch_size,
                        match c.optim.grad_accum {
                            1 => String::new(),
                            a => format!(" × {a} micro-batches"),
                        }
                    ),
                };
                say(format!(
                    "{} | {} params, vocab {vocab_size}, {shape} | {data_tokens} tokens, {train_sequences} sequences of {} | {} steps × {} tokens{parallel}{}",
                    c.recipe,
                    human(*n_params as f64),
                    c.optim.seq_len,
                    c.optim.steps,
                    c.optim.tokens_per_step(),
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
                    "loss {loss:.3} lr {lr:.1e} {}tok/s",
                    human(*tokens_per_s)
                ));
                if plain && (*step % 25 == 0 || *step == 1) {
                    eprintln!(
                        "step {step}: loss {loss:.3} lr {lr:.1e} {}tok/s",
                        human(*tokens_per_s)
                    );
                }
            }
            Event::Eval {
                step,
                loss,
                perplexity,
                ..
            } => say(format!(
                "eval after step {step}: loss {loss:.3}, perplexity {perplexity:.2}"
            )),
            Event::Sample { step, text, .. } => {
                let when = if *step == 0 {
                    "before training".to_string()
                } else {
                    format!("after step {step}")
                };
                say(format!("sample {when}: {}", text.replace('\n', " ")));
            }
            Event::Checkpoint { .. } | Event::RunEnd { .. } | Event::VisionRunStart { .. } => {}
        };
        let mut observer = |record: &Record| {
            show(record);
            ControlFlow::Continue(())
        };
        let devices = replica_devices::<B>(&device, &args.devices, setup.config.optim.devices);
        let summary = train_data_parallel::<B>(&run, &setup, &info, &devices, &mut observer)?;
        bar.finish_and_clear();

        let mut out = std::io::stderr().lock();
        let eval = summary
            .final_eval
            .as_ref()
            .map(|e| {
                format!(
                    ", held-out loss {:.3} (perplexity {:.2})",
                    e.mean_nll, e.perplexity
                )
            })
            .unwrap_or_default();
        writeln!(
            out,
            "trained {} steps, {} tokens in {:.1} s: loss {:.3}{eval}",
            summary.steps,
            summary.total_tokens,
            summary.elapsed_s,
            summary.final_loss.unwrap_or(f64::NAN),
        )?;
        match setup.config.recipe.base() {
            Some(base) if setup.config.recipe.adapter().is_some() => writeln!(
                out,
                "adapter: {} (and adapter_model.safetensors + adapter_config.json beside it)\n  try: toy merge {} {} merged.gguf",
                summary.model_path.display(),
                base.display(),
                summary.model_path.display(),
            )?,
            _ => writeln!(
                out,
                "model: {}\n  try: toy infer {} -p \"{}\"",
                summary.model_path.display(),
                summary.model_path.display(),
                setup.config.cadence.sample_prompt
            )?,
        }
        Ok(())
    }
}

/// 1234567 → "1.2M".
pub(crate) fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.1}G", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e4 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

pub fn run(mut compute: Compute, args: TrainArgs) -> Result<()> {
    if compute.dtype == FloatKind::F16 {
        bail!(
            "--dtype f16 is for inference (infer, eval, bench, serve); training keeps f32 \
             weights, gradients and optimizer state"
        );
    }
    // Image classification: `--arch vit-tiny`, or the resumption of such a run.
    let vision_run = match &args.resume {
        Some(dir) => {
            let run = RunDir::open(dir)?;
            read_vision_config(&run)?.map(|config| (run, config))
        }
        None => None,
    };
    if vision_run.is_some() || args.arch == Some(ArchChoice::VitTiny) {
        if vision_run.is_some() && args.shapes_a_run() {
            bail!(
                "--resume continues a run with its own config.json; drop the other training flags"
            );
        }
        return crate::vision::train(compute, args, vision_run);
    }
    if args.has_vision_flags() {
        bail!("--image-size, --patch-size, --crop-padding and --flip are for --arch vit-tiny");
    }
    if let Some(first) = args.devices.first() {
        if let Some(other) = args.devices.iter().find(|d| d.backend != first.backend) {
            bail!(
                "--devices: one backend for every device (got {} and {})",
                first.backend.name(),
                other.backend.name()
            );
        }
        compute.backend = first.backend;
    }
    let backend = compute.backend;
    dispatch(compute, TrainJob { args, backend })
}

/// The devices of a run of `replicas` replicas on `device`'s backend: those `--devices` names
/// (by index, on the kind of device the backend was opened with), else the first `replicas`.
fn replica_devices<B: ToyBackend>(
    device: &B::Device,
    named: &[DeviceSpec],
    replicas: usize,
) -> Vec<B::Device> {
    use burn::tensor::backend::{Device, DeviceId};
    let kind = device.to_id().type_id;
    let at = |index: u16| match index {
        0 => device.clone(),
        i => B::Device::from_id(DeviceId::new(kind, i)),
    };
    match named {
        [] => (0..replicas as u16).map(at).collect(),
        named => named.iter().map(|d| at(d.index)).collect(),
    }
}

/// `--devices` given with `--resume`: the run's global batch kept over another device count.
fn reshard(config: &mut TrainConfig, devices: usize) -> Result<()> {
    let o = &mut config.optim;
    if devices == 0 || devices == o.devices {
        return Ok(());
    }
    let rows = o.micro_batch_rows();
    if !rows.is_multiple_of(devices) {
        bail!(
            "--devices: the run's micro-batch of {rows} sequences ({} × {} devices) does not split \
             over {devices} devices; use a device count that divides {rows}",
            o.batch_size,
            o.devices
        );
    }
    o.batch_size = rows / devices;
    o.devices = devices;
    Ok(())
}
