// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the tests that run the real SmolLM2-135M-Instruct.

use burn::tensor::{Int, Tensor, TensorData};

use toy_core::sampling::{Sampler, SamplingParams};
use toy_kernels::ToyBackend;
use toy_models::CausalLm;
use toy_models::generate::{GenerateOptions, generate};

#[path = "../../../test-support/smollm2.rs"]
mod smollm2_path;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use smollm2_path::smollm2;

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

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits (as f32) of every position of `chunks` fed one after the other through the KV cache.
pub fn logits<B: ToyBackend>(m: &impl CausalLm<B>, chunks: &[&[u32]]) -> Vec<Vec<f32>> {
    let mut cache = m.new_cache();
    let mut rows = Vec::new();
    for c in chunks {
        let data = TensorData::new(
            c.iter().map(|&x| x as i64).collect::<Vec<_>>(),
            [1, c.len()],
        );
        let l = m.forward(
            Tensor::<B, 2, Int>::from_data(data, &m.device()),
            &mut cache,
        );
        let v = l.into_data().convert::<f32>().into_vec::<f32>().unwrap();
        rows.extend(v.chunks(v.len() / c.len()).map(|r| r.to_vec()));
    }
    rows
}

/// The largest |a − b| of each row.
pub fn max_abs_diff_per_row(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<f32> {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max)
        })
        .collect()
}
