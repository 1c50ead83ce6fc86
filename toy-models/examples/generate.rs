//! Generate text from a GGUF file with toy's crates as a library — what `toy infer` does, in
//! one screen.
//!
//! ```sh
//! cargo run --release -p toy-models --example generate -- MODEL.gguf "The capital of France is"
//! ```
//!
//! The steps: open the file (memory-mapped; nothing is read yet), build the tokenizer its
//! metadata describes, load the weights onto a burn backend (quantized ones stay packed), then
//! let `generate` run the prompt and sample one token at a time, printing each as it comes.

use std::io::Write;
use std::ops::ControlFlow;

use toy_core::gguf::GgufFile;
use toy_core::sampling::{Sampler, SamplingParams};
use toy_core::tokenizer::{StreamDecoder, Tokenizer};
use toy_kernels::ToyBackend;
use toy_models::generate::{GenerateOptions, generate};
use toy_models::load_model;

/// Everything below is generic over the backend: pass another device type to `run` to move the
/// model (for example `burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>` with
/// its `WgpuDevice`, as `toy --backend wgpu` does).
fn run<B: ToyBackend>(path: &str, prompt: &str, device: &B::Device) -> anyhow::Result<()> {
    let file = GgufFile::open(path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let (config, model) = load_model::<B>(&file, device, |_, _| {})?;
    eprintln!(
        "{} ({} layers, d_model {})",
        config.architecture, config.n_layer, config.d_model
    );

    // `add_special`: the BOS token the model was trained with, as llama.cpp adds it.
    let ids = tokenizer.encode(prompt, true, false)?;
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let options = GenerateOptions {
        max_new_tokens: 32,
        stop_at_eog: true,
    };
    // Token pieces are bytes: a character split over two tokens is printed once both arrived.
    let mut text = StreamDecoder::new(&tokenizer);
    print!("{prompt}");
    let (_, stats) = generate(
        &model,
        &ids,
        &options,
        &mut sampler,
        |id| tokenizer.is_eog(id),
        |id| {
            print!("{}", text.push(id));
            let _ = std::io::stdout().flush();
            ControlFlow::Continue(())
        },
    )?;
    println!();
    eprintln!(
        "{} prompt tokens at {:.1} t/s, {} generated at {:.1} t/s ({})",
        stats.prompt_tokens,
        stats.prompt_tokens_per_s(),
        stats.generated_tokens,
        stats.gen_tokens_per_s(),
        stats.finish_reason
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: generate MODEL.gguf [PROMPT]"))?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".into());
    // burn's Flex backend on the CPU, with toy's native quantized kernels.
    run::<burn::backend::Flex>(&path, &prompt, &Default::default())
}
