//! Linear mode connectivity: the model whose every weight is `(1 − α)·A + α·B`, for evaluating
//! the loss along the straight line between two checkpoints of the same architecture
//! (`toy eval lmc`). Works on GGUF files, so any two checkpoints toy can load can be compared.
//! Both models are dequantized once; each α then only mixes.

use toy_core::gguf::{GgmlType, GgufFile, GgufWriter, Value, tensor_to_f32};

use crate::TrainError;

/// Two checkpoints of the same architecture, dequantized to f32, ready to be mixed.
pub struct Interpolation<'a> {
    a: &'a GgufFile,
    /// Per tensor of A, in A's order: A's and B's values.
    tensors: Vec<(Vec<f32>, Vec<f32>)>,
}

impl<'a> Interpolation<'a> {
    /// Dequantize `a` and `b`, which must hold the same tensors with the same shapes.
    pub fn new(a: &'a GgufFile, b: &GgufFile) -> Result<Self, TrainError> {
        if a.tensors.len() != b.tensors.len() {
            return Err(TrainError::Data(format!(
                "the models have {} and {} tensors: interpolation needs the same architecture",
                a.tensors.len(),
                b.tensors.len()
            )));
        }
        let tensors = a
            .tensors
            .iter()
            .map(|ta| {
                let tb = b.tensor(&ta.name).ok_or_else(|| {
                    TrainError::Data(format!("tensor {:?} is in the first model only", ta.name))
                })?;
                if tb.dims != ta.dims {
                    return Err(TrainError::Data(format!(
                        "tensor {:?} has shape {:?} in one model and {:?} in the other",
                        ta.name, ta.dims, tb.dims
                    )));
                }
                Ok((
                    tensor_to_f32(a, ta).map_err(gguf)?,
                    tensor_to_f32(b, tb).map_err(gguf)?,
                ))
            })
            .collect::<Result<_, TrainError>>()?;
        Ok(Interpolation { a, tensors })
    }

    /// `(1 − α)·A + α·B` for every tensor, as an in-memory F32 GGUF with A's metadata.
    pub fn at(&self, alpha: f32) -> Result<GgufFile, TrainError> {
        let mut writer = GgufWriter::from_file(self.a);
        if writer.get("general.file_type").is_some() {
            writer
                .set("general.file_type", Value::U32(0))
                .map_err(gguf)?;
        }
        for (info, (va, vb)) in self.a.tensors.iter().zip(&self.tensors) {
            // At α = 0 and α = 1 this is exactly A's and B's (dequantized) weights.
            let bytes: Vec<u8> = va
                .iter()
                .zip(vb)
                .flat_map(|(x, y)| ((1.0 - alpha) * x + alpha * y).to_le_bytes())
                .collect();
            writer
                .add_tensor(info.name.clone(), &info.dims, GgmlType::F32, bytes)
                .map_err(gguf)?;
        }
        let mut image = Vec::new();
        writer.write_to(&mut image).map_err(gguf)?;
        GgufFile::from_bytes(image).map_err(gguf)
    }
}

fn gguf(e: toy_core::gguf::GgufError) -> TrainError {
    TrainError::Data(e.to_string())
}
