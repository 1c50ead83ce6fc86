//! Quantization of f32 values to GGUF tensor data, with ggml's reference algorithms
//! (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, `GGML_FP32_TO_FP16`,
//! `ggml_compute_fp32_to_bf16`). The output is byte-identical to llama.cpp's reference
//! quantizer and to gguf-py's `gguf.quants.quantize` (the tests check it) for finite inputs.

use half::f16;

use crate::types::GgmlType;
use crate::{QuantError, Result};

/// The types [`quantize`] produces.
pub const QUANT_TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
];

/// Quantize `values` to `ty`. Block types need a whole number of blocks (32 values for Q8_0 and
/// Q4_0); quantize a tensor row by row or as one slice, the bytes are the same.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    match ty {
        GgmlType::F32 => Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        // Round to nearest, ties to even; NaN stays NaN (quiet), overflow becomes infinity.
        GgmlType::F16 => Ok(values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect()),
        GgmlType::BF16 => Ok(values
            .iter()
            .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
            .collect()),
        GgmlType::Q8_0 => quantize_q8_0(values),
        GgmlType::Q4_0 => quantize_q4_0(values),
        _ => {
            let names: Vec<&str> = QUANT_TYPES.iter().map(|t| t.name()).collect();
            Err(QuantError::Unsupported(format!(
                "quantizing to {ty} is not supported (toy quantizes to {})",
                names.join(", ")
            )))
        }
    }
}

/// Q8_0: blocks of 32 values as `d = amax / 127` (stored as f16) and `round(x / d)` in i8.
pub fn quantize_q8_0(values: &[f32]) -> Result<Vec<u8>> {
    let blocks = whole_blocks(GgmlType::Q8_0, values)?;
    let mut out = Vec::with_capacity(blocks.len() * GgmlType::Q8_0.type_size());
    for x in blocks {
        // ggml: amax = MAX(amax, fabsf(v)), MAX(a, b) being `a > b ? a : b`.
        let amax = x.iter().fold(
            0.0f32,
            |amax, v| if amax > v.abs() { amax } else { v.abs() },
        );
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        // `round` rounds half away from zero, like C's roundf; the value is within ±127.
        out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
    }
    Ok(out)
}

/// Q4_0: blocks of 32 values as `d = max / -8` (max: the value of largest magnitude, the first
/// one on ties; stored as f16) and 4-bit `x / d + 8`, clipped to 15. Value j of a block goes in
/// the low nibble of byte j, value j + 16 in its high nibble.
///
/// For an all-zero block ggml's `max` keeps its initial +0.0, so d is -0.0 even when the block's
/// first value is -0.0 (where gguf-py, picking that value, writes +0.0). This follows ggml.
pub fn quantize_q4_0(values: &[f32]) -> Result<Vec<u8>> {
    let blocks = whole_blocks(GgmlType::Q4_0, values)?;
    let mut out = Vec::with_capacity(blocks.len() * GgmlType::Q4_0.type_size());
    for x in blocks {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        // x * id lies in [-8, 8], so x * id + 8.5 is in [0.5, 16.5]: truncating (C's
        // `(int8_t)` cast) gives 0..=16, and 16 is clipped to 15.
        let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
        out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
    }
    Ok(out)
}

/// ggml's `ggml_compute_fp32_to_bf16`: NaN is made quiet (keeping sign and top payload bits),
/// everything else rounds to nearest, ties to even (overflowing to infinity).
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    // No overflow: the largest non-NaN pattern, 0xFF80_0000, leaves room for the rounding bias.
    ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) as u16
}

fn whole_blocks(ty: GgmlType, values: &[f32]) -> Result<&[[f32; 32]]> {
    let (blocks, rest) = values.as_chunks::<32>();
    if !rest.is_empty() {
        return Err(QuantError::InvalidArgument(format!(
            "{} values cannot be quantized to {ty}: the count must be a multiple of its block \
             size {}",
            values.len(),
            ty.block_size()
        )));
    }
    Ok(blocks)
}
