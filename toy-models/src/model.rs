//! Any model toy loads: the llama family ([`Transformer`]) or GPT-2 ([`Gpt2`]), behind one
//! interface ([`CausalLm`]) for generation and evaluation.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use toy_core::config::{ModelConfig, NormKind};
use toy_core::gguf::GgufFile;
use toy_kernels::ToyBackend;

use crate::cache::{self, KvCache};
use crate::gpt2::{Gpt2, load_gpt2};
use crate::llama::Transformer;
use crate::load::{LoadError, load};
use crate::lora::{Adaptable, LoraBlock};

/// A causal language model with a KV cache.
pub trait CausalLm<B: ToyBackend> {
    /// Final hidden states `[batch, t, d_model]` (after the output norm) of `tokens[batch, t]`
    /// after the cached tokens; appends them (embeddings, and prefill chunks whose logits are
    /// not needed).
    fn forward_hidden(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3>;
    /// Logits `[batch, t, vocab]` of `tokens[batch, t]` after the cached tokens; appends them.
    fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3>;
    /// Logits `[batch, vocab]` of the last new position only.
    fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2>;
    /// Continuous batching: logits `[n, vocab]` of the last new token of each of `n` sequences,
    /// `tokens[i]` (at least one) run after what `caches[i]` holds, all in one forward pass
    /// (prompt chunks and decode steps alike). Each sequence's logits are those it would get alone
    /// wherever the backend computes a matmul's rows independently of their number (the CPU
    /// kernels for quantized weights do).
    fn forward_batch_last(&self, tokens: &[&[u32]], caches: Vec<&mut KvCache<B>>) -> Tensor<B, 2>;
    /// An empty KV cache for one sequence of this model.
    fn new_cache(&self) -> KvCache<B>;
    /// Mean next-token cross-entropy of `tokens[b, t]` (from an empty cache) against
    /// `targets[b, t]`: what training minimizes, without the `[b·t, vocab]` logits where the
    /// backend can ([`crate::QLinear::cross_entropy`]).
    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1>;
    /// Longest context (prompt + generated tokens) the model supports.
    fn context_length(&self) -> usize;
    /// The device the model's weights are on.
    fn device(&self) -> B::Device;

    /// A sentence embedding of `ids`: the final hidden states (from an empty cache) averaged
    /// over the tokens and scaled to unit length — what `toy serve`'s `/v1/embeddings` returns.
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, EmbedError> {
        if ids.is_empty() {
            return Err(EmbedError::Empty);
        }
        let tokens = cache::batch_tokens(&[ids], &self.device());
        let h = self.forward_hidden(tokens, &mut self.new_cache());
        let [_, t, d] = h.dims();
        let mean = h.sum_dim(1).reshape([d]) / t as f32;
        let mut v = mean
            .into_data()
            .convert::<f32>() // f16 activations (`--dtype f16`)
            .into_vec::<f32>()
            .map_err(|e| EmbedError::Backend(format!("{e:?}")))?;
        let norm = v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        if norm > 0.0 {
            v.iter_mut()
                .for_each(|x| *x = (f64::from(*x) / norm) as f32);
        }
        Ok(v)
    }
}

/// Why [`CausalLm::embed`] gave no vector.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// No tokens were given.
    #[error("nothing to embed: give at least one token")]
    Empty,
    /// Reading the hidden states back from the backend failed; its message.
    #[error("backend error: {0}")]
    Backend(String),
}

impl<B: ToyBackend> CausalLm<B> for Transformer<B> {
    fn forward_hidden(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        Transformer::forward_hidden(self, tokens, cache)
    }
    fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        Transformer::forward(self, tokens, cache)
    }
    fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        Transformer::forward_last(self, tokens, cache)
    }
    fn forward_batch_last(&self, tokens: &[&[u32]], caches: Vec<&mut KvCache<B>>) -> Tensor<B, 2> {
        let lens: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let mut segments = cache::segments(caches, &lens);
        let ids = cache::batch_tokens(tokens, &self.device());
        // Each sequence's rows computed as they would be alone (`ToyBackend::with_row_groups`).
        let h = B::with_row_groups(&lens, || self.forward_segments(ids, &mut segments));
        let last = cache::last_rows(h, &segments);
        B::with_row_groups(&vec![1; lens.len()], || self.logits(last))
    }
    fn new_cache(&self) -> KvCache<B> {
        Transformer::new_cache(self)
    }
    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        Transformer::loss(self, tokens, targets)
    }
    fn context_length(&self) -> usize {
        self.context_length
    }
    fn device(&self) -> B::Device {
        Transformer::device(self)
    }
}

