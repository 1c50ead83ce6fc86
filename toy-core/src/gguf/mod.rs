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
    /// The file could not be opened, inspected or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// The first four bytes are not "GGUF"; they are kept for the message.
    #[error("not a GGUF file: the first bytes are {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    /// A byte-swapped version number: the file was written big-endian.
    #[error(
        "big-endian GGUF files are not supported; convert the model on a little-endian machine"
    )]
    BigEndian,
    /// A GGUF version other than 2 or 3.
    #[error("GGUF version {0} is not supported (toy reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    /// The file ends before something it declares: `what` needs the file to be `need` bytes
    /// long, but it is `have`.
    #[error(
        "truncated GGUF file: {what} needs {need} bytes but the file has {have}; the download or copy is incomplete"
    )]
    Truncated {
        /// What needs the bytes (a tensor, the metadata, ...).
        what: String,
        /// The file length it needs, in bytes.
        need: u64,
        /// The file's length, in bytes.
        have: u64,
    },
    /// A count or length larger than the rest of the file could hold, caught before allocating.
    #[error(
        "corrupt or truncated GGUF file: {what} is {count}, more than the {remaining} bytes left in the file could hold"
    )]
    TooLarge {
        /// The count or length that is too large.
        what: String,
        /// Its value.
        count: u64,
        /// Bytes left in the file after it.
        remaining: u64,
    },
    /// A string, named here, that is not valid UTF-8.
    #[error("corrupt GGUF file: {0} is not valid UTF-8")]
    InvalidUtf8(String),
    /// The value of metadata key `key` has a type tag, `tag`, that GGUF does not define.
    #[error("corrupt GGUF file: metadata key {key:?} has unknown value type {tag}")]
    UnknownValueType {
        /// The metadata key.
        key: String,
        /// The undefined value type tag.
        tag: u32,
    },
    /// A metadata key that occurs twice in the file.
    #[error("corrupt GGUF file: metadata key {0:?} appears twice")]
    DuplicateKey(String),
    /// Tensor `name` has a ggml type id, `type_id`, that toy does not know.
    #[error(
        "tensor {name:?} has ggml type id {type_id}, which toy does not support (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q8_K, IQ4_NL, IQ4_XS, integer types)"
    )]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// Its ggml type id.
        type_id: u32,
    },
    /// Tensor `name` is unusable (its name, shape, type or data); `reason` says why.
    #[error("bad tensor {name:?}: {reason}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other inconsistency in the file; the message says what.
    #[error("corrupt GGUF file: {0}")]
    Invalid(String),
    /// A required metadata key, named here, that is absent.
    #[error("GGUF metadata key {0:?} is missing")]
    MissingKey(String),
    /// A metadata value of another type than the key needs.
    #[error("GGUF metadata key {key:?} should be {expected} but is {found}")]
    WrongType {
        /// The metadata key.
        key: String,
        /// What the key should hold, as an article and a noun ("a string").
        expected: &'static str,
        /// The value type found.
        found: String,
    },
    /// Something valid GGUF that toy cannot handle, such as a type it cannot (de)quantize.
    #[error("{0}")]
    Unsupported(String),
    /// Writing a file failed.
    #[error("cannot write {target}: {source}")]
    Write {
        /// What was being written: the path, or "the GGUF output" for a writer.
        target: String,
        /// The underlying I/O error.
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

/// This module's result type, failing with `GgufError` by default.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
