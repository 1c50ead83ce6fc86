// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the tests that run the real SmolLM2-135M-Instruct.

use std::path::PathBuf;

use toy_core::sampling::{Sampler, SamplingParams};
use toy_kernels::ToyBackend;
use toy_models::CausalLm;
use toy_models::generate::{GenerateOptions, generate};

/// `SmolLM2-135M-Instruct.<kind>.gguf` in the model cache (`TOY_MODEL_CACHE`, default
/// `~/.cache/toy-models`), as `scripts/fetch-smollm2.sh` leaves it. Fails loudly if it is missing:
/// these tests are part of the suite, not optional.
pub fn smollm2(kind: &str) -> PathBuf {
    let cache = std::env::var_os("TOY_MODEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/toy-models")
        });
    let path = cache.join(format!("SmolLM2-135M-Instruct.{kind}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-smollm2.sh first",
        path.display()
    );
    path
}

/// A JSON fixture from `fixtures/smollm2/`.
pub fn oracle(name: &str) -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/smollm2/").to_string() + name;
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `n` greedy ids after `prompt`, not stopping at end-of-generation tokens (as the oracle runs).
pub fn greedy<B: ToyBackend>(model: &impl CausalLm<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let options = GenerateOptions {
        max_new_tokens: n,
        stop_at_eog: false,
    };
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 0.0,
        ..Default::default()
    });
    let keep_going = |_| std::ops::ControlFlow::Continue(());
    generate(model, prompt, &options, &mut sampler, |_| false, keep_going)
        .unwrap()
        .0
}