impl<B: ToyBackend> CausalLm<B> for Gpt2<B> {
    fn forward_hidden(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        Gpt2::forward_hidden(self, tokens, cache)
    }
    fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        Gpt2::forward(self, tokens, cache)
    }
    fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        Gpt2::forward_last(self, tokens, cache)
    }
    fn forward_batch_last(&self, tokens: &[&[u32]], caches: Vec<&mut KvCache<B>>) -> Tensor<B, 2> {
        let lens: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let mut segments = cache::segments(caches, &lens);
        let ids = cache::batch_tokens(tokens, &self.device());
        let h = B::with_row_groups(&lens, || self.forward_segments(ids, &mut segments));
        let last = cache::last_rows(h, &segments);
        B::with_row_groups(&vec![1; lens.len()], || self.output.forward(last))
    }
    fn new_cache(&self) -> KvCache<B> {
        Gpt2::new_cache(self)
    }
    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        Gpt2::loss(self, tokens, targets)
    }
    fn context_length(&self) -> usize {
        self.context_length
    }
    fn device(&self) -> B::Device {
        Gpt2::device(self)
    }
}

/// A loaded model of any supported architecture.
#[derive(Module, Debug)]
pub enum Model<B: Backend> {
    /// A llama-family model.
    Llama(Transformer<B>),
    /// A GPT-2 model.
    Gpt2(Gpt2<B>),
}

impl<B: ToyBackend> CausalLm<B> for Model<B> {
    fn forward_hidden(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        match self {
            Model::Llama(m) => m.forward_hidden(tokens, cache),
            Model::Gpt2(m) => m.forward_hidden(tokens, cache),
        }
    }
    fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        match self {
            Model::Llama(m) => m.forward(tokens, cache),
            Model::Gpt2(m) => m.forward(tokens, cache),
        }
    }
    fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        match self {
            Model::Llama(m) => m.forward_last(tokens, cache),
            Model::Gpt2(m) => m.forward_last(tokens, cache),
        }
    }
    fn forward_batch_last(&self, tokens: &[&[u32]], caches: Vec<&mut KvCache<B>>) -> Tensor<B, 2> {
        match self {
            Model::Llama(m) => m.forward_batch_last(tokens, caches),
            Model::Gpt2(m) => m.forward_batch_last(tokens, caches),
        }
    }
    fn new_cache(&self) -> KvCache<B> {
        match self {
            Model::Llama(m) => m.new_cache(),
            Model::Gpt2(m) => m.new_cache(),
        }
    }
    fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        match self {
            Model::Llama(m) => m.loss(tokens, targets),
            Model::Gpt2(m) => m.loss(tokens, targets),
        }
    }
    fn context_length(&self) -> usize {
        match self {
            Model::Llama(m) => m.context_length,
            Model::Gpt2(m) => m.context_length,
        }
    }
    fn device(&self) -> B::Device {
        match self {
            Model::Llama(m) => m.device(),
            Model::Gpt2(m) => m.device(),
        }
    }
}

/// Load the model in `file`, whatever its architecture, onto `device`.
pub fn load_model<B: ToyBackend>(
    file: &GgufFile,
    device: &B::Device,
    mut progress: impl FnMut(usize, usize),
) -> Result<(ModelConfig, Model<B>), LoadError> {
    let config = ModelConfig::from_gguf(file)?;
    if config.norm == NormKind::Layer {
        let model = load_gpt2(file, &config, device, progress)?;
        file.release_pages();
        return Ok((config, Model::Gpt2(model)));
    }
    let (config, model) = load(file, device, &mut progress)?;
    Ok((config, Model::Llama(model)))
}

impl<B: Backend> Adaptable<B> for Model<B> {
    fn lora_blocks(&self) -> Vec<&dyn LoraBlock<B>> {
        match self {
            Model::Llama(m) => m.lora_blocks(),
            Model::Gpt2(m) => m.lora_blocks(),
        }
    }
    fn lora_blocks_mut(&mut self) -> Vec<&mut dyn LoraBlock<B>> {
        match self {
            Model::Llama(m) => m.lora_blocks_mut(),
            Model::Gpt2(m) => m.lora_blocks_mut(),
        }
    }
    fn lora_device(&self) -> B::Device {
        match self {
            Model::Llama(m) => m.lora_device(),
            Model::Gpt2(m) => m.lora_device(),
        }
    }
}
