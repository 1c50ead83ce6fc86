//! What a training run is: the model shape, the data, the optimizer and schedule, the cadence of
//! evaluation, samples and checkpoints. A [`TrainConfig`] is written to `runs/<id>/config.json`
//! at the start of a run and read back by `--resume`, so it holds everything that decides the
//! numbers (the seed included).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use toy_models::{Gpt2Config, LlamaConfig};

use crate::TrainError;

/// Named model shapes for training from scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// ~1M parameters with the bundled tokenizer (4 layers × 128): learns the bundled corpus in
    /// about a minute on a CPU (120 steps × 1536 tokens; loss 6.7 → ~0.5).
    Tiny,
    /// ~5M parameters with the bundled tokenizer (6 layers × 256): a longer run (tens of
    /// minutes on a CPU).
    Small,
}

impl Preset {
    /// Every preset, smallest first.
    pub const ALL: [Preset; 2] = [Preset::Tiny, Preset::Small];

    /// The preset's name, as `--preset` takes it and config.json spells it.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
        }
    }

    /// The preset called `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// The model shape of this preset (the vocabulary comes from the tokenizer).
    pub fn shape(self) -> ModelShape {
        match self {
            Preset::Tiny => ModelShape {
                arch: Arch::Llama,
                n_layer: 4,
                d_model: 128,
                n_head: 4,
                n_head_kv: 2,
                d_ff: 352,
                context_length: 256,
                rope_theta: 10_000.0,
                rms_eps: 1e-5,
            },
            Preset::Small => ModelShape {
                arch: Arch::Llama,
                n_layer: 6,
                d_model: 256,
                n_head: 8,
                n_head_kv: 4,
                d_ff: 704,
                context_length: 256,
                rope_theta: 10_000.0,
                rms_eps: 1e-5,
            },
        }
    }

    /// The optimization settings this preset was tuned with.
    pub fn optim(self) -> OptimConfig {
        match self {
            Preset::Tiny => OptimConfig {
                steps: 120,
                batch_size: 12,
                grad_accum: 1,
                seq_len: 128,
                lr: 3e-3,
                min_lr: 3e-4,
                warmup_steps: 10,
                ..OptimConfig::default()
            },
            Preset::Small => OptimConfig {
                steps: 2000,
                batch_size: 16,
                grad_accum: 1,
                seq_len: 128,
                lr: 1e-3,
                min_lr: 1e-4,
                warmup_steps: 100,
                ..OptimConfig::default()
            },
        }
    }
}

/// The architecture of a model trained from scratch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// llama: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.
    #[default]
    Llama,
    /// GPT-2: learned positions, LayerNorm with bias, fused QKV with bias, GELU MLP.
    Gpt2,
}

impl Arch {
    /// Every architecture toy trains from scratch.
    pub const ALL: [Arch; 2] = [Arch::Llama, Arch::Gpt2];

