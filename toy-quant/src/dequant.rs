//! Dequantization of GGUF tensor data to f32.
//!
//! Each block type follows ggml's `dequantize_row_*` (ggml-quants.c) operation for operation:
//! the same products and sums in the same order, in f32, with no fused multiply-add. The results
//! are therefore bit-identical to ggml's reference code and to gguf-py's
//! `gguf.quants.dequantize`, which mirrors it (the tests check every type against gguf-py).
//!
//! Block layouts (`d`, `m`, `dmin` are f16 unless noted; QK_K = 256):
//!
//! | type | bytes | layout |
//! | --- | --- | --- |
//! | Q4_0 | 18 | d, qs\[16\] (low nibbles: values 0..16, high nibbles: 16..32) |
//! | Q4_1 | 20 | d, m, qs\[16\] |
//! | Q5_0 | 22 | d, qh u32 (5th bits), qs\[16\] |
//! | Q5_1 | 24 | d, m, qh u32, qs\[16\] |
//! | Q8_0 | 34 | d, qs i8\[32\] |
//! | Q2_K | 84 | scales\[16\] (4-bit scale, 4-bit min), qs\[64\], d, dmin |
//! | Q3_K | 110 | hmask\[32\], qs\[64\], scales\[12\] (16 × 6 bits), d |
//! | Q4_K | 144 | d, dmin, scales\[12\] (8 × 6-bit scale and min), qs\[128\] |
//! | Q5_K | 176 | d, dmin, scales\[12\], qh\[32\], qs\[128\] |
//! | Q6_K | 210 | ql\[128\], qh\[64\], scales i8\[16\], d |
//! | Q8_K | 292 | d f32, qs i8\[256\], bsums i16\[16\] (unused here) |
//! | IQ4_NL | 18 | d, qs\[16\] (nibbles index the 16-value non-linear grid `IQ4_GRID`) |
//! | IQ4_XS | 136 | d, scales_h u16, scales_l\[4\] (8 × 6-bit scales), qs\[128\] (grid indices) |

// The block functions index several arrays with one counter, as ggml's C does; keeping that
// shape makes them easy to check against ggml-quants.c.
#![allow(clippy::needless_range_loop)]

use half::f16;

use crate::types::GgmlType;
use crate::{QuantError, Result};

/// The types [`dequantize`] handles.
pub const DEQUANT_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
];

/// Dequantize `bytes`, a whole number of blocks of type `ty`, into `out`, which must have room
/// for exactly the values they hold (`bytes.len() / type_size * block_size`).
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let n = n_values(ty, bytes)?;
    if out.len() != n {
        return Err(QuantError::InvalidArgument(format!(
            "{} bytes of {ty} data hold {n} values, but the output has room for {}",
            bytes.len(),
            out.len()
        )));
    }
    match ty {
        GgmlType::F32 => each::<4, 1>(bytes, out, |b, y| y[0] = f32::from_le_bytes(*b)),
        GgmlType::F16 => each::<2, 1>(bytes, out, |b, y| y[0] = f16::from_le_bytes(*b).to_f32()),
        // bf16 is the top half of an f32: widening is exact for every bit pattern.
        GgmlType::BF16 => each::<2, 1>(bytes, out, |b, y| {
            y[0] = f32::from_bits((u16::from_le_bytes(*b) as u32) << 16)
        }),
        GgmlType::Q4_0 => each(bytes, out, q4_0),
        GgmlType::Q4_1 => each(bytes, out, q4_1),
        GgmlType::Q5_0 => each(bytes, out, q5_0),
        GgmlType::Q5_1 => each(bytes, out, q5_1),
        GgmlType::Q8_0 => each(bytes, out, q8_0),
        GgmlType::Q2K => each(bytes, out, q2_k),
        GgmlType::Q3K => each(bytes, out, q3_k),
        GgmlType::Q4K => each(bytes, out, q4_k),
        GgmlType::Q5K => each(bytes, out, q5_k),
        GgmlType::Q6K => each(bytes, out, q6_k),
        GgmlType::Q8K => each(bytes, out, q8_k),
        GgmlType::IQ4NL => each(bytes, out, iq4_nl),
        GgmlType::IQ4XS => each(bytes, out, iq4_xs),
        // `n_values` has refused everything else.
        _ => return Err(unsupported(ty)),
    }
    Ok(())
}

/// [`dequantize`] into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    let mut out = vec![0.0; n_values(ty, bytes)?];
    dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

/// How many values `bytes` of type `ty` hold, refusing unsupported types and partial blocks.
fn n_values(ty: GgmlType, bytes: &[u8]) -> Result<usize> {
    if !DEQUANT_TYPES.contains(&ty) {
        return Err(unsupported(ty));
    }
    let (block, size) = (ty.block_size(), ty.type_size());
    if !bytes.len().is_multiple_of(size) {
        return Err(QuantError::InvalidArgument(format!(
            "{} bytes of {ty} data are not a whole number of {size}-byte blocks",
            bytes.len()
        )));
    }
    Ok(bytes.len() / size * block)
}

