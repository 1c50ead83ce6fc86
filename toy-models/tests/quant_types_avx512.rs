//! The tiny K-quant / legacy / 16-bit models of `quant_types.rs` against llama.cpp's **AVX-512**
//! x86 build (`fixtures/models/tiny-kq-*.avx512.expected.json`, made by
//! `make_kquant_avx512.py` on the same files). That build sums its f32 parts in 16 lanes,
//! repacks Q2_K matrices as well as Q4_K (`q2_K_8x8_q8_K`), and has AVX-512 bodies for the
//! repacked gemms; on CPUs with AVX512_BF16 its bf16 dot products are `vdpbf16ps`'s. The CPU
//! backend reproduces it on any CPU (`GgmlIsa::Avx512`, `Avx512Bf16`), so greedy ids
//! must agree at every step and logits to the oracle's print precision.
//!
//! `kq-f16` is `kq-16bit` with every 16-bit matrix as F16, so F16 is checked apart from bf16.
//!
//! A test binary of its own: the llama.cpp build reproduced is a process-wide setting, and
//! `quant_types.rs` checks the AVX2 build.

mod common;

use burn::backend::Flex;
use common::{expected, ids, load, logit_deviation};

/// The oracle prints 9 significant digits; the arithmetic is the same bit for bit.
const TOL: f64 = 2e-6;

fn check(name: &str) {
    let device = Default::default();
    // Sets the CPU backend to the fixture's llama.cpp build.
    let expected = expected(&format!("{name}.avx512"));
    assert!(expected["ggml_isa"].as_str().unwrap().starts_with("avx512"));
    let (_, _, model) = load::<Flex>(name, &device);
    for case in expected["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["gen_ids"]);
        let got = common::greedy(&model, &prompt, want.len());
        assert_eq!(got, want, "{name}: greedy ids after {:?}", case["prompt"]);
    }
    let worst = logit_deviation(&model, &expected, &device);
    eprintln!("{name} (AVX-512 build): greedy ids identical, largest logit deviation {worst:.1e}");
    assert!(
        worst <= TOL,
        "{name}: logits differ from llama.cpp's AVX-512 build by {worst:e}"
    );
}

/// Every K-quant twice, a Q4_K embedding read by the tied head; on this build Q2_K and Q4_K
/// matrices are repacked (`q2_K_8x8`, `q4_K_8x8`).
#[test]
fn k_quants_match_llama_cpp_avx512() {
    check("kq-k");
}

#[test]
fn q4_q5_iq4_match_llama_cpp_avx512() {
    check("kq-legacy");
}

/// F16 and BF16 matrices, a BF16 embedding, an F16 head. The fixture's build had AVX512_BF16
/// (`ggml_isa: avx512_bf16`): its bf16 dot products and tinyBLAS are `vdpbf16ps`'s pairs.
#[test]
fn f16_and_bf16_match_llama_cpp_avx512() {
    check("kq-16bit");
}

#[test]
fn q4_k_m_preset_matches_llama_cpp_avx512() {
    check("kq-q4_k_m");
}
/// Every 16-bit matrix of `kq-16bit` as F16 (`make_kquant_avx512.py`): the AVX-512 build's
/// `vec_dot_f16` (16 lanes) and F16 tinyBLAS, apart from bf16.
#[test]
fn f16_matches_llama_cpp_avx512() {
    check("kq-f16");
}

/// The random-weight Llama-3.2-1B-shaped model in Q4_K_M and Q8_0 (`benches/make-llama-1b.sh`,
/// outside git) against the AVX-512 build's greedy ids (`fixtures/llama-1b-shape/
/// expected.avx512.json`, made on a Zen 4 EPYC; 2 prompts × 16 tokens).
#[test]
#[ignore = "needs the 1B-shaped model (benches/make-llama-1b.sh)"]
fn llama_1b_shape_matches_llama_cpp_avx512() {
    toy_kernels::flex::set_ggml_isa(toy_kernels::flex::GgmlIsa::Avx512);
    common::llama_1b_shape_greedy_matches("expected.avx512.json");
}
