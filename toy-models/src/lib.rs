//! toy-models: burn modules generic over `B: ToyBackend`.
//!
//! [`llama::Transformer`] is the llama-family model, a normal burn `Module<B>`;
//! [`load::load`] builds it from a GGUF file and [`save::save`] writes it as one;
//! [`generate::Generator`] runs prefill and decode steps with a KV cache and samples on the host.

pub mod generate;
pub mod llama;
pub mod load;
pub mod qlinear;
pub mod save;

pub use llama::{KvCache, LlamaConfig, Transformer};
pub use load::{LoadError, load};
pub use qlinear::QLinear;
pub use save::{SaveError, save};
