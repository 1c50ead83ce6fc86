//! toy-models: burn modules generic over `B: ToyBackend`.
//!
//! [`llama::Transformer`] is the llama-family model, a normal burn `Module<B>`, and
//! [`gpt2::Gpt2`] GPT-2; [`load::load`] builds the former from a GGUF file,
//! [`model::load_model`] either (as a [`model::Model`]), and [`save::save`] writes a llama;
//! [`batch::Batch`] is the generation core (sequences stepped together, continuous batching)
//! that [`generate::generate`] and `toy serve` drive.

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
