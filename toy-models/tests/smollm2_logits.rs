//! Logits of the real SmolLM2-135M-Instruct against llama.cpp's (fixtures/smollm2/logits.json):
//! the top-20 at the last position of a prompt, the top-5 and the next token's log-probability
//! at each position of a 16-token prompt, and the mean NLL over 511 scored tokens (n_ctx 512).
//!
//! Tolerances (absolute, in logits / nats), with the deviations measured when they were set:
//! - Q8_0 / Q4_1: 2e-6. The CPU backend computes every op as llama.cpp's x86 build does
//!   (kernels/src/flex.rs), so the results are bit-identical; what is left is the fixture's own
//!   precision (logits printed with 9 significant digits, log-probs rounded to 1e-6). Measured
//!   ≤ 4.8e-7.
//! - F32: 1e-5. The F32 matmuls are llama.cpp's too (tinyBLAS / vec_dot_f32 in the AVX-512
//!   build's order: kernels/src/flex/tinyblas.rs); the fixture prints these logits with 7
//!   significant digits (13.00947), so its precision is ~5e-6. Measured ≤ 3.8e-6 (4.8e-5 when
//!   the products were burn's gemm).

mod common;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use serde_json::Value;
use toy_core::gguf::GgufFile;

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// All-position logits `[t][vocab]` of one forward pass over `ids`.
fn logits(model: &toy_models::Transformer<Flex>, ids: &[i64]) -> Vec<Vec<f32>> {
    let n = ids.len();
    let tokens = Tensor::<Flex, 2, Int>::from_data(
        TensorData::new(ids.to_vec(), [1, n]),
        &Default::default(),
    );
    let out = model.forward(tokens, &mut model.new_cache());
    let flat = out.into_data().into_vec::<f32>().unwrap();
    flat.chunks(flat.len() / n).map(|c| c.to_vec()).collect()
}

fn logsumexp(row: &[f32]) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

fn check(kind: &str, tol: f64) {
    let oracle = common::oracle("logits.json");
    let oracle = &oracle["models"][kind];
    let file = GgufFile::open(common::smollm2(kind)).unwrap();
    let (_, model) = toy_models::load::<Flex>(&file, &Default::default(), |_, _| {}).unwrap();
    let mut worst = 0.0f64;
    let mut track = |what: &str, got: f64, want: f64| {
        let err = (got - want).abs();
        worst = worst.max(err);
        assert!(
            err <= tol,
            "{kind} {what}: got {got}, llama.cpp {want} (|diff| {err} > {tol})"
        );
    };

    let cap = &oracle["capital_last_top20"];
    let rows = logits(&model, &ids(&cap["ids"]));
    let last = rows.last().unwrap();
    for pair in cap["last"]["top"].as_array().unwrap() {
        let (id, want) = (
            pair[0].as_u64().unwrap() as usize,
            pair[1].as_f64().unwrap(),
        );
        track(&format!("capital logit[{id}]"), last[id] as f64, want);
    }
    track(
        "capital logsumexp",
        logsumexp(last),
        cap["last"]["logsumexp"].as_f64().unwrap(),
    );

    let sixteen = &oracle["sixteen_per_position_top5"];
    let rows = logits(&model, &ids(&sixteen["ids"]));
    for p in sixteen["positions"].as_array().unwrap() {
        let pos = p["pos"].as_u64().unwrap() as usize;
        for pair in p["top"].as_array().unwrap() {
            let id = pair[0].as_u64().unwrap() as usize;
            track(
                &format!("pos {pos} logit[{id}]"),
                rows[pos][id] as f64,
                pair[1].as_f64().unwrap(),
            );
        }
        track(
            &format!("pos {pos} logsumexp"),
            logsumexp(&rows[pos]),
            p["logsumexp"].as_f64().unwrap(),
        );
        if let Some(next) = p["next_token"].as_u64() {
            let got = rows[pos][next as usize] as f64 - logsumexp(&rows[pos]);
            track(
                &format!("pos {pos} next logprob"),
                got,
                p["next_logprob"].as_f64().unwrap(),
            );
        }
    }

    // Perplexity as llama.cpp's oracle measured it: one 512-token window, every position after
    // the first scored.
    let ppl = &oracle["ppl"];
    let tokens: Vec<i64> = ids(&ppl["ids"])
        .into_iter()
        .take(ppl["n_tokens_used"].as_u64().unwrap() as usize)
        .collect();
    let rows = logits(&model, &tokens);
    let nll: f64 = (0..tokens.len() - 1)
        .map(|i| logsumexp(&rows[i]) - rows[i][tokens[i + 1] as usize] as f64)
        .sum::<f64>()
        / (tokens.len() - 1) as f64;
    track(
        "mean NLL (512 tokens)",
        nll,
        ppl["mean_nll"].as_f64().unwrap(),
    );
    eprintln!(
        "{kind}: largest deviation from llama.cpp {worst:.2e} (tolerance {tol:.0e}); mean NLL {nll:.6}"
    );
}

#[test]
fn logits_f32_match_llama_cpp() {
    check("F32", 1e-5);
}

#[test]
fn logits_q8_0_match_llama_cpp() {
    check("Q8_0", 2e-6);
}

#[test]
fn logits_q4_1_match_llama_cpp() {
    check("Q4_1", 2e-6);
}
