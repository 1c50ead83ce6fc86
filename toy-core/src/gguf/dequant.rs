//! The values of a GGUF tensor as f32 (the block formats themselves are `toy-quant`'s).

use toy_quant::{DEQUANT_TYPES, dequantize_to_vec, unsupported_reason};

use super::write::tensor_bytes;
use super::{GgufError, GgufFile, Result, TensorInfo};

/// The values of a tensor of `file` as f32, in ggml order (`dims[0]` fastest).
pub fn tensor_to_f32(file: &GgufFile, info: &TensorInfo) -> Result<Vec<f32>> {
    if !DEQUANT_TYPES.contains(&info.ggml_type) {
        return Err(GgufError::Unsupported(format!(
            "tensor {:?} is {}: {}",
            info.name,
            info.ggml_type,
            unsupported_reason(info.ggml_type)
        )));
    }
    Ok(dequantize_to_vec(
        info.ggml_type,
        tensor_bytes(file, info)?,
    )?)
}