    /// The architecture's name, as `--arch` takes it and config.json spells it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Gpt2 => "gpt2",
        }
    }

    /// The architecture called `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// A model shape (the vocabulary size comes from the tokenizer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    /// `llama` when absent (config.json of runs made before GPT-2 could be trained).
    #[serde(default)]
    pub arch: Arch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention (query) heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`; gpt2 has as many).
    pub n_head_kv: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// Longest context the model supports (written to the GGUF; generation is limited by it).
    pub context_length: usize,
    /// Ignored by gpt2 (learned positions).
    pub rope_theta: f32,
    /// The RMSNorm epsilon (llama) or the LayerNorm one (gpt2).
    pub rms_eps: f64,
}

impl ModelShape {
    /// This shape as `arch`: a GPT-2 has as many key/value heads as query heads and an MLP of
    /// 4 × d_model (OpenAI's GPT-2); a llama keeps the preset's GQA and SwiGLU widths.
    pub fn with_arch(self, arch: Arch) -> Self {
        match arch {
            Arch::Llama => ModelShape { arch, ..self },
            Arch::Gpt2 => ModelShape {
                arch,
                n_head_kv: self.n_head,
                d_ff: 4 * self.d_model,
                ..self
            },
        }
    }

    /// Check that the shape can be built: positive sizes, heads that divide `d_model` (llama: an
    /// even head width, a multiple of the kv heads), positive RoPE theta and norm epsilon.
    pub fn check(&self) -> Result<(), TrainError> {
        let bad = |what: String| Err(TrainError::Config(what));
        if self.n_layer == 0 || self.d_model == 0 || self.d_ff == 0 || self.context_length == 0 {
            return bad("layers, d_model, ffn and context must be positive".into());
        }
        if self.arch == Arch::Gpt2 {
            if self.n_head_kv != self.n_head {
                return bad(format!(
                    "gpt2 has as many kv heads as heads ({}), not {}",
                    self.n_head, self.n_head_kv
                ));
            }
            if self.n_head == 0 || !self.d_model.is_multiple_of(self.n_head) {
                return bad(format!(
                    "d_model ({}) must be a multiple of heads ({})",
                    self.d_model, self.n_head
                ));
            }
            if !(self.rms_eps > 0.0) {
                return bad("the norm epsilon must be positive".into());
            }
            return Ok(());
        }
        if self.n_head == 0 || self.n_head_kv == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return bad(format!(
                "heads ({}) must be a positive multiple of kv heads ({})",
                self.n_head, self.n_head_kv
            ));
        }
        if !self.d_model.is_multiple_of(self.n_head)
            || !(self.d_model / self.n_head).is_multiple_of(2)
        {
            return bad(format!(
                "d_model ({}) must be a multiple of heads ({}) with an even head width (RoPE rotates pairs)",
                self.d_model, self.n_head
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_eps > 0.0) {
            return bad("rope theta and rms eps must be positive".into());
        }
        Ok(())
    }

    /// The GPT-2 config for a vocabulary of `vocab_size` tokens.
    pub fn gpt2(&self, vocab_size: usize) -> Gpt2Config {
        Gpt2Config::new(
            self.n_layer,
            self.d_model,
            self.n_head,
            self.d_ff,
            vocab_size,
            self.context_length,
        )
        .with_norm_eps(self.rms_eps)
    }

    /// The llama config for a vocabulary of `vocab_size` tokens. The output head is its own
    /// matrix, not tied to the embedding (the GGUF carries `output.weight`): the shape toy's
    /// presets have always trained, which their checkpoints and `--resume` expect.
    pub fn llama(&self, vocab_size: usize) -> LlamaConfig {
        LlamaConfig::new(
            self.n_layer,
            self.d_model,
            self.n_head,
            self.n_head_kv,
            self.d_model / self.n_head,
            self.d_ff,
            vocab_size,
            self.context_length,
        )
        .with_rope_theta(self.rope_theta)
        .with_rms_eps(self.rms_eps)
        .with_rope_interleaved(true)
        .with_tied_embeddings(false)
    }
}

/// Optimizer, schedule and batch settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// Optimizer steps in the run.
    pub steps: usize,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches whose gradients are summed (averaged) into one optimizer step.
    pub grad_accum: usize,
    /// Tokens per training sequence (each predicts its next token).
    pub seq_len: usize,
    /// Peak learning rate (after warmup).
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay, applied to matrices only (not to norms).
    pub weight_decay: f32,
    /// AdamW's decay rate of the first moment (the gradient's running mean).
    pub beta1: f32,
    /// AdamW's decay rate of the second moment (the squared gradient's running mean).
    pub beta2: f32,
    /// AdamW's epsilon, added to the second moment's square root in the denominator.
    pub epsilon: f32,
    /// Clip the global gradient norm to this value (0 = off).
    pub grad_clip: f32,
    /// Data-parallel replicas, one per device (`--devices`): each takes `batch_size` sequences
    /// of every micro-batch, so an optimizer step sees `batch_size × grad_accum × devices`.
    #[serde(default = "one")]
    pub devices: usize,
}

fn one() -> usize {
    1
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            steps: 1000,
            batch_size: 8,
            grad_accum: 1,
            seq_len: 128,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup_steps: 50,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            epsilon: 1e-8,
            grad_clip: 1.0,
            devices: 1,
        }
    }
}

impl OptimConfig {
    /// Check the settings: positive counts, `0 <= min_lr <= lr` with `lr > 0`, betas from 0 up to
    /// (not including) 1, non-negative decay and clipping, a positive epsilon.
    pub fn check(&self) -> Result<(), TrainError> {
        let bad = |what: &str| Err(TrainError::Config(what.to_string()));
        if self.steps == 0
            || self.batch_size == 0
            || self.grad_accum == 0
            || self.seq_len == 0
            || self.devices == 0
        {
            return bad(
                "steps, batch size, grad accumulation, sequence length and devices must be positive",
            );
        }
        if !(self.lr > 0.0 && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad("learning rates must satisfy 0 <= min_lr <= lr and lr > 0");
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad("AdamW betas must be in [0, 1)");
        }
        if self.weight_decay < 0.0 || self.grad_clip < 0.0 || self.epsilon <= 0.0 {
            return bad("weight decay and grad clip must be >= 0, epsilon > 0");
        }
        Ok(())
    }

    /// Sequences of one micro-batch across every replica.
    pub fn micro_batch_rows(&self) -> usize {
        self.batch_size * self.devices
    }

    /// Sequences per optimizer step: per-device batch × devices × accumulation.
    pub fn global_batch(&self) -> usize {
        self.micro_batch_rows() * self.grad_accum
    }

    /// Tokens predicted per optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.global_batch() * self.seq_len
    }
}

/// Where the tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataConfig {
    /// Text files (UTF-8) or pre-tokenized files (`*.u32`, `*.bin`: little-endian u32 ids),
    /// tokenized and concatenated in this order.
    pub files: Vec<PathBuf>,
    /// The GGUF holding the tokenizer (a model GGUF or a tokenizer-only one); its `tokenizer.*`
    /// metadata is copied into every checkpoint.
    pub tokenizer: PathBuf,
    /// Fraction of the sequences held out for evaluation (taken from the end).
    pub val_fraction: f64,
}

/// The cadence of evaluation, samples and checkpoints (in optimizer steps; 0 = only at the end).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CadenceConfig {
    /// Steps between held-out evaluations (one also follows the last step).
    pub eval_every: usize,
    /// Held-out micro-batches per evaluation (0 = all).
    pub eval_batches: usize,
    /// Steps between generated samples (one is also made before the first step and after the
    /// last).
    pub sample_every: usize,
    /// Steps between checkpoints (one is also written after the last step).
    pub checkpoint_every: usize,
    /// Prompt of the generated samples (the tokenizer's BOS is added when it asks for one).
    pub sample_prompt: String,
    /// Most tokens generated per sample (fewer when the context runs out or an end token comes).
    pub sample_tokens: usize,
    /// Sampling temperature of the samples.
    pub sample_temperature: f32,
}

impl Default for CadenceConfig {
    fn default() -> Self {
        CadenceConfig {
            eval_every: 40,
            eval_batches: 8,
            sample_every: 0,
            checkpoint_every: 40,
            sample_prompt: "Once upon a time".into(),
            sample_tokens: 48,
            sample_temperature: 0.8,
        }
    }
}

/// How the model's starting weights are made. Serialized in config.json as `"from-scratch"` (a
/// plain string, as runs before this enum wrote it) or `{"warm-start": {"donor": …}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recipe {
    /// Every weight drawn from the run's seed ([`crate::init`]).
    FromScratch,
    /// A from-scratch model whose token embeddings start from the donor GGUF's `token_embd`
    /// (through a trainable projection when the widths differ); the tokenizer is the donor's.
    WarmStart {
        /// The GGUF whose token embeddings and tokenizer the model starts from.
        donor: PathBuf,
    },
    /// LoRA adapters over a frozen base GGUF loaded as f32 (dequantized); only the adapters
    /// train. The tokenizer is the base's.
    Lora {
        /// The frozen base GGUF.
        base: PathBuf,
        /// The adapters trained over it.
        adapter: LoraSettings,
    },
    /// LoRA adapters over a frozen base kept quantized (Q8_0/Q4_0/Q4_1 packed; other types are
    /// f32).
    Qlora {
        /// The frozen base GGUF, kept quantized.
        base: PathBuf,
        /// The adapters trained over it.
        adapter: LoraSettings,
    },
    /// Every weight of the base GGUF trainable (loaded as f32; a quantized base is dequantized).
    Full {
        /// The base GGUF, every weight of it trained.
        base: PathBuf,
    },
}

/// The adapters of the `lora` and `qlora` recipes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraSettings {
    /// Rank `r` of each adapter: the inner width of its `B·A`.
    pub rank: usize,
    /// The adapter output is scaled by `alpha / rank`.
    pub alpha: f32,
    /// Dropout probability on each adapter's input during training.
    pub dropout: f32,
    /// Projections that get an adapter, among q, k, v, o, gate, up, down.
    pub targets: Vec<String>,
}