fn unsupported(ty: GgmlType) -> QuantError {
    QuantError::Unsupported(unsupported_reason(ty))
}

/// Why `ty` cannot be dequantized, naming the types that can.
pub fn unsupported_reason(ty: GgmlType) -> String {
    let names: Vec<&str> = DEQUANT_TYPES.iter().map(|t| t.name()).collect();
    format!(
        "dequantizing {ty} is not supported (toy dequantizes {})",
        names.join(", ")
    )
}

/// Apply `f` to each block of `TS` bytes and its `BS` outputs. The caller has checked that
/// `bytes` and `out` hold the same number of whole blocks.
#[inline(always)]
fn each<const TS: usize, const BS: usize>(
    bytes: &[u8],
    out: &mut [f32],
    f: impl Fn(&[u8; TS], &mut [f32; BS]),
) {
    let (blocks, _) = bytes.as_chunks::<TS>();
    let (outs, _) = out.as_chunks_mut::<BS>();
    for (b, y) in blocks.iter().zip(outs) {
        f(b, y);
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        // Bit j of qh is the 5th bit of value j, bit j + 16 that of value j + 16.
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = ((qs[j] & 0x0F) as u32 | xh0) as i32 - 16;
        let x1 = ((qs[j] >> 4) as u32 | xh1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        let x0 = (qs[j] & 0x0F) as u32 | xh0;
        let x1 = (qs[j] >> 4) as u32 | xh1;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let scales = &b[0..16];
    let d = f16_at(b, 80);
    let min = f16_at(b, 82);
    let mut is = 0;
    let mut yi = 0;
    for n in 0..2 {
        let q = &b[16 + 32 * n..16 + 32 * n + 32];
        for shift in [0, 2, 4, 6] {
            // Two groups of 16 values per shift: q[0..16] and q[16..32], each with its own
            // scale byte (low nibble: scale, high nibble: min).
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                for &ql in &q[16 * half..16 * half + 16] {
                    y[yi] = dl * ((ql >> shift) & 3) as f32 - ml;
                    yi += 1;
                }
            }
        }
    }
}

/// Q3_K's 16 six-bit scales, as ggml unpacks them (`aux`/`kmask` in `dequantize_row_q3_K`):
/// the low 4 bits from bytes 0..8 (low nibbles first), the high 2 bits from bytes 8..12.
fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    let mut out = [0; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let low = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        *o = (low | (high << 4)) as i32 - 32;
    }
    out
}

fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let hmask = &b[0..32];
    let scales = q3_k_scales(&b[96..108]);
    let d_all = f16_at(b, 108);
    let mut is = 0;
    let mut yi = 0;
    for n in 0..2 {
        let q = &b[32 + 32 * n..32 + 32 * n + 32];
        for j in 0..4 {
            let shift = 2 * j;
            // The high bit of each value is bit (4n + j) of its hmask byte; a clear bit means -4.
            let m = 1u8 << (4 * n + j);
            for half in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 16 * half..16 * half + 16 {
                    let low = ((q[l] >> shift) & 3) as i32;
                    let v = low - if hmask[l] & m != 0 { 0 } else { 4 };
                    y[yi] = dl * v as f32;
                    yi += 1;
                }
            }
        }
    }
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let q = &b[16 + 32 * j..16 + 32 * j + 32];
        let y = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let min = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        // Sub-block 2j takes its 5th bits from bit 2j of qh, sub-block 2j + 1 from bit 2j + 1.
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let ql = &b[48 + 32 * j..48 + 32 * j + 32];
        let y = &mut y[64 * j..64 * j + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            // ggml: d * sc * q, evaluated left to right.
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

fn q8_k(b: &[u8; 292], y: &mut [f32; 256]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for j in 0..256 {
        y[j] = d * (b[4 + j] as i8) as f32;
    }
}

/// The 16 values IQ4_NL and IQ4_XS nibbles index (ggml's `kvalues_iq4nl`).
pub const IQ4_GRID: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * IQ4_GRID[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * IQ4_GRID[(qs[j] >> 4) as usize] as f32;
    }
}

fn iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as i32;
    let scales_l = &b[4..8];
    for ib in 0..8 {
        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32
            | (((scales_h >> (2 * ib)) & 3) << 4);
        let dl = d * (ls - 32) as f32;
        let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
        let y = &mut y[32 * ib..32 * ib + 32];
        for j in 0..16 {
            y[j] = dl * IQ4_GRID[(qs[j] & 0x0F) as usize] as f32;
            y[j + 16] = dl * IQ4_GRID[(qs[j] >> 4) as usize] as f32;
        }
    }
}
