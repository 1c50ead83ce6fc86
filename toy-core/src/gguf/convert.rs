//! Rewriting a model's tensors in another type: what `toy convert` does, and what `toy merge`
//! does after folding an adapter into the weights.

use super::{
    GgmlType, GgufError, GgufFile, GgufWriter, TensorInfo, Value, quantize, tensor_to_f32,
};

/// llama.cpp's `general.file_type` (`enum llama_ftype`) of a file whose matrices are `ty`.
pub fn file_type(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::F32 => Some(0),
        GgmlType::F16 => Some(1),
        GgmlType::Q4_0 => Some(2),
        GgmlType::Q8_0 => Some(7),
        GgmlType::BF16 => Some(32),
        _ => None,
    }
}

/// `file` with its metadata and every tensor re-stored: each tensor is read as f32, passed to
/// `edit` (which may change the values), then stored as `ty` if it is a matrix whose rows are
/// whole `ty` blocks, and as F32 otherwise (norms and biases stay F32, as `llama-quantize
/// --pure` leaves them). `general.file_type` follows `ty` when the file sets it.
pub fn convert<E: From<GgufError>>(
    file: &GgufFile,
    ty: GgmlType,
    mut edit: impl FnMut(&TensorInfo, &mut [f32]) -> Result<(), E>,
) -> Result<GgufWriter<'static>, E> {
    let mut writer = GgufWriter::from_file(file);
    if let (Some(_), Some(code)) = (file.get("general.file_type"), file_type(ty)) {
        writer.set("general.file_type", Value::U32(code))?;
    }
    for info in &file.tensors {
        let mut values = tensor_to_f32(file, info)?;
        edit(info, &mut values)?;
        let matrix = info.dims.len() == 2 && info.dims[0] % ty.block_size() as u64 == 0;
        let stored = if matrix { ty } else { GgmlType::F32 };
        writer.add_tensor(
            &info.name,
            &info.dims,
            stored,
            quantize(stored, &values).map_err(GgufError::from)?,
        )?;
    }
    Ok(writer)
}
