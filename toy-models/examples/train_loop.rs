//! Train toy's `Transformer` in your own burn loop, with burn's own Adam — no toy-train.
//!
//! ```sh
//! cargo run --release -p toy-models --example train_loop
//! ```
//!
//! A two-layer llama learns a paragraph byte by byte (a vocabulary of 256), then writes the
//! paragraph's start back from a few bytes. The model is a plain burn `Module`: on an
//! `Autodiff` backend its parameters take gradients, `model.valid()` is the same weights for
//! inference, and `toy_models::save` would write it as a GGUF that `toy infer` and llama.cpp read.

use std::ops::ControlFlow;

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use toy_core::sampling::{Sampler, SamplingParams};
use toy_models::LlamaConfig;
use toy_models::generate::{GenerateOptions, generate};

const TEXT: &str = "It was the best of times, it was the worst of times, it was the age of \
wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of \
incredulity, it was the season of Light, it was the season of Darkness, it was the spring of \
hope, it was the winter of despair.";

type Train = Autodiff<Flex>;

fn main() {
    let device = Default::default();
    // The same random initial weights on every run.
    Train::seed(&device, 42);
    let bytes: Vec<i64> = TEXT.bytes().map(i64::from).collect();
    // n_layer, d_model, n_head, n_head_kv, head_dim, d_ff, vocab, context.
    let mut model = LlamaConfig::new(2, 64, 4, 2, 16, 128, 256, 64).init::<Train>(&device);
    let mut optimizer = AdamConfig::new().init();

    // Each step: 8 windows of 63 bytes, the targets shifted by one. As long as the context
    // (64), so that every position the sampling below reaches was trained.
    let (batch, len) = (8, 63);
    let mut seed = 7u64;
    let mut first_loss = None;
    let mut loss_value = 0.0;
    for step in 0..300 {
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..batch {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let start = (seed >> 33) as usize % (bytes.len() - len - 1);
            inputs.extend_from_slice(&bytes[start..start + len]);
            targets.extend_from_slice(&bytes[start + 1..start + len + 1]);
        }
        let inputs =
            Tensor::<Train, 2, Int>::from_data(TensorData::new(inputs, [batch, len]), &device);
        let targets =
            Tensor::<Train, 2, Int>::from_data(TensorData::new(targets, [batch, len]), &device);
        // Mean cross-entropy over every position. It starts far above ln 256 ≈ 5.5: the head
        // is tied to unit-scale token embeddings, burn's `Embedding` default. For a loss of your
        // own, `model.forward(inputs, &mut model.new_cache())` gives the logits instead.
        let loss = model.loss(inputs, targets);
        loss_value = loss.clone().into_scalar();
        first_loss.get_or_insert(loss_value);
        if step % 50 == 0 {
            println!("step {step:3}  loss {loss_value:.3}");
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(3e-3, model, grads);
    }
    let first_loss = first_loss.unwrap();
    println!("loss {first_loss:.3} -> {loss_value:.3}");
    assert!(loss_value < first_loss / 2.0, "the model did not learn");

    // The trained weights without the autodiff graph, greedy from the first 16 bytes (16 + 47
    // = 63 positions, all trained).
    let model = model.valid();
    let prompt: Vec<u32> = TEXT.bytes().take(16).map(u32::from).collect();
    let options = GenerateOptions {
        max_new_tokens: 47,
        stop_at_eog: false,
    };
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let (ids, _) = generate(
        &model,
        &prompt,
        &options,
        &mut sampler,
        |_| false,
        |_| ControlFlow::Continue(()),
    )
    .expect("generates");
    let text: Vec<u8> = prompt.iter().chain(&ids).map(|&id| id as u8).collect();
    println!("{}", String::from_utf8_lossy(&text));
}
