//! Gemma 3, Phi-3, SmolLM3 and Granite on tiny random-weight GGUFs
//! (`fixtures/models/make_new_family_models.py`, spec notes in `fixtures/models/NEW_FAMILIES.md`)
//! against llama.cpp's AVX2 build on the same files: tokenization of the prompts, every greedy
//! id (32 steps × 3 prompts; smallest llama.cpp top-2 margin 0.0031) and the top-8 logits at
//! every prompt position.
//!
//! What each fixture exercises:
//! - `gemma3`: 8 layers in llama.cpp's 5 local : 1 global pattern with window 4 (prompts and
//!   generations much longer), RoPE base 10 000 unscaled on the local layers and 1e6 with linear
//!   factor 8 on the global one, per-head Q/K norms, four norms per layer, √d embedding scale,
//!   GELU gate, queries × 1/√key_length (≠ 1/√(d/n_head)); `gemma3-noswa`: the same weights
//!   without `sliding_window` (every layer global, as llama.cpp does).
//! - `phi3`: fused `attn_qkv` and gate+up `ffn_up`, partial rotary (24 of 32 dims), LongRoPE
//!   long factors (original context 32) with cos/sin × `attn_factor` 1.549; `phi3-short`: the
//!   short factors, which llama.cpp picks for its 1024-token context under an original context
//!   of 2048 — so the model runs with `set_context(1024)` as the oracle did.
//! - `smollm3`: layer 3 of 5 without RoPE (llama.cpp's hard-coded interval 4).
//! - `granite`: embedding scale 12, residual scale 0.22, attention scale 1/32, logits ÷ 8.
//!
//! Each also runs on `ndarray` (F32) and, in `wgpu.rs`, on `wgpu` (lavapipe here; F32 and Q8_0).
//!
//! Tolerances as in `families.rs`: the Q8_0 files are computed as llama.cpp computes them
//! (2e-6, the oracle's print precision); the F32 ones through burn's gemm (1e-5), and with
//! ggml's f16-table GELU for gemma3 (5e-4).
//!
//! This is its own test binary because the fixtures come from the AVX2 build, whose f32
//! arithmetic the CPU backend is set to for the whole process (`families.rs` holds AVX-512 ones).

mod common;

use burn::backend::Flex;
use common::{F32_TOL, GELU_TOL, QUANTIZED_TOL, expected, matches_llama_cpp};
use toy_core::gguf::GgufFile;

/// On the CPU backend, every step. The fixtures must come from the AVX2 build.
fn check(name: &str, arch: &str, tol: f64, n_ctx: Option<usize>) {
    assert_eq!(expected(name)["ggml_isa"], "avx2");
    matches_llama_cpp::<Flex>(name, arch, tol, n_ctx, 0.0, &Default::default());
}

#[test]
fn gemma3_matches_llama_cpp() {
    check("gemma3", "gemma3", GELU_TOL, None);
}

#[test]
fn gemma3_q8_0_matches_llama_cpp() {
    check("gemma3-q8_0", "gemma3", QUANTIZED_TOL, None);
}

#[test]
fn gemma3_without_sliding_window_is_all_global() {
    check("gemma3-noswa", "gemma3", GELU_TOL, None);
}

#[test]
fn phi3_long_rope_matches_llama_cpp() {
    check("phi3", "phi3", F32_TOL, None);
}

#[test]
fn phi3_q8_0_matches_llama_cpp() {
    check("phi3-q8_0", "phi3", QUANTIZED_TOL, None);
}

/// The short factors: llama.cpp's context (1024) does not exceed the original 2048.
#[test]
fn phi3_short_factors_match_llama_cpp() {
    check("phi3-short", "phi3", F32_TOL, Some(1024));
}

#[test]
fn smollm3_matches_llama_cpp() {
    check("smollm3", "smollm3", F32_TOL, None);
}

#[test]
fn smollm3_q8_0_matches_llama_cpp() {
    check("smollm3-q8_0", "smollm3", QUANTIZED_TOL, None);
}

#[test]
fn granite_matches_llama_cpp() {
    check("granite", "granite", F32_TOL, None);
}

#[test]
fn granite_q8_0_matches_llama_cpp() {
    check("granite-q8_0", "granite", QUANTIZED_TOL, None);
}

/// The configuration each fixture sets, as `toy describe` reports it.
#[test]
fn configs_read_the_variants() {
    let config = |name: &str| {
        let file = GgufFile::open(common::fixture(&format!("tiny-{name}.gguf"))).unwrap();
        toy_core::config::ModelConfig::from_gguf(&file).unwrap()
    };
    let g = config("gemma3");
    let local: Vec<usize> = (0..8).filter(|&i| g.swa_layers[i]).collect();
    assert_eq!(local, [0, 1, 2, 3, 4, 6, 7]);
    assert_eq!(
        (g.sliding_window, g.rope_theta_swa),
        (Some(4), Some(10_000.0))
    );
    assert_eq!(g.query_scale, Some(1.0 / 32f32.sqrt()));
    assert_eq!(g.final_softcap, None);
    let n = config("gemma3-noswa");
    assert_eq!((n.sliding_window, n.rope_theta_swa), (None, None));
    let p = config("phi3");
    assert!(p.fused_qkv && p.fused_gate_up);
    assert_eq!((p.long_rope_context, p.sliding_window), (Some(32), None));
    assert!((p.rope_attn_factor - 1.549_193_4).abs() < 1e-6);
    let s = config("smollm3");
    assert_eq!(s.no_rope_layers, [false, false, false, true, false]);
    let gr = config("granite");
    assert_eq!(gr.embed_scale, Some(12.0));
    assert_eq!(gr.logit_scale, Some(8.0));
    assert_eq!(gr.kq_scale, Some(0.03125));
    assert!((gr.residual_scale.unwrap() - 0.22).abs() < 1e-6);
}

/// Malformed files of the new families: one-line errors, no panic.
#[test]
fn bad_new_family_files_are_refused_clearly() {
    let err = |name: &str| {
        let file = GgufFile::open(common::fixture(&format!("tiny-{name}.gguf"))).unwrap();
        match toy_models::load_model::<Flex>(&file, &Default::default(), |_, _| {}) {
            Ok(_) => panic!("{name} loaded"),
            Err(e) => e.to_string(),
        }
    };
    let kv = err("gemma3-bad-kv");
    assert!(
        kv.contains("head_count 4") && kv.contains("head_count_kv 3"),
        "{kv}"
    );
    let rope = err("phi3-bad-rope");
    assert!(
        rope.contains("rope_factors_long.weight") && rope.contains("14"),
        "{rope}"
    );
    for e in [kv, rope] {
        assert!(!e.contains('\n'), "{e}");
    }
}

/// The F32 fixtures on `ndarray` (the reference bodies): the new families' config fields are
/// plain burn ops and backend ops, so they run on any backend.
#[test]
fn f32_new_families_on_ndarray() {
    use burn::backend::NdArray;
    let device = Default::default();
    for (name, arch, tol, n_ctx) in [
        ("gemma3", "gemma3", GELU_TOL, None),
        ("phi3", "phi3", F32_TOL, None),
        ("phi3-short", "phi3", F32_TOL, Some(1024)),
        ("smollm3", "smollm3", F32_TOL, None),
        ("granite", "granite", F32_TOL, None),
    ] {
        matches_llama_cpp::<NdArray>(name, arch, tol, n_ctx, 0.0, &device);
    }
}
