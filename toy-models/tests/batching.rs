//! Continuous batching must not change a sequence's numbers: sixteen prompts of different
//! lengths, started at different steps and decoded together in one forward pass per step
//! (prompt chunks beside decode tokens, as `toy serve` runs them), give every sequence the
//! logits — to the bit — and so the greedy ids it gets alone. Quantized fixtures of each
//! family kind on the CPU — K-quants too, whose llama.cpp kernels differ by row count (the
//! batched pass declares each sequence's rows: `ToyBackend::with_row_groups`).

mod common;

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use toy_models::{CausalLm, KvCache};

use common::load;

const PROMPTS: usize = 16;
const STEPS: usize = 10;
/// Prompt tokens a sequence puts in one pass (the rest waits for the next pass), standing in
/// for `toy_models::PROMPT_CHUNK` so that the fixtures' short prompts are split.
const CHUNK: usize = 5;

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Prompt `i`: 1 to 23 ids below `vocab`, from a fixed generator.
fn prompt(i: usize, vocab: usize) -> Vec<u32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 * 0x2545_f491_4f6c_dd1d);
    let len = 1 + (i * 7) % 23;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

/// Logits of each step of greedy decoding `prompt` alone, as `toy infer` runs it: the prompt
/// in pieces of at most [`CHUNK`] (`toy_models::PROMPT_CHUNK` there), then one token per pass.
fn alone(model: &impl CausalLm<Flex>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let run = |ids: &[u32], cache: &mut KvCache<Flex>| {
        let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let n = ids.len();
        let tokens =
            Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids, [1, n]), &model.device());
        let logits = model.forward_last(tokens, cache);
        logits.into_data().into_vec::<f32>().unwrap()
    };
    let mut row = Vec::new();
    for chunk in prompt.chunks(CHUNK) {
        row = run(chunk, &mut cache);
    }
    let mut rows = vec![row];
    while rows.len() < STEPS {
        let next = argmax(rows.last().unwrap());
        rows.push(run(&[next], &mut cache));
    }
    rows
}

struct Sequence {
    prompt: Vec<u32>,
    /// Prompt tokens in the cache.
    read: usize,
    cache: KvCache<Flex>,
    next: Option<u32>,
    rows: Vec<Vec<f32>>,
}

/// The same sequences run together: sequence `i` joins at pass `i / 2`, reads its prompt in
/// chunks of at most [`CHUNK`], then decodes; every pass carries everyone's new tokens.
fn together(model: &impl CausalLm<Flex>, prompts: &[Vec<u32>]) -> Vec<Vec<Vec<f32>>> {
    let mut seqs: Vec<Sequence> = prompts
        .iter()
        .map(|p| Sequence {
            prompt: p.clone(),
            read: 0,
            cache: model.new_cache(),
            next: None,
            rows: Vec::new(),
        })
        .collect();
    let mut pass = 0;
    while seqs.iter().any(|s| s.rows.len() < STEPS) {
        let mut tokens = Vec::new();
        let mut members = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            if i / 2 > pass || s.rows.len() == STEPS {
                continue;
            }
            let new = match s.next {
                Some(id) => vec![id],
                None => {
                    let end = (s.read + CHUNK).min(s.prompt.len());
                    let chunk = s.prompt[s.read..end].to_vec();
                    s.read = end;
                    chunk
                }
            };
            tokens.push(new);
            members.push(i);
        }
        let slices: Vec<&[u32]> = tokens.iter().map(|t| t.as_slice()).collect();
        let caches: Vec<&mut KvCache<Flex>> = seqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| members.contains(i))
            .map(|(_, s)| &mut s.cache)
            .collect();
        let logits = model.forward_batch_last(&slices, caches);
        let [n, vocab] = logits.dims();
        assert_eq!(n, members.len());
        let logits = logits.into_data().into_vec::<f32>().unwrap();
        for (&i, row) in members.iter().zip(logits.chunks(vocab)) {
            let s = &mut seqs[i];
            if s.next.is_some() || s.read == s.prompt.len() {
                s.next = Some(argmax(row));
                s.rows.push(row.to_vec());
            }
        }
        pass += 1;
    }
    seqs.into_iter().map(|s| s.rows).collect()
}

fn check(name: &str) {
    let device = Default::default();
    let (file, _, model) = load::<Flex>(name, &device);
    let vocab = toy_core::config::ModelConfig::from_gguf(&file)
        .unwrap()
        .vocab_size;
    let prompts: Vec<Vec<u32>> = (0..PROMPTS).map(|i| prompt(i, vocab)).collect();
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
