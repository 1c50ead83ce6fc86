//! Tensors of safetensors files (timm checkpoints, PEFT adapters) read on the host.

use burn::tensor::{bf16, f16};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// The values of `view` widened to f32, for the float types checkpoints are saved in (F32,
/// F16, BF16); any other type comes back as the error.
pub fn safetensors_f32(view: &TensorView<'_>) -> Result<Vec<f32>, Dtype> {
    let data = view.data();
    let words = |n: usize| data.chunks_exact(n);
    Ok(match view.dtype() {
        Dtype::F32 => words(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => words(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => words(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(other),
    })
}
