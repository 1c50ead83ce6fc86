//! toy-core: formats and host-side logic, no model math.
//!
//! GGUF read/write/dequantize/quantize ([`gguf`]), the tokenizer built from GGUF metadata
//! ([`tokenizer`]), chat templates ([`chat`]), the model configuration read from metadata
//! ([`config`]), RoPE angles ([`rope`]), sampling ([`sampling`]) and files written whole or not
//! at all ([`atomic`]).

#![warn(missing_docs)]

pub mod atomic;
pub mod chat;
pub mod clock;
pub mod config;
pub mod gguf;
pub mod rng;
pub mod rope;
pub mod sampling;
pub mod tokenizer;
