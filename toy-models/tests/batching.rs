//! Continuous batching must not change a sequence's numbers: sixteen prompts of different
//! lengths, started at different steps and decoded together in one forward pass per step
//! (prompt chunks beside decode tokens, as `toy serve` runs them), give every sequence the
//! logits — to the bit — and so the greedy ids it gets alone. Quantized fixtures of each
//! family kind on the CPU — K-quants too, whose llama.cpp kernels differ by row count (the
//! batched pass declares each sequence's rows: `ToyBackend::with_row_groups`).
//!
//! On wgpu the rule is looser, for a reason `wgpu.rs` gives where it checks it.

mod common;

use burn::backend::Flex;

use common::batching::{alone, argmax, prompts, together};
use common::load;

fn check(name: &str) {
    let device = Default::default();
    let (file, _, model) = load::<Flex>(name, &device);
    let prompts = prompts(&file);
    let batched = together(&model, &prompts);
    for (i, p) in prompts.iter().enumerate() {
        let single = alone(&model, p);
        let ids = |rows: &[Vec<f32>]| rows.iter().map(|r| argmax(r)).collect::<Vec<_>>();
        assert_eq!(
            ids(&batched[i]),
            ids(&single),
            "{name}: prompt {i} (length {}) decodes differently in a batch",
            p.len()
        );
        for (step, (b, s)) in batched[i].iter().zip(&single).enumerate() {
            assert!(
                b == s,
                "{name}: prompt {i}, step {step}: batched logits differ from the sequence's own"
            );
        }
    }
}

#[test]
fn batched_llama_family_sequences_equal_their_own_runs() {
    // Q/K biases (qwen2); sliding-window layers, Q/K norms, soft-caps (gemma3); fused QKV and
    // LongRoPE-free phi3.
    for name in ["qwen2", "gemma3-q8_0", "phi3-q8_0"] {
        check(name);
    }
}

#[test]
fn batched_sequences_of_row_count_dependent_types_equal_their_own_runs() {
    // Q4_K_M: Q4_K (a 4-row gemm beside the 1-row gemv) and Q6_K (tiled from 8 rows); every
    // K-quant; the legacy types with IQ4_NL (tinyBLAS from 2 rows); F16 and BF16 (tinyBLAS).
    for name in ["kq-q4_k_m", "kq-k", "kq-legacy", "kq-16bit"] {
        check(name);
    }
}

#[test]
fn batched_gpt2_and_moe_sequences_equal_their_own_runs() {
    for name in ["gpt2-q8_0", "olmoe-q8_0"] {
        check(name);
    }
}
