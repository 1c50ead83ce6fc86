//! toy-quant: ggml's tensor block formats on the host.
//!
//! - [`GgmlType`]: the ids, block sizes and byte sizes of ggml's tensor types;
//! - [`dequantize`]: every common GGUF block type to f32, operation for operation as ggml's
//!   `dequantize_row_*` (bit-identical to ggml and to gguf-py);
//! - [`quantize`]: f32 to F16, BF16, Q8_0 and Q4_0 with ggml's reference algorithms.
//!
//! It depends on nothing but `half`, so that both the GGUF reader (`toy-core`) and the kernels
//! (`toy-kernels`, whose reference bodies dequantize packed weights) can share one definition
//! of each format.

#![warn(missing_docs)]

mod dequant;
mod quantize;
mod types;

pub use dequant::{DEQUANT_TYPES, IQ4_GRID, dequantize, dequantize_to_vec, unsupported_reason};
pub use quantize::{QUANT_TYPES, f32_to_bf16, quantize, quantize_q4_0, quantize_q8_0};
pub use types::GgmlType;

/// What can be wrong with a request to (de)quantize.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The type cannot be (de)quantized by this crate; the message names the ones that can.
    #[error("{0}")]
    Unsupported(String),
    /// A buffer of the wrong length, a partial block: a bug in the caller, not a bad file.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// This crate's result type, failing with `QuantError` by default.
pub type Result<T, E = QuantError> = std::result::Result<T, E>;
