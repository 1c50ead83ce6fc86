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

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use toy_core::config::ModelConfig;
use toy_core::gguf::{GgufFile, tensor_to_f32};
use toy_kernels::ToyBackend;
use toy_models::lora::{Target, install, new_adapters};
use toy_models::qlinear::QLinear;
use toy_models::{LlamaConfig, Transformer};

use crate::TrainError;
use crate::adapter::Heads;
use crate::config::{Recipe, TrainConfig};
use crate::data::SplitMix64;
use crate::init::normals;

/// The base of a fine-tuning run: its file and config.
pub struct Base {
    pub file: GgufFile,
    pub config: ModelConfig,
}

impl Base {
    pub fn open(path: &std::path::Path) -> Result<Self, TrainError> {
        let file = GgufFile::open(path).map_err(|e| {
            TrainError::Config(format!(
                "cannot open the base model {}: {e}",
                path.display()
            ))
        })?;
        let config = ModelConfig::from_gguf(&file)
            .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        Ok(Base { file, config })
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

    pub fn heads(&self) -> Heads {
        Heads {
            n_head: self.config.n_head,
            n_head_kv: self.config.n_head_kv,
        }
    }

    /// A name for the base in adapter files: `general.name`, or the file name.
    pub fn name(&self, path: &std::path::Path) -> String {
        match self.file.get_str("general.name").ok().flatten() {
            Some(n) => n.to_string(),
            None => path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }
}

/// Whether any of the model's projections is quantized (kept packed).
pub fn has_quantized<B: Backend>(model: &Transformer<B>) -> bool {
    let packed = |w: &QLinear<B>| !matches!(w, QLinear::Dense(_));
    model.blocks.iter().any(|b| {
        let a = &b.attn;
        let mlp = match &b.ffn {
            toy_models::llama::Ffn::Dense(m) => packed(&m.gate) || packed(&m.up) || packed(&m.down),
            toy_models::llama::Ffn::Moe(_) => false,
        };
        packed(&a.wq) || packed(&a.wk) || packed(&a.wv) || packed(&a.wo) || mlp
    }) || packed(&model.output)
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
        Recipe::Full { .. } => dequantize(model, &base.file, device),
        Recipe::Lora { adapter, .. } | Recipe::Qlora { adapter, .. } => {
            let model = match config.recipe {
                Recipe::Lora { .. } => dequantize(model, &base.file, device)?,
                _ => model,
            };
            let model = model.map(&mut Freeze);
            let spec = adapter.spec()?;
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

/// Replace every packed projection with its f32 weight read from `file` (llama.cpp's
/// dequantization, exact in f32).
pub fn dequantize<B: ToyBackend>(
    mut model: Transformer<B>,
    file: &GgufFile,
    device: &B::Device,
) -> Result<Transformer<B>, TrainError> {
    let dense = |w: &mut QLinear<B>, name: &str| -> Result<(), TrainError> {
        if matches!(w, QLinear::Dense(_)) {
            return Ok(());
        }
        let info = file
            .tensor(name)
            .ok_or_else(|| TrainError::Config(format!("the base lacks {name}")))?;
        let values =
            tensor_to_f32(file, info).map_err(|e| TrainError::Config(format!("{name}: {e}")))?;
        let shape = [info.dims[1] as usize, info.dims[0] as usize];
        *w = QLinear::Dense(Param::from_tensor(Tensor::from_data(
            TensorData::new(values, shape),
            device,
        )));
        Ok(())
    };
    let output = if file.tensor("output.weight").is_some() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    dense(&mut model.output, output)?;
    for (i, b) in model.blocks.iter_mut().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        dense(&mut b.attn.wq, &name("attn_q"))?;
        dense(&mut b.attn.wk, &name("attn_k"))?;
        dense(&mut b.attn.wv, &name("attn_v"))?;
        dense(&mut b.attn.wo, &name("attn_output"))?;
        match &mut b.ffn {
            toy_models::llama::Ffn::Dense(m) => {
                dense(&mut m.gate, &name("ffn_gate"))?;
                dense(&mut m.up, &name("ffn_up"))?;
                dense(&mut m.down, &name("ffn_down"))?;
            }
            toy_models::llama::Ffn::Moe(_) => {
                return Err(TrainError::Config(
                    "fine-tuning a mixture-of-experts base is not supported".into(),
                ));
            }
        }
    }
    Ok(model)
}
