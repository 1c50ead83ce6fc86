//! The sequences of `batching.rs` run alone and together through the generation core, generic
//! over the backend (`wgpu.rs` runs them on the cubecl kernels).

use burn::tensor::{Int, Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::{Batch, CausalLm, KvCache, SeqId};

pub const PROMPTS: usize = 16;
pub const STEPS: usize = 10;
/// Prompt tokens a sequence puts in one pass (the rest waits for the next pass), standing in
/// for `toy_models::PROMPT_CHUNK` so that the fixtures' short prompts are split.
pub const CHUNK: usize = 5;

pub use toy_core::sampling::argmax;

/// Prompt `i`: 1 to 23 ids below `vocab`, from a fixed generator.
pub fn prompt(i: usize, vocab: usize) -> Vec<u32> {
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
pub fn alone<B: ToyBackend>(model: &impl CausalLm<B>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let run = |ids: &[u32], cache: &mut KvCache<B>| {
        let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let n = ids.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &model.device());
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

/// The same sequences run together by the generation core (`toy serve`'s and `toy infer`'s
/// [`Batch`]): sequence `i` joins at pass `i / 2`, reads its prompt in pieces of at most
/// [`CHUNK`], then decodes greedily; every pass carries everyone's new tokens.
pub fn together<B: ToyBackend>(
    model: &impl CausalLm<B>,
    prompts: &[Vec<u32>],
) -> Vec<Vec<Vec<f32>>> {
    let mut batch = Batch::new(usize::MAX).with_prompt_piece(CHUNK);
    let mut ids: Vec<Option<SeqId>> = vec![None; prompts.len()];
    let mut rows: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut pass = 0;
    while rows.iter().any(|r| r.len() < STEPS) {
        for (i, p) in prompts.iter().enumerate() {
            if i / 2 == pass {
                let id = batch.add(model.new_cache());
                batch.push(id, p);
                ids[i] = Some(id);
            }
        }
        let ran = batch.step(model).unwrap();
        assert_eq!(
            ran.len(),
            batch.len(),
            "every sequence with tokens queued runs in each pass"
        );
        for r in ran {
            let i = ids.iter().position(|&id| id == Some(r.id)).unwrap();
            if let Some(logits) = r.logits {
                let next = argmax(&logits);
                rows[i].push(logits);
                if rows[i].len() < STEPS {
                    batch.push(r.id, &[next]);
                } else {
                    batch.remove(r.id);
                }
            }
        }
        pass += 1;
    }
    rows
}

pub fn prompts(file: &toy_core::gguf::GgufFile) -> Vec<Vec<u32>> {
    let vocab = toy_core::config::ModelConfig::from_gguf(file)
        .unwrap()
        .vocab_size;
    (0..PROMPTS).map(|i| prompt(i, vocab)).collect()
}

/// Top-1 minus top-2 logit.
pub fn margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}