impl Default for LoraSettings {
    /// Rank 8 on q and v without dropout, as PEFT's defaults for llama models, with alpha 16 = 2r
    /// (PEFT's default alpha is 8; 2r is the usual choice).
    fn default() -> Self {
        LoraSettings {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec!["q".into(), "v".into()],
        }
    }
}

impl LoraSettings {
    /// The adapters' shape, with the target names checked.
    pub fn spec(&self) -> Result<toy_models::lora::LoraSpec, TrainError> {
        let mut targets = Vec::new();
        for name in &self.targets {
            let t = toy_models::lora::Target::from_name(name).ok_or_else(|| {
                TrainError::Config(format!(
                    "unknown LoRA target {name:?} (available: q, k, v, o, gate, up, down; qkv and gate_up for fused matrices: phi3, gpt2's qkv)"
                ))
            })?;
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        if targets.is_empty() {
            return Err(TrainError::Config("no LoRA targets given".into()));
        }
        let alpha_positive = self.alpha > 0.0; // false for NaN too
        if self.rank == 0 || !alpha_positive || !(0.0..1.0).contains(&self.dropout) {
            return Err(TrainError::Config(
                "LoRA rank and alpha must be positive and dropout in [0, 1)".into(),
            ));
        }
        targets.sort();
        Ok(toy_models::lora::LoraSpec {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets,
        })
    }
}

impl Recipe {
    /// The names `--recipe` takes.
    pub const NAMES: [&str; 5] = ["from-scratch", "warm-start", "lora", "qlora", "full"];

