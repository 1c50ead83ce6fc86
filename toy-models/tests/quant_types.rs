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
use common::{expected, ids, matches_llama_cpp, model_cache, open_cached};

/// The oracle prints 9 significant digits; the arithmetic is the same bit for bit.
const TOL: f64 = 2e-6;

fn check(name: &str) {
    // Sets the CPU backend to the fixture's llama.cpp build (AVX2).
    assert_eq!(expected(name)["ggml_isa"], "avx2");
    matches_llama_cpp::<Flex>(name, "llama", TOL, None, 0.0, &Default::default());
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

// ---------------------------------------------------------------------------------------------
// Real shapes, on files made outside git (not in CI: `cargo test --release -p toy-models --test
// quant_types -- --ignored`): SmolLM2-135M-Instruct in every type from
// `fixtures/smollm2/make_quant_types.sh`, and the Llama-3.2-1B-shaped model of
// `benches/make-llama-1b.sh`, both in `$TOY_MODEL_CACHE` (default `~/.cache/toy-models`).

fn json(path: std::path::PathBuf) -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap()
}

/// Greedy ids (5 prompts × 32) and the 16-token prompt's per-position top-5 logits of SmolLM2 in
/// each type llama-quantize makes, against llama.cpp's AVX2 build on the same files.
#[test]
#[ignore = "needs the llama-quantized SmolLM2 files (fixtures/smollm2/make_quant_types.sh)"]
fn smollm2_in_every_type_matches_llama_cpp() {
    use toy_kernels::flex::{GgmlIsa, set_ggml_isa};
    set_ggml_isa(GgmlIsa::Avx2);
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/smollm2/quant-types");
    let mut report = Vec::new();
    for ty in [
        "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "IQ4_NL",
        "IQ4_XS", "Q4_0", "Q3_K_M", "Q2_K",
    ] {
        let oracle = json(dir.join(format!("{ty}.json")));
        let path = model_cache().join(oracle["file"]["name"].as_str().unwrap());
        let model = open_cached(&path, "fixtures/smollm2/make_quant_types.sh");
        let mut same = 0;
        for case in oracle["greedy"].as_array().unwrap() {
            let prompt = ids(&case["prompt_ids"]);
            let want = ids(&case["gen_ids"]);
            let got = common::greedy(&model, &prompt, want.len());
            let agree = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            assert_eq!(
                agree,
                want.len(),
                "{ty}: greedy ids after {:?} leave llama.cpp's at step {agree}",
                case["prompt"]
            );
            same += agree;
        }
        let sixteen = &oracle["sixteen"];
        let prompt = ids(&sixteen["ids"]);
        let rows = common::logits(&model, &[&prompt]);
        let mut worst = 0.0f64;
        for p in sixteen["positions"].as_array().unwrap() {
            let row = &rows[p["pos"].as_u64().unwrap() as usize];
            for pair in p["top"].as_array().unwrap() {
                let (id, want) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap(),
                );
                worst = worst.max((row[id] as f64 - want).abs());
            }
        }
        report.push(format!(
            "{ty}: {same}/160 greedy ids, top-5 logits within {worst:.1e}"
        ));
        assert!(
            worst <= TOL,
            "{ty}: logits differ from llama.cpp's by {worst:e}"
        );
    }
    eprintln!("{}", report.join("\n"));
}

/// Greedy ids of the random-weight Llama-3.2-1B-shaped model (d 2048, 16 layers, GQA 32/8, vocab
/// 128256) in Q4_K_M and Q8_0, against llama.cpp's AVX2 build (`fixtures/llama-1b-shape/`).
#[test]
#[ignore = "needs the 1B-shaped model (benches/make-llama-1b.sh)"]
fn llama_1b_shape_matches_llama_cpp() {
    toy_kernels::flex::set_ggml_isa(toy_kernels::flex::GgmlIsa::Avx2);
    common::llama_1b_shape_greedy_matches("expected.json");
}
