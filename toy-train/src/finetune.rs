//! The fine-tuning recipes' starting models: `lora` (adapters over a frozen f32 base), `qlora`
//! (adapters over a frozen base whose Q8_0/Q4_0/Q4_1 weights stay packed) and `full` (every
//! weight of the base trainable, in f32).
//!
//! Freezing: every float parameter of the base is marked `require_grad = false`, so autodiff
//! tracks none of them; gradients flow through them to the activations (the quantized matmuls'
//! backward w.r.t. x in `toy_kernels::autodiff`) and reach only the adapters, which are then the
//! only parameters with a gradient — and so the only ones AdamW keeps moments for.
//!
//! `A` is drawn from the run's seed like every from-scratch matrix ([`crate::init`]): N(0, 1/in),
//! one stream per (layer, target); `B` starts at zero, so the adapted model starts as the base.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use toy_core::config::ModelConfig;
use toy_core::gguf::GgufFile;
use toy_kernels::ToyBackend;
use toy_models::llama::Ffn;
use toy_models::lora::{Target, install, new_adapters, projection_mut};
use toy_models::{LlamaConfig, Transformer};

use crate::TrainError;
use crate::adapter::QkLayout;
use crate::config::{Recipe, TrainConfig};
use crate::init::normals;
use toy_core::rng::SplitMix64;

/// The base of a fine-tuning run: its path, file and config.
pub struct Base {
    pub path: PathBuf,
    pub file: GgufFile,
    pub config: ModelConfig,
}

impl Base {
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        let file = GgufFile::open(path).map_err(|e| {
            TrainError::Config(format!(
                "cannot open the base model {}: {e}",
                path.display()
            ))
        })?;
        let config = ModelConfig::from_gguf(&file)
            .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        Ok(Base {
            path: path.to_path_buf(),
            file,
            config,
        })
    }

    /// The llama config of the model trained from this base (`full` unties the output head:
    /// it trains apart from the embedding and is saved as `output.weight`).
    pub fn llama_config(&self, recipe: &Recipe) -> LlamaConfig {
        let c = LlamaConfig::from_model_config(&self.config);
        match recipe {
            Recipe::Full { .. } => c.with_tied_embeddings(false),
            _ => c,
        }
    }

    pub fn qk_layout(&self) -> QkLayout {
        QkLayout::of(&self.config)
    }

    /// The base's `general.architecture` (what its checkpoints and adapters declare).
    pub fn architecture(&self) -> &str {
        &self.config.architecture
    }

    /// A name for the base in adapter files: `general.name`, or the file name.
    pub fn name(&self) -> String {
        match self.file.get_str("general.name").ok().flatten() {
            Some(n) => n.to_string(),
            None => self
                .path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }
}

/// The starting model of a fine-tuning recipe (see the module docs), on `device`.
pub fn start_model<B: ToyBackend>(
    config: &TrainConfig,
    base: &Base,
    device: &B::Device,
) -> Result<Transformer<B>, TrainError> {
    let (_, model) = toy_models::load::<B>(&base.file, device, |_, _| {})
        .map_err(|e| TrainError::Config(format!("cannot load the base model: {e}")))?;
    match &config.recipe {
        Recipe::Full { .. } => {
            if model.blocks.iter().any(|b| matches!(b.ffn, Ffn::Moe(_))) {
                return Err(TrainError::Config(
                    "a full fine-tune of a mixture-of-experts base is not supported (its experts and saving them are not); use --recipe lora on the attention (q,k,v,o)".into(),
                ));
            }
            // Every weight trains, the embedding too: a packed table becomes an f32 one.
            let mut model = dequantize(model);
            model.token_embd = model.token_embd.dequantized();
            Ok(model)
        }
        Recipe::Lora { adapter, .. } | Recipe::Qlora { adapter, .. } => {
            let model = match config.recipe {
                Recipe::Lora { .. } => dequantize(model),
                _ => model,
            };
            let model = model.map(&mut Freeze);
            let spec = adapter.spec()?;
            check_unfused_targets(&base.config, &spec.targets)?;
            let seed = config.seed;
            let adapters = new_adapters(&model, &spec, |layer, target, [r, inp]| {
                lora_a(seed, layer, target, r, inp)
            })
            .map_err(|e| TrainError::Config(e.to_string()))?;
            install(model, adapters).map_err(|e| TrainError::Config(e.to_string()))
        }
        _ => Err(TrainError::Config(format!(
            "the {} recipe has no base model",
            config.recipe
        ))),
    }
}

/// An adapter lives on one GGUF tensor: phi3's fused `attn_qkv` and gate+up `ffn_up` cannot
/// take adapters of their parts (llama.cpp and PEFT would see one matrix).
fn check_unfused_targets(config: &ModelConfig, targets: &[Target]) -> Result<(), TrainError> {
    let fused = |t: &Target| match t {
        Target::Q | Target::K | Target::V => config.fused_qkv,
        Target::Gate | Target::Up => config.fused_gate_up,
        Target::O | Target::Down => false,
    };
    match targets.iter().find(|t| fused(t)) {
        Some(t) => Err(TrainError::Config(format!(
            "{} stores its Q/K/V and gate/up projections fused (attn_qkv, ffn_up), so LoRA target {:?} has no matrix of its own; use --lora-targets o,down",
            config.architecture,
            t.name()
        ))),
        None => Ok(()),
    }
}

/// `A` of the adapter on `target` of block `layer`: N(0, 1/in) from its own stream of `seed`.
pub fn lora_a(seed: u64, layer: usize, target: Target, r: usize, inp: usize) -> Vec<f32> {
    let stream = 0x4C6F_5241_0000_0000 ^ ((layer as u64) << 8) ^ target as u64;
    let mut rng = SplitMix64::new(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
    normals(&mut rng, r * inp, (1.0 / inp as f64).sqrt())
}

/// Marks every float parameter frozen.
struct Freeze;

impl<B: Backend> ModuleMapper<B> for Freeze {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        param.set_require_grad(false)
    }
}

/// Replace every packed projection (and a packed output head) with its f32 weight
/// ([`QLinear::dequantized`]: llama.cpp's dequantization, exact in f32). A mixture of experts
/// keeps its experts as they are (frozen under LoRA, which adapts only its attention).
pub fn dequantize<B: ToyBackend>(mut model: Transformer<B>) -> Transformer<B> {
    model.output = model.output.dequantized();
    for block in &mut model.blocks {
        for t in Target::ALL {
            if let Some(w) = projection_mut(block, t) {
                *w = w.dequantized();
            }
        }
    }
    model
}
