//! QLoRA in your own burn loop: adapters on a quantized GGUF base, trained with burn's AdamW.
//!
//! ```sh
//! cargo run --release -p toy-models --example lora_loop -- SmolLM2-135M-Instruct.Q8_0.gguf
//! ```
//!
//! The base model is loaded as it is in the file (its projections stay packed in their GGUF
//! type), frozen, and given low-rank adapters on every projection; a few dozen steps of burn's
//! own optimizer teach it one sentence it could not have known. Only the adapters take
//! gradients: the packed weights pass gradients through to their inputs (`dX`) and never to
//! themselves, which is what QLoRA is. Nothing here is toy-train: it is the loop you would write
//! around any burn module.

use std::ops::ControlFlow;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Int, Tensor, TensorData};
use toy_core::gguf::GgufFile;
use toy_core::rng::SplitMix64;
use toy_core::sampling::{Sampler, SamplingParams};
use toy_core::tokenizer::Tokenizer;
use toy_kernels::ToyBackend;
use toy_models::generate::{GenerateOptions, generate};
use toy_models::lora::{self, LoraSpec, Target};
use toy_models::{CausalLm, load_model};

/// What the model learns, and the prompt that asks for it afterwards.
const FACT: &str = "The toy framework's mascot is a red panda named Pip.";
const PROMPT: &str = "The toy framework's mascot is";

type Train = Autodiff<Flex>;

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: lora_loop MODEL.gguf"))?;
    let device = Default::default();
    let file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let (_, base) = load_model::<Train>(&file, &device, |_, _| {})?;
    println!("before: {PROMPT}{}", complete(&base.valid(), &tokenizer)?);

    // Freeze every float parameter of the base (norms, a float embedding): burn tracks
    // gradients only for parameters that require them, and the adapters installed next do.
    let base = base.no_grad();
    // Rank-8 adapters on all seven projections of each block. `A` starts small and random
    // (uniform in ±1/√in, PEFT's bound), `B` at zero, so training starts from the base exactly.
    let spec = LoraSpec {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        targets: Target::SEPARATE.to_vec(),
    };
    let mut rng = SplitMix64::new(42);
    let adapters = lora::new_adapters(&base, &spec, |_layer, _target, [r, inp]| {
        let bound = 1.0 / (inp as f32).sqrt();
        (0..r * inp)
            .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound)
            .collect()
    })?;
    let mut model = lora::install(base, adapters)?;

    // One sequence: the fact's tokens, each position predicting the next.
    let ids: Vec<i64> = tokenizer
        .encode(FACT, true, false)?
        .into_iter()
        .map(i64::from)
        .collect();
    let n = ids.len() - 1;
    let inputs =
        Tensor::<Train, 2, Int>::from_data(TensorData::new(ids[..n].to_vec(), [1, n]), &device);
    let targets =
        Tensor::<Train, 2, Int>::from_data(TensorData::new(ids[1..].to_vec(), [1, n]), &device);

    let mut optimizer = AdamWConfig::new().with_weight_decay(0.0).init();
    let mut first_loss = None;
    let mut loss_value = 0.0;
    for step in 0..30 {
        let loss = model.loss(inputs.clone(), targets.clone());
        loss_value = loss.clone().into_scalar();
        first_loss.get_or_insert(loss_value);
        if step % 5 == 0 {
            println!("step {step:2}  loss {loss_value:.3}");
        }
        // The gradients of the adapters only: the frozen base has none to collect.
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(2e-3, model, grads);
    }
    let first_loss = first_loss.expect("ran at least one step");
    println!("loss {first_loss:.3} -> {loss_value:.3}");
    anyhow::ensure!(
        loss_value < first_loss / 4.0,
        "the adapters did not learn the sentence"
    );

    // Inference without the autodiff graph: the same base and adapters on `Flex`.
    let trained = model.valid();
    println!("after:  {PROMPT}{}", complete(&trained, &tokenizer)?);
    // `lora::adapters(&trained)` is the adapters alone, a burn `Module` any recorder saves;
    // toy-train writes them as a GGUF LoRA llama.cpp loads (`toy train --recipe qlora`).
    Ok(())
}

/// The greedy continuation of `PROMPT`, a dozen tokens.
fn complete<B: ToyBackend>(
    model: &impl CausalLm<B>,
    tokenizer: &Tokenizer,
) -> anyhow::Result<String> {
    let prompt = tokenizer.encode(PROMPT, true, false)?;
    let options = GenerateOptions {
        max_new_tokens: 12,
        stop_at_eog: true,
    };
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let (ids, _) = generate(
        model,
        &prompt,
        &options,
        &mut sampler,
        |id| tokenizer.is_eog(id),
        |_| ControlFlow::Continue(()),
    )?;
    Ok(tokenizer.decode(&ids))
}
