//! Text generation of one sequence (`toy infer`): the prompt, then one-token decode steps, run by
//! the generation core ([`crate::batch::Batch`]). Logits come to the host and the sampler picks
//! the next id there.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use toy_core::sampling::Sampler;
use toy_kernels::ToyBackend;

use crate::batch::Batch;
use crate::cache::PROMPT_CHUNK;
use crate::model::CausalLm;

/// Why `generate` failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// No prompt tokens were given.
    #[error("the prompt is empty: give at least one token")]
    EmptyPrompt,
    /// The prompt and the new tokens asked for do not fit the model's context.
    #[error(
        "prompt of {prompt} tokens plus {max_new} new tokens exceeds the context of {context}; shorten the prompt or lower -n"
    )]
    ContextOverflow {
        /// Tokens in the prompt.
        prompt: usize,
        /// New tokens asked for.
        max_new: usize,
        /// The model's context length.
        context: usize,
    },
    /// A step of the generation core failed; its message.
    #[error("backend error: {0}")]
    Backend(String),
}

/// What a generation did and how fast.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (the end-of-generation token not counted).
    pub generated_tokens: usize,
    /// Time to run the prompt (prefill), up to its first logits.
    pub prompt_time: Duration,
    /// Time spent sampling and decoding after the prefill.
    pub generation_time: Duration,
    /// Why it stopped: "eog", "length" or "stop".
    pub finish_reason: &'static str,
}

impl GenerationStats {
    /// Prefill speed: prompt tokens per second.
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Decode speed over the steps after the first token (the first comes from the prefill).
    pub fn gen_tokens_per_s(&self) -> f64 {
        let steps = self.generated_tokens.saturating_sub(1);
        if steps == 0 {
            0.0
        } else {
            steps as f64 / self.generation_time.as_secs_f64().max(1e-9)
        }
    }
}

/// Options of one generation.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Most new tokens.
    pub max_new_tokens: usize,
    /// Stop at an end-of-generation token (it is not emitted).
    pub stop_at_eog: bool,
}

/// Generate from `prompt`. `on_token(id)` receives each new id as it is sampled and may stop the
/// generation by returning `ControlFlow::Break(())` (used for stop strings).
pub fn generate<B: ToyBackend>(
    model: &impl CausalLm<B>,
    prompt: &[u32],
    options: &GenerateOptions,
    sampler: &mut Sampler,
    is_eog: impl Fn(u32) -> bool,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<(Vec<u32>, GenerationStats), GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if prompt.len() + options.max_new_tokens > model.context_length() {
        return Err(GenerateError::ContextOverflow {
            prompt: prompt.len(),
            max_new: options.max_new_tokens,
            context: model.context_length(),
        });
    }
    let mut cache = model.new_cache();
    cache.reserve(prompt.len() + options.max_new_tokens);
    // One sequence through the generation core that `toy serve` batches many through: the
    // same prompt pieces and steps, so the same numbers.
    let mut batch = Batch::new(PROMPT_CHUNK);
    let seq = batch.add(cache);
    let mut run = |tokens: &[u32]| {
        batch.push(seq, tokens);
        batch
            .run_until_logits(model, seq)
            .map_err(|e| GenerateError::Backend(e.message))
    };
    // The prompt followed by what has been generated (the sampler's penalties read it all).
    let mut history: Vec<u32> = Vec::with_capacity(prompt.len() + options.max_new_tokens);
    history.extend_from_slice(prompt);
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        finish_reason: "length",
        ..Default::default()
    };

    let start = Instant::now();
    let mut logits = run(prompt)?;
    stats.prompt_time = start.elapsed();
    let decode_start = Instant::now();
    for step in 0..options.max_new_tokens {
        let id = sampler.sample(&logits, &history);
        if options.stop_at_eog && is_eog(id) {
            stats.finish_reason = "eog";
            break;
        }
        history.push(id);
        if on_token(id).is_break() {
            stats.finish_reason = "stop";
            break;
        }
        if step + 1 < options.max_new_tokens {
            logits = run(&[id])?;
        }
    }
    stats.generation_time = decode_start.elapsed();
    let generated = history.split_off(prompt.len());
    stats.generated_tokens = generated.len();
    Ok((generated, stats))
}
