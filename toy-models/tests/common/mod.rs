// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the tests that run the real SmolLM2-135M-Instruct.

use std::path::PathBuf;

use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;
use toy_core::gguf::GgufFile;

use toy_core::sampling::{Sampler, SamplingParams};
use toy_kernels::ToyBackend;
use toy_models::generate::{GenerateOptions, generate};
use toy_models::{CausalLm, Model, load_model};

pub mod batching;
pub mod vit;

#[path = "../../../test-support/smollm2.rs"]
mod smollm2_path;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use smollm2_path::{model_cache, smollm2};

/// A JSON fixture from `fixtures/smollm2/`. They were made by llama.cpp's AVX-512 x86 build, so
/// the CPU backend is set to reproduce that build's arithmetic.
pub fn oracle(name: &str) -> serde_json::Value {
    toy_kernels::flex::set_ggml_isa(toy_kernels::flex::GgmlIsa::Avx512);
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

// Tiny random-weight model fixtures (fixtures/models/) and llama.cpp's outputs on them.

/// Q8_0 (and other packed) fixtures: computed as llama.cpp computes them, bit for bit on the
/// CPU backend, so the oracle's print precision (families.rs explains each tolerance).
pub const QUANTIZED_TOL: f64 = 2e-6;
/// F32 fixtures without GELU: burn's gemm sums in another order than ggml's.
pub const F32_TOL: f64 = 1e-5;
/// F32 fixtures with ggml's f16-table GELU.
pub const GELU_TOL: f64 = 5e-4;

/// Fixture `name` (architecture `arch`) on backend `B` against llama.cpp's outputs on it, run
/// with a context of `n_ctx` tokens if given: the tokens of each prompt, its greedy ids up to
/// the first step whose llama.cpp top-2 margin is below `min_margin` (0: every step), and the
/// top-8 logits at every prompt position within `tol`. Generic over the backend: families.rs
/// and new_families.rs run it on the CPU backends, wgpu.rs on the cubecl kernels.
pub fn matches_llama_cpp<B: ToyBackend>(
    name: &str,
    arch: &str,
    tol: f64,
    n_ctx: Option<usize>,
    min_margin: f64,
    device: &B::Device,
) {
    let expected = expected(name);
    let (file, architecture, mut model) = load::<B>(name, device);
    assert_eq!(architecture, arch);
    if let (Some(n), Model::Llama(m)) = (n_ctx, &mut model) {
        m.set_context(n);
    }
    let tokenizer = toy_core::tokenizer::Tokenizer::from_gguf(&file).unwrap();
    for case in expected["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let text = case["prompt"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true, true).unwrap(),
            prompt,
            "{name}: tokens of {text:?}"
        );
        let mut want = ids(&case["gen_ids"]);
        if min_margin > 0.0 {
            let margins = case["margins"].as_array().expect("the fixture's margins");
            let steps = margins
                .iter()
                .position(|m| m.as_f64().unwrap() < min_margin)
                .unwrap_or(margins.len());
            want.truncate(steps);
        }
        let got = greedy(&model, &prompt, want.len());
        assert_eq!(got, want, "{name}: greedy ids after {text:?}");
    }
    let worst = logit_deviation(&model, &expected, device);
    eprintln!("{name}: greedy ids identical, largest logit deviation {worst:.1e}");
    assert!(
        worst <= tol,
        "{name}: logits differ from llama.cpp's by {worst:e} (tolerance {tol:e})"
    );
}

/// A file of `fixtures/models/`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models")).join(name)
}

/// The llama.cpp outputs on `tiny-{name}.gguf`. The CPU backend is set to reproduce the
/// llama.cpp build that made them (`ggml_isa`: `avx2`, `avx512_bf16`, or AVX-512 for `avx512`
/// and the fixtures older than that field).
pub fn expected(name: &str) -> Value {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(&format!("tiny-{name}.expected.json"))).unwrap(),
    )
    .unwrap();
    use toy_kernels::flex::{GgmlIsa, set_ggml_isa};
    set_ggml_isa(match v["ggml_isa"].as_str() {
        Some("avx2") => GgmlIsa::Avx2,
        Some("avx512_bf16") => GgmlIsa::Avx512Bf16,
        _ => GgmlIsa::Avx512,
    });
    v
}

pub fn load<B: ToyBackend>(name: &str, device: &B::Device) -> (GgufFile, String, Model<B>) {
    let file = GgufFile::open(fixture(&format!("tiny-{name}.gguf"))).unwrap();
    let (config, model) = load_model::<B>(&file, device, |_, _| {}).unwrap();
    (file, config.architecture, model)
}

/// Largest |toy - llama.cpp| over llama.cpp's top-8 logits at every position of every prompt.
pub fn logit_deviation<B: ToyBackend>(
    model: &impl CausalLm<B>,
    expected: &Value,
    device: &B::Device,
) -> f64 {
    let mut worst = 0.0f64;
    for case in expected["logits"].as_array().unwrap() {
        let prompt: Vec<i64> = ids(&case["ids"]).into_iter().map(i64::from).collect();
        let n = prompt.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(prompt, [1, n]), device);
        let logits = model
            .forward(tokens, &mut model.new_cache())
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap();
        let vocab = logits.len() / n;
        for p in case["positions"].as_array().unwrap() {
            let pos = p["pos"].as_u64().unwrap() as usize;
            for pair in p["top"].as_array().unwrap() {
                let (id, want) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap(),
                );
                worst = worst.max((logits[pos * vocab + id] as f64 - want).abs());
            }
        }
    }
    worst
}

// Files made outside git, in the model cache.

/// A GGUF file of the model cache, loaded on the CPU backend; a missing file names the script
/// that makes it.
pub fn open_cached(path: &std::path::Path, made_by: &str) -> Model<burn::backend::Flex> {
    let file = GgufFile::open(path).unwrap_or_else(|e| panic!("{e} ({made_by} makes it)"));
    load_model::<burn::backend::Flex>(&file, &Default::default(), |_, _| {})
        .unwrap()
        .1
}

/// The random-weight Llama-3.2-1B-shaped model in each type `fixtures/llama-1b-shape/{expected}`
/// lists, against the greedy ids in it (the caller has set the llama.cpp build it came from).
pub fn llama_1b_shape_greedy_matches(expected: &str) {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/llama-1b-shape"
    ))
    .join(expected);
    let oracle: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (name, m) in oracle["models"].as_object().unwrap() {
        let path = model_cache().join("llama-1b-shape").join(name);
        let model = open_cached(&path, "benches/make-llama-1b.sh");
        for case in m["greedy"].as_array().unwrap() {
            let prompt = ids(&case["prompt_ids"]);
            let want = ids(&case["gen_ids"]);
            let got = greedy(&model, &prompt, want.len());
            assert_eq!(got, want, "{name}: greedy ids after {:?}", case["prompt"]);
        }
        eprintln!("{name}: greedy ids identical ({expected})");
    }
}
