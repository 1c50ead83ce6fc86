//! The fine-tuning recipes' starting models: `lora` (adapters over a frozen f32 base), `qlora`
//! (adapters over a frozen base whose packed weights stay packed) and `full` (every weight of
//! the base trainable, in f32). Every family toy loads is a base: the llama family and GPT-2.
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
use toy_core::config::NormKind;
use toy_core::gguf::GgufFile;
use toy_kernels::ToyBackend;
use toy_models::llama::Ffn;
use toy_models::lora::{Adaptable, Target, install, new_adapters};
use toy_models::{Gpt2Config, LlamaConfig, Model};

use crate::TrainError;
use crate::adapter::QkLayout;
use crate::config::{Recipe, TrainConfig};
use crate::init::normals;
use crate::model::ModelSpec;
use toy_core::rng::SplitMix64;

/// The base of a fine-tuning run: its path, file and config.
pub struct Base {
    /// Where the GGUF is.
    pub path: PathBuf,
    /// The opened GGUF.
    pub file: GgufFile,
    /// The model config its metadata describes.
    pub config: ModelConfig,
}

impl Base {
    /// Open the GGUF at `path` and read its model config.
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

    /// The architecture and shape of the model trained from this base (`full` unties a llama
    /// output head: it trains apart from the embedding and is saved as `output.weight`; GPT-2's
    /// loaded head is always its own matrix).
    pub fn spec(&self, recipe: &Recipe) -> ModelSpec {
        if self.config.norm == NormKind::Layer {
            return ModelSpec::Gpt2(Gpt2Config::from_model_config(&self.config));
        }
        let c = LlamaConfig::from_model_config(&self.config);
        ModelSpec::Llama(match recipe {
            Recipe::Full { .. } => c.with_tied_embeddings(false),
            _ => c,
        })
    }

    /// How its Q/K rows relate to Hugging Face's (for PEFT adapter files).
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
) -> Result<Model<B>, TrainError> {
    let (_, model) = toy_models::load_model::<B>(&base.file, device, |_, _| {})
        .map_err(|e| TrainError::Config(format!("cannot load the base model: {e}")))?;
    match &config.recipe {
        Recipe::Full { .. } => {
            if let Model::Llama(m) = &model
                && m.blocks.iter().any(|b| matches!(b.ffn, Ffn::Moe(_)))
            {
                return Err(TrainError::Config(
                    "a full fine-tune of a mixture-of-experts base is not supported (its experts and saving them are not); use --recipe lora on the attention (q,k,v,o)".into(),
                ));
            }
            // Every weight trains, the embedding too: a packed table becomes an f32 one.
            Ok(match dequantize(model) {
                Model::Llama(mut m) => {
                    m.token_embd = m.token_embd.dequantized();
                    Model::Llama(m)
                }
                gpt2 => gpt2,
            })
        }
        Recipe::Lora { adapter, .. } | Recipe::Qlora { adapter, .. } => {
            let model = match config.recipe {
                Recipe::Lora { .. } => dequantize(model),
                _ => model,
            };
            let model = model.map(&mut Freeze);
            let spec = adapter.spec()?;
            check_targets(&base.config, &spec.targets)?;
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

/// An adapter lives on one GGUF tensor: phi3's fused `attn_qkv` and gate+up `ffn_up` take one
/// adapter each (`qkv`, `gate_up`), not adapters of their parts (llama.cpp and PEFT see one
/// matrix), and a family that stores its projections apart has no fused matrix to adapt.
/// (GPT-2's targets are checked by its blocks: qkv, o, up, down.)
fn check_targets(config: &ModelConfig, targets: &[Target]) -> Result<(), TrainError> {
    if config.norm == NormKind::Layer {
        return Ok(());
    }
    let arch = &config.architecture;
    for &t in targets {
        let problem = match t {
            Target::Q | Target::K | Target::V if config.fused_qkv => Some("qkv"),
            Target::Gate | Target::Up if config.fused_gate_up => Some("gate_up"),
            Target::Qkv if !config.fused_qkv => Some("q,k,v"),
            Target::GateUp if !config.fused_gate_up => Some("gate,up"),
            _ => None,
        };
        if let Some(instead) = problem {
            let how = if matches!(t, Target::Qkv | Target::GateUp) {
                "stores these projections apart"
            } else {
                "stores its Q/K/V (attn_qkv) and gate/up (ffn_up) projections fused"
            };
            return Err(TrainError::Config(format!(
                "{arch} {how}, so it has no matrix for LoRA target {:?}: use {instead}",
                t.name()
            )));
        }
    }
    Ok(())
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
///
/// [`QLinear::dequantized`]: toy_models::QLinear::dequantized
pub fn dequantize<B: ToyBackend>(mut model: Model<B>) -> Model<B> {
    match &mut model {
        // A tied head becomes its own f32 copy (the table itself stays packed under LoRA).
        Model::Llama(m) => m.output = Some(m.head().dequantized()),
        Model::Gpt2(m) => m.output = m.output.dequantized(),
    }
    for block in model.lora_blocks_mut() {
        for t in Target::ALL {
            if let Ok(parts) = block.adapted_mut(t) {
                for w in parts {
                    *w = w.dequantized();
                }
            }
        }
    }
    model
}
