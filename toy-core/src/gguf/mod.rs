//! GGUF: the file format of llama.cpp. Reader (mmap, validated), writer (v3), dequantization of
//! every common block type to f32, and quantization to Q8_0 / Q4_0 with ggml's reference
//! algorithms.

mod convert;
mod dequant;
mod read;
mod types;
mod write;

use std::path::PathBuf;

pub use convert::{convert, file_type};
pub use dequant::tensor_to_f32;
pub use read::{DEFAULT_ALIGNMENT, GgufFile, MAGIC, MAX_DIMS, MAX_NAME_LEN, TensorInfo};
pub use toy_quant::{
    DEQUANT_TYPES, GgmlType, QUANT_TYPES, QuantError, dequantize, dequantize_to_vec, quantize,
    quantize_q4_0, quantize_q8_0,
};
pub use types::{Value, ValueType};
pub use write::{GgufWriter, WRITE_VERSION};

/// Everything that can be wrong with a GGUF file. Messages name the problem and, where it helps,
/// what to do.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file: the first bytes are {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error(
        "big-endian GGUF files are not supported; convert the model on a little-endian machine"
    )]
    BigEndian,
    #[error("GGUF version {0} is not supported (toy reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error(
        "truncated GGUF file: {what} needs {need} bytes but the file has {have}; the download or copy is incomplete"
    )]
    Truncated { what: String, need: u64, have: u64 },
    #[error(
        "corrupt or truncated GGUF file: {what} is {count}, more than the {remaining} bytes left in the file could hold"
    )]
    TooLarge {
        what: String,
        count: u64,
        remaining: u64,
    },
    #[error("corrupt GGUF file: {0} is not valid UTF-8")]
    InvalidUtf8(String),
    #[error("corrupt GGUF file: metadata key {key:?} has unknown value type {tag}")]
    UnknownValueType { key: String, tag: u32 },
    #[error("corrupt GGUF file: metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error(
        "tensor {name:?} has ggml type id {type_id}, which toy does not support (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q8_K, IQ4_NL, IQ4_XS, integer types)"
    )]
    UnsupportedTensorType { name: String, type_id: u32 },
    #[error("bad tensor {name:?}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("corrupt GGUF file: {0}")]
    Invalid(String),
    #[error("GGUF metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("GGUF metadata key {key:?} should be {expected} but is {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("cannot write {target}: {source}")]
    Write {
        target: String,
        source: std::io::Error,
    },
    /// A caller passed something the GGUF API cannot use (a buffer of the wrong length, a
    /// metadata value GGUF cannot store, …): a bug in the caller, not a bad file.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl From<QuantError> for GgufError {
    fn from(e: QuantError) -> Self {
        match e {
            QuantError::Unsupported(m) => GgufError::Unsupported(m),
            QuantError::InvalidArgument(m) => GgufError::InvalidArgument(m),
        }
    }
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;
