//! Every packed weight type in a whole model, against llama.cpp: the tiny llama-architecture
//! fixtures `fixtures/models/tiny-kq-*.gguf` (width 256, so that `llama-quantize` really writes
//! K-quants; made by `make_kquant_models.py` from one F32 model with `llama-quantize`'s presets
//! and per-tensor overrides) and llama.cpp's greedy ids and top-8 logits at every position on
//! them, from its AVX2 x86 build.
//!
//! - `tiny-kq-k`: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K matrices; a Q4_K token embedding that the tied
//!   output head multiplies by (unrepacked, where the matmul weights of Q4_K are repacked);
//! - `tiny-kq-legacy`: Q4_0, Q5_0, Q5_1, IQ4_NL, IQ4_XS; a Q3_K embedding, a Q6_K output;
//! - `tiny-kq-16bit`: F16 and BF16 matrices, a BF16 embedding, an F16 output;
//! - `tiny-kq-q4_k_m`: `llama-quantize`'s Q4_K_M preset as it stands (Q4_K and Q6_K).
//!
//! The CPU backend reproduces the AVX2 build's arithmetic (`GgmlIsa::Avx2`) on any CPU, so
//! greedy ids must agree at every step and logits to the oracle's print precision.

mod common;

use burn::backend::Flex;
use common::{expected, ids, load, logit_deviation};
use toy_core::tokenizer::Tokenizer;
use toy_kernels::flex::{GgmlIsa, set_ggml_isa};

/// The oracle prints 9 significant digits; the arithmetic is the same bit for bit.
const TOL: f64 = 2e-6;

fn check(name: &str) {
    set_ggml_isa(GgmlIsa::Avx2);
    let device = Default::default();
    let expected = expected(name);
    let (file, architecture, model) = load::<Flex>(name, &device);
    assert_eq!(architecture, "llama");
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    for case in expected["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let text = case["prompt"].as_str().unwrap();
        assert_eq!(tokenizer.encode(text, true, true).unwrap(), prompt, "{name}: tokens of {text:?}");
        let want = ids(&case["gen_ids"]);
        let got = common::greedy(&model, &prompt, want.len());
        assert_eq!(got, want, "{name}: greedy ids after {text:?}");
    }
    let worst = logit_deviation(&model, &expected, &device);
    eprintln!("{name}: greedy ids identical, largest logit deviation {worst:.1e}");
    assert!(worst <= TOL, "{name}: logits differ from llama.cpp's by {worst:e}");
}

#[test]
fn k_quants_match_llama_cpp() {
    check("kq-k");
}

#[test]
fn q4_q5_iq4_match_llama_cpp() {
    check("kq-legacy");
}

#[test]
fn f16_and_bf16_match_llama_cpp() {
    check("kq-16bit");
}

#[test]
fn q4_k_m_preset_matches_llama_cpp() {
    check("kq-q4_k_m");
}
