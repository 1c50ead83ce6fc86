//! End-to-end: greedy generation on the real SmolLM2-135M-Instruct must produce exactly the ids
//! llama.cpp produced (fixtures/smollm2/greedy.json), on the original Q4_1 file and on the F32 and
//! Q8_0 copies made by `toy convert` (scripts/fetch-smollm2.sh).
//!
//! Rule (from the oracle): ids must be identical at least up to (not including) the first step
//! where llama.cpp's own top-2 logit margin is below 0.02 (F32) or 0.1 (Q8_0, Q4_1) — there
//! another correct summation order may pick the other token. We print how far each run matches.

mod common;

use burn::backend::Flex;
use toy_core::gguf::GgufFile;

/// Greedy ids for every oracle prompt of `kind`, checked against llama.cpp.
fn check_greedy(kind: &str, margin_threshold: f64) {
    let oracle = common::oracle("greedy.json");
    let file = GgufFile::open(common::smollm2(kind)).unwrap();
    let device = Default::default();
    let (_config, model) = toy_models::load::<Flex>(&file, &device, |_, _| {}).unwrap();
    let mut failures = Vec::new();
    for (i, case) in oracle["results"][kind]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let prompt: Vec<u32> = case["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let expected: Vec<u32> = case["gen_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let margins: Vec<f64> = case["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["margin"].as_f64().unwrap())
            .collect();
        let must_match = margins
            .iter()
            .position(|&m| m < margin_threshold)
            .unwrap_or(expected.len());
        let ids = common::greedy(&model, &prompt, expected.len());
        let common = ids
            .iter()
            .zip(&expected)
            .take_while(|(a, b)| a == b)
            .count();
        eprintln!(
            "{kind} prompt {i}: {common}/{} ids match llama.cpp (required: {must_match})",
            expected.len()
        );
        if common < must_match {
            failures.push(format!("prompt {i}: first mismatch at step {common} (required {must_match}): got {ids:?}, expected {expected:?}"));
        }
    }
    assert!(failures.is_empty(), "{kind}: {}", failures.join("\n"));
}

#[test]
fn greedy_f32_matches_llama_cpp() {
    check_greedy("F32", 0.02);
}

#[test]
fn greedy_q8_0_matches_llama_cpp() {
    check_greedy("Q8_0", 0.1);
}

#[test]
fn greedy_q4_1_matches_llama_cpp() {
    check_greedy("Q4_1", 0.1);
}
