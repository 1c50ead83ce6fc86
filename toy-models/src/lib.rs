//! toy-models: burn modules generic over `B: ToyBackend`.
//!
//! [`llama::Transformer`] is the llama-family model, a normal burn `Module<B>`, and
//! [`gpt2::Gpt2`] GPT-2; [`load::load`] builds the former from a GGUF file,
//! [`model::load_model`] either (as a [`model::Model`]), and [`save::save`] writes a llama;
//! [`batch::Batch`] is the generation core (sequences stepped together, continuous batching)
//! that [`generate::generate`] and `toy serve` drive.
//!
//! # Quick start
//!
//! A model with random weights on burn's CPU backend, one forward pass, then greedy
//! generation. `toy_models::load_model::<Flex>(&GgufFile::open(path)?, ...)` loads any GGUF toy
//! runs instead; `toy-models/examples/` has whole programs (text from a GGUF, a training loop,
//! LoRA, embeddings).
//!
//! ```
//! use std::ops::ControlFlow;
//!
//! use burn::backend::Flex;
//! use burn::tensor::{Int, Tensor, TensorData};
//! use toy_core::sampling::{Sampler, SamplingParams};
//! use toy_models::LlamaConfig;
//! use toy_models::generate::{GenerateOptions, generate};
//!
//! let device = Default::default();
//! // n_layer, d_model, n_head, n_head_kv, head_dim, d_ff, vocab, context.
//! let model = LlamaConfig::new(2, 32, 4, 2, 8, 64, 100, 32).init::<Flex>(&device);
//!
//! // Logits `[batch, tokens, vocab]` for a prompt of three token ids.
//! let tokens = Tensor::<Flex, 2, Int>::from_data(TensorData::new(vec![1i64, 2, 3], [1, 3]), &device);
//! let logits = model.forward(tokens, &mut model.new_cache());
//! assert_eq!(logits.dims(), [1, 3, 100]);
//!
//! // Ten greedy tokens after the prompt, through the generation core `toy infer` uses.
//! let options = GenerateOptions { max_new_tokens: 10, stop_at_eog: false };
//! let mut sampler = Sampler::new(SamplingParams::greedy());
//! let (ids, _stats) = generate(&model, &[1, 2, 3], &options, &mut sampler, |_| false, |_| {
//!     ControlFlow::Continue(())
//! })?;
//! assert_eq!(ids.len(), 10);
//! # Ok::<(), toy_models::generate::GenerateError>(())
//! ```

#![warn(missing_docs)]

pub mod batch;
pub mod cache;
pub mod embedding;
pub mod generate;
pub mod gpt2;
pub mod host_tensors;
pub mod llama;
pub mod load;
pub mod lora;
pub mod model;
pub mod qlinear;
pub mod save;
pub mod vit;

pub use batch::{Batch, Ran, SeqId, StepError};
pub use cache::{KvCache, PROMPT_CHUNK, Segment};
pub use embedding::TokenEmbedding;
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::{LlamaConfig, Transformer};
pub use load::{LoadError, load};
pub use model::{CausalLm, EmbedError, Model, load_model};
pub use qlinear::{PackedMatrix, QLinear};
pub use save::{SaveError, save, save_gpt2, save_like_base};
pub use vit::{Vit, VitConfig};
