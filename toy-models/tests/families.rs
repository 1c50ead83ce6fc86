//! Model families and RoPE variants beyond SmolLM2, on tiny random-weight GGUFs (fixtures/models/, made by
//! make_tiny_models.py) against llama.cpp's outputs on the same files: tokenization, greedy ids
//! (16 steps, margins down to 0.004) and every position's top-8 logits.
//!
//! Tolerance for logits: 2e-6, the oracle's print precision — the CPU backend computes these
//! Q8_0 models the way llama.cpp does, bit for bit (docs/correctness.md).

mod common;

use std::path::PathBuf;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/models")).join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(name: &str, arch: &str) {
    let expected: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(&format!("tiny-{name}.expected.json"))).unwrap(),
    )
    .unwrap();
    let file = GgufFile::open(fixture(&format!("tiny-{name}.gguf"))).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let device = Default::default();
    let (config, model) = toy_models::load::<Flex>(&file, &device, |_, _| {}).unwrap();
    assert_eq!(config.architecture, arch);

    for case in expected["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let text = case["prompt"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true, true).unwrap(),
            prompt,
            "{arch}: tokens of {text:?}"
        );
        let want = ids(&case["gen_ids"]);
        let got = common::greedy(&model, &prompt, want.len());
        assert_eq!(got, want, "{arch}: greedy ids after {text:?}");
    }

    let mut worst = 0.0f64;
    for case in expected["logits"].as_array().unwrap() {
        let prompt: Vec<i64> = ids(&case["ids"]).into_iter().map(i64::from).collect();
        let n = prompt.len();
        let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(prompt, [1, n]), &device);
        let logits = model
            .forward(tokens, &mut model.new_cache())
            .into_data()
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
                let err = (logits[pos * vocab + id] as f64 - want).abs();
                worst = worst.max(err);
                assert!(
                    err <= 2e-6,
                    "{arch}: position {pos} logit[{id}] {} vs llama.cpp {want}",
                    logits[pos * vocab + id]
                );
            }
        }
    }
    eprintln!("{name}: greedy ids identical, largest logit deviation {worst:.1e}");
}

#[test]
fn qwen2_matches_llama_cpp() {
    check("qwen2", "qwen2");
}

#[test]
fn qwen3_matches_llama_cpp() {
    check("qwen3", "qwen3");
}

/// Llama 3.1-style `rope_freqs.weight` frequency divisors (greedy margins down to 0.0009).
#[test]
fn llama3_rope_freqs_match_llama_cpp() {
    check("llama3", "llama");
}

/// YaRN RoPE scaling (factor 4 over an original context of 64).
#[test]
fn qwen2_yarn_matches_llama_cpp() {
    check("qwen2-yarn", "qwen2");
}