    /// The recipe's name, as `--recipe` takes it (`Display` writes it too).
    pub fn name(&self) -> &'static str {
        match self {
            Recipe::FromScratch => "from-scratch",
            Recipe::WarmStart { .. } => "warm-start",
            Recipe::Lora { .. } => "lora",
            Recipe::Qlora { .. } => "qlora",
            Recipe::Full { .. } => "full",
        }
    }

    /// The base GGUF a fine-tuning recipe starts from.
    pub fn base(&self) -> Option<&std::path::Path> {
        match self {
            Recipe::Lora { base, .. } | Recipe::Qlora { base, .. } | Recipe::Full { base } => {
                Some(base)
            }
            _ => None,
        }
    }

    /// The adapters of a LoRA recipe.
    pub fn adapter(&self) -> Option<&LoraSettings> {
        match self {
            Recipe::Lora { adapter, .. } | Recipe::Qlora { adapter, .. } => Some(adapter),
            _ => None,
        }
    }
}

impl std::fmt::Display for Recipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A whole training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// How the starting weights are made.
    pub recipe: Recipe,
    /// The preset the shape and optimizer settings started from, if any (informational).
    pub preset: Option<Preset>,
    /// The model shape of a from-scratch or warm-start model (a fine-tuning recipe takes its
    /// base's).
    pub model: ModelShape,
    /// Optimizer, schedule and batch settings.
    pub optim: OptimConfig,
    /// The training data and its tokenizer.
    pub data: DataConfig,
    /// When to evaluate, sample and checkpoint.
    pub cadence: CadenceConfig,
    /// Seeds the weights, the data order and the samples.
    pub seed: u64,
}

impl TrainConfig {
    /// The from-scratch recipe with a preset's shape and optimizer settings.
    pub fn from_preset(preset: Preset, data: DataConfig, seed: u64) -> Self {
        TrainConfig {
            recipe: Recipe::FromScratch,
            preset: Some(preset),
            model: preset.shape(),
            optim: preset.optim(),
            data,
            cadence: CadenceConfig::default(),
            seed,
        }
    }

    /// Check the whole run before it starts: the adapters, the shape (unless a base decides it),
    /// the optimizer, that there is data, the held-out fraction, and that sequences fit the
    /// context.
    pub fn check(&self) -> Result<(), TrainError> {
        if let Some(adapter) = self.recipe.adapter() {
            adapter.spec()?;
        }
        // A fine-tuning recipe's shape and context are the base's (checked when it is loaded).
        if self.recipe.base().is_none() {
            self.model.check()?;
        }
        self.optim.check()?;
        if self.data.files.is_empty() {
            return Err(TrainError::Config("no training data files given".into()));
        }
        if !(0.0..1.0).contains(&self.data.val_fraction) {
            return Err(TrainError::Config(format!(
                "the held-out fraction must be in [0, 1), not {}",
                self.data.val_fraction
            )));
        }
        if self.recipe.base().is_none() && self.optim.seq_len > self.model.context_length {
            return Err(TrainError::Config(format!(
                "sequence length {} is longer than the model's context {}",
                self.optim.seq_len, self.model.context_length
            )));
        }
        Ok(())
    }
}
