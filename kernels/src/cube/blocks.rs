//! Packed weights of every type on the device, read where they lie: the K-quants, Q5_0/Q5_1,
//! IQ4_NL/IQ4_XS, F16 and BF16 in their GGUF blocks (the blocks layout), and Q8_0/Q4_0/Q4_1 in
//! the split layout. Every kernel here reads a weight through [`weight_value`], which decodes
//! one value from its block as ggml's `dequantize_row_*` does (same operations, same order):
//! the scale and offset of its group of 16 values (`group_affine`), times its quant (`quant`).
//! So no f32 copy of a weight exists on the device at any time.
//!
//! - `matvec_kernel` (decode, M ≤ 8): one cube per output; its units stride over the row's
//!   groups, decoding each group's scale once.
//! - `tiled_kernel` (prefill, training): a 16 × 16 output tile per cube, 32 reduction steps at a
//!   time staged in shared memory (4 KiB), so each weight value is decoded once per 16 activation
//!   rows. With `backward` it computes `dX = dY · W`: the same kernel with the weight's roles of
//!   row and column swapped.
//! - `rows_kernel`: rows of a weight widened to f32 (embedding lookups, `packed_dequantize`).
//!
//! The products are f32: unlike the split layout's kernels (`qmatmul`), the activations are not
//! quantized to the 8-bit blocks llama.cpp's CPU code uses for these types, so these kernels
//! compute the reference body `x · dequant(W)ᵀ` in another summation order.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous_aligned;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_sum, sext8, spread};
use crate::packed::GgmlType;

// Weight formats, as comptime kernel parameters.
const Q8_0: u32 = 0;
const Q4_0: u32 = 1;
const Q4_1: u32 = 2;
const Q5_0: u32 = 3;
const Q5_1: u32 = 4;
const IQ4_NL: u32 = 5;
const IQ4_XS: u32 = 6;
const Q2_K: u32 = 7;
const Q3_K: u32 = 8;
const Q4_K: u32 = 9;
const Q5_K: u32 = 10;
const Q6_K: u32 = 11;
const F16: u32 = 12;
const BF16: u32 = 13;

/// Largest number of activation rows the matrix-vector kernel takes.
const MATVEC_MAX_ROWS: usize = 8;
/// Units per cube of the matrix-vector kernel: they stride over a row's values.
const MATVEC_UNITS: u32 = 64;
/// Output tile of the tiled kernel: TILE × TILE outputs, one per unit.
const TILE: u32 = 16;
/// Reduction values staged per step of the tiled kernel.
const STEP: u32 = 32;
/// Units per cube of the rows kernel (one output value each).
const ROWS_UNITS: u32 = 256;

/// A packed weight's comptime format and, per format, the bytes of a block and the values in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Format {
    code: u32,
    block_values: u32,
    block_bytes: u32,
}

impl Format {
    pub(super) fn of(ty: GgmlType) -> Option<Format> {
        let code = match ty {
            GgmlType::Q8_0 => Q8_0,
            GgmlType::Q4_0 => Q4_0,
            GgmlType::Q4_1 => Q4_1,
            GgmlType::Q5_0 => Q5_0,
            GgmlType::Q5_1 => Q5_1,
            GgmlType::IQ4NL => IQ4_NL,
            GgmlType::IQ4XS => IQ4_XS,
            GgmlType::Q2K => Q2_K,
            GgmlType::Q3K => Q3_K,
            GgmlType::Q4K => Q4_K,
            GgmlType::Q5K => Q5_K,
            GgmlType::Q6K => Q6_K,
            GgmlType::F16 => F16,
            GgmlType::BF16 => BF16,
            _ => return None,
        };
        Some(Format {
            code,
            block_values: ty.block_size() as u32,
            block_bytes: ty.type_size() as u32,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Reading one weight value
// ---------------------------------------------------------------------------------------------

/// Byte `offset` of the row whose first word is `base`.
#[cube]
fn byte<Q: Int>(words: &Tensor<Q>, base: usize, offset: usize) -> u32 {
    let w = u32::cast_from(words[base + offset / 4]);
    (w >> (8 * (offset % 4)) as u32) & 0xFF
}

/// The 16-bit little-endian field at even byte `offset` (it never straddles a word).
#[cube]
fn half_bits<Q: Int>(words: &Tensor<Q>, base: usize, offset: usize) -> u32 {
    let w = u32::cast_from(words[base + offset / 4]);
    (w >> (8 * (offset % 4)) as u32) & 0xFFFF
}

/// The value of f16 bits, exactly (done on the bits: no f16 support needed on the device).
#[cube]
fn f16_value(h: u32) -> f32 {
    let sign = (h & 0x8000u32) << 16u32;
    let exp = (h >> 10u32) & 0x1Fu32;
    let mant = h & 0x3FFu32;
    let mut out = f32::reinterpret(sign | ((exp + 112u32) << 23u32) | (mant << 13u32));
    if exp == 0u32 {
        // Zero and subnormals: mant · 2^-24, exact in f32.
        out = f32::cast_from(mant) * 5.960_464_5e-8;
        if sign != 0u32 {
            out = -out;
        }
    } else if exp == 31u32 {
        out = f32::reinterpret(sign | 0x7F80_0000u32 | (mant << 13u32));
    }
    out
}

/// The f16 field at even byte `offset`, as f32.
#[cube]
fn half_at<Q: Int>(words: &Tensor<Q>, base: usize, offset: usize) -> f32 {
    f16_value(half_bits::<Q>(words, base, offset))
}

/// `kvalues_iq4nl[i]` (IQ4_NL and IQ4_XS's 16 levels), from four words of packed i8s.
#[cube]
fn iq4_level(i: u32) -> f32 {
    // -127, -104, -83, -65 | -49, -35, -22, -10 | 1, 13, 25, 38 | 53, 69, 89, 113
    let mut w = 0xBFAD_9881u32;
    if i >= 12u32 {
        w = 0x7159_4535u32;
    } else if i >= 8u32 {
        w = 0x2619_0D01u32;
    } else if i >= 4u32 {
        w = 0xF6EA_DDCFu32;
    }
    f32::cast_from(sext8((w >> (8 * (i % 4))) & 0xFF))
}

/// Scale and min of sub-block `s` (0..8) of a Q4_K/Q5_K block whose 12 scale bytes start at
/// `at` (ggml's `get_scale_min_k4`), as (scale, min).
#[cube]
fn scale_min_k4<Q: Int>(words: &Tensor<Q>, base: usize, at: usize, s: usize) -> (u32, u32) {
    let mut sc = byte::<Q>(words, base, at + s) & 63u32;
    let mut m = byte::<Q>(words, base, at + s + 4) & 63u32;
    if s >= 4 {
        let hi = byte::<Q>(words, base, at + s + 4);
        sc = (hi & 0xFu32) | ((byte::<Q>(words, base, at + s - 4) >> 6u32) << 4u32);
        m = (hi >> 4u32) | ((byte::<Q>(words, base, at + s) >> 6u32) << 4u32);
    }
    (sc, m)
}

/// Value `j` (0..32) of the nibble pair layout of Q4_0/Q4_1/Q5_x/IQ4_NL: byte `j % 16` of the 16
/// quant bytes at `at` holds element `j` in its low nibble and `j + 16` in its high one.
#[cube]
fn nibble<Q: Int>(words: &Tensor<Q>, base: usize, at: usize, j: usize) -> u32 {
    let b = byte::<Q>(words, base, at + j % 16);
    let mut q = b & 0xFu32;
    if j >= 16 {
        q = b >> 4u32;
    }
    q
}

/// Values per group: every format's value is `a · q + b` with `a` and `b` fixed over groups of
/// 16 values (Q2_K, Q3_K and Q6_K scale each 16; the others each 32, 256, or nothing).
const GROUP: usize = 16;

/// Whether the format's values have an offset `b` (a min) beside the scale `a`.
fn has_offset(code: u32) -> bool {
    matches!(code, Q4_1 | Q5_1 | Q2_K | Q4_K | Q5_K)
}

/// The scale `a` and offset `b` of group `g` (values `16g..16g + 16`) of row `row`: value `k`
/// of the group is `a · quant(k) + b` (`b` only where [`has_offset`]), which is exactly
/// ggml's `dequantize_row_*` arithmetic (`dl * q - ml` as `dl * q + (-ml)`).
/// `scales`/`mins` are the split layout's (the blocks layout keeps its scales in its blocks).
#[allow(unused_assignments)] // set in the one comptime branch the format selects
#[cube]
fn group_affine<Q: Int>(
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    row: usize,
    g: usize,
    #[comptime] fmt: Format,
) -> (f32, f32) {
    let base = row * words.stride(0);
    let k = g * GROUP;
    let j = k % comptime!(fmt.block_values as usize);
    let o = (k / comptime!(fmt.block_values as usize)) * comptime!(fmt.block_bytes as usize);
    let code = comptime!(fmt.code);
    let mut a = 1.0f32;
    let mut b = 0.0f32;
    if comptime!(code == Q8_0 || code == Q4_0 || code == Q4_1) {
        a = scales[row * scales.stride(0) + k / 32];
        if comptime!(code == Q4_1) {
            b = mins[row * mins.stride(0) + k / 32];
        }
    }
    if comptime!(code == Q5_0 || code == Q5_1 || code == IQ4_NL) {
        a = half_at::<Q>(words, base, o);
        if comptime!(code == Q5_1) {
            b = half_at::<Q>(words, base, o + 2);
        }
    }
    if comptime!(code == IQ4_XS) {
        // d, scales_h (u16), scales_l[4], qs[128]: 8 sub-blocks of 32 with 6-bit scales.
        let ib = j / 32;
        let low = (byte::<Q>(words, base, o + 4 + ib / 2) >> (4 * (ib % 2)) as u32) & 0xFu32;
        let high = (half_bits::<Q>(words, base, o + 2) >> (2 * ib) as u32) & 3u32;
        let ls = i32::cast_from(low | (high << 4u32)) - 32;
        a = half_at::<Q>(words, base, o) * f32::cast_from(ls);
    }
    if comptime!(code == Q2_K) {
        // scales[16] (low nibble: scale, high: min), qs[64], d, dmin.
        let sc = byte::<Q>(words, base, o + j / 16);
        a = half_at::<Q>(words, base, o + 80) * f32::cast_from(sc & 0xFu32);
        b = -(half_at::<Q>(words, base, o + 82) * f32::cast_from(sc >> 4u32));
    }
    if comptime!(code == Q3_K) {
        // hmask[32], qs[64], scales[12], d. Sixteen 6-bit scales: the low 4 bits from bytes
        // 0..8 (low nibbles first), the high 2 bits from bytes 8..12.
        let s = j / 16;
        let mut low = byte::<Q>(words, base, o + 96 + s) & 0xFu32;
        if s >= 8 {
            low = byte::<Q>(words, base, o + 96 + s - 8) >> 4u32;
        }
        let high = (byte::<Q>(words, base, o + 104 + s % 4) >> (2 * (s / 4)) as u32) & 3u32;
        let scale = i32::cast_from(low | (high << 4u32)) - 32;
        a = half_at::<Q>(words, base, o + 108) * f32::cast_from(scale);
    }
    if comptime!(code == Q4_K || code == Q5_K) {
        // d, dmin, scales[12]: sub-block j / 32's 6-bit scale and min (get_scale_min_k4).
        let (sc, m) = scale_min_k4::<Q>(words, base, o + 4, j / 32);
        a = half_at::<Q>(words, base, o) * f32::cast_from(sc);
        b = -(half_at::<Q>(words, base, o + 2) * f32::cast_from(m));
    }
    if comptime!(code == Q6_K) {
        // scales[16] (i8) at 192: per 128 values, quarter p of value l takes l / 16 + 2p.
        let p = (j % 128) / 32;
        let sc = sext8(byte::<Q>(
            words,
            base,
            o + 192 + 8 * (j / 128) + (j % 32) / 16 + 2 * p,
        ));
        // ggml: d * sc * q, left to right.
        a = half_at::<Q>(words, base, o + 208) * f32::cast_from(sc);
    }
    (a, b)
}

/// The quant of value `k` of row `row` that its group's scale multiplies (for F16/BF16, the
/// value itself).
#[allow(unused_assignments)] // set in the one comptime branch the format selects
#[cube]
fn quant<Q: Int>(words: &Tensor<Q>, row: usize, k: usize, #[comptime] fmt: Format) -> f32 {
    let base = row * words.stride(0);
    let j = k % comptime!(fmt.block_values as usize);
    let o = (k / comptime!(fmt.block_values as usize)) * comptime!(fmt.block_bytes as usize);
    let code = comptime!(fmt.code);
    let mut q = 0.0f32;
    if comptime!(code == Q8_0) {
        let w = u32::cast_from(words[base + k / 4]);
        q = f32::cast_from(sext8((w >> (8 * (k % 4)) as u32) & 0xFF));
    }
    if comptime!(code == Q4_0) {
        q = f32::cast_from(i32::cast_from(nibble::<Q>(words, base, (k / 32) * 16, k % 32)) - 8);
    }
    if comptime!(code == Q4_1) {
        q = f32::cast_from(nibble::<Q>(words, base, (k / 32) * 16, k % 32));
    }
    if comptime!(code == Q5_0 || code == Q5_1) {
        // Q5_0: d, qh (u32), qs[16]; Q5_1: d, m, qh, qs[16]. Bit j of qh is value j's 5th bit.
        let mut at = o + 2;
        if comptime!(code == Q5_1) {
            at = o + 4;
        }
        let high = (byte::<Q>(words, base, at + j / 8) >> (j % 8) as u32) & 1u32;
        let n = i32::cast_from(nibble::<Q>(words, base, at + 4, j) | (high << 4u32));
        if comptime!(code == Q5_0) {
            q = f32::cast_from(n - 16);
        } else {
            q = f32::cast_from(n);
        }
    }
    if comptime!(code == IQ4_NL) {
        q = iq4_level(nibble::<Q>(words, base, o + 2, j));
    }
    if comptime!(code == IQ4_XS) {
        q = iq4_level(nibble::<Q>(words, base, o + 8 + 16 * (j / 32), j % 32));
    }
    if comptime!(code == Q2_K) {
        // Byte l of each 32-byte chunk holds values l, l + 32, l + 64, l + 96 of its 128.
        let shift = (2 * ((j % 128) / 32)) as u32;
        q = f32::cast_from(
            (byte::<Q>(words, base, o + 16 + 32 * (j / 128) + j % 32) >> shift) & 3u32,
        );
    }
    if comptime!(code == Q3_K) {
        // The low 2 bits as Q2_K's (qs at 32); a clear hmask bit (bit 4·chunk + part of byte
        // l) means -4.
        let chunk = j / 128;
        let part = (j % 128) / 32;
        let l = j % 32;
        let mut n = i32::cast_from(
            (byte::<Q>(words, base, o + 32 + 32 * chunk + l) >> (2 * part) as u32) & 3u32,
        );
        if (byte::<Q>(words, base, o + l) >> (4 * chunk + part) as u32) & 1u32 == 0u32 {
            n -= 4;
        }
        q = f32::cast_from(n);
    }
    if comptime!(code == Q4_K || code == Q5_K) {
        // Byte l of each 32-byte chunk of qs holds value l of the chunk's first sub-block (low
        // nibble) and of its second (high nibble). Q5_K's 5th bit of value l of sub-block s
        // is bit s of qh[l].
        let s = j / 32;
        let mut qs_at = o + 16;
        if comptime!(code == Q5_K) {
            qs_at = o + 48;
        }
        let b = byte::<Q>(words, base, qs_at + 32 * (j / 64) + j % 32);
        let mut n = b & 0xFu32;
        if s % 2 == 1 {
            n = b >> 4u32;
        }
        if comptime!(code == Q5_K) {
            n += ((byte::<Q>(words, base, o + 16 + j % 32) >> s as u32) & 1u32) << 4u32;
        }
        q = f32::cast_from(n);
    }
    if comptime!(code == Q6_K) {
        // ql[128], qh[64]: per 128 values, quarter p (0..4) of value l (0..32) is the low
        // nibble (p < 2) or high nibble of ql[l + 32 (p % 2)] with bits 2p..2p+2 of qh[l].
        let chunk = j / 128;
        let p = (j % 128) / 32;
        let l = j % 32;
        let lb = byte::<Q>(words, base, o + 64 * chunk + l + 32 * (p % 2));
        let mut low = lb & 0xFu32;
        if p >= 2 {
            low = lb >> 4u32;
        }
        let high = (byte::<Q>(words, base, o + 128 + 32 * chunk + l) >> (2 * p) as u32) & 3u32;
        q = f32::cast_from(i32::cast_from(low | (high << 4u32)) - 32);
    }
    if comptime!(code == F16) {
        q = half_at::<Q>(words, base, 2 * k);
    }
    if comptime!(code == BF16) {
        q = f32::reinterpret(half_bits::<Q>(words, base, 2 * k) << 16u32);
    }
    q
}

/// `a · q + b` of one value, `b` added only where the format has one.
#[cube]
fn affine(a: f32, q: f32, b: f32, #[comptime] fmt: Format) -> f32 {
    let mut v = a * q;
    if comptime!(has_offset(fmt.code)) {
        v += b;
    }
    v
}

/// Element `k` of row `row` of a packed weight, as ggml's `dequantize_row_*` computes it.
#[cube]
fn weight_value<Q: Int>(
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    row: usize,
    k: usize,
    #[comptime] fmt: Format,
) -> f32 {
    let (a, b) = group_affine::<Q>(words, scales, mins, row, k / GROUP, fmt);
    affine(a, quant::<Q>(words, row, k, fmt), b, fmt)
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

/// `out[m, n]` for a few rows: one cube per output, its units striding over the row's groups of
/// 16 values (each group's scale decoded once), then a shared-memory tree sum.
#[cube(launch)]
fn matvec_kernel<F: Float, Q: Int>(
    x: &Tensor<F>,
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] fmt: Format,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let n = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let row = CUBE_POS_Z as usize;
    if n >= out.shape(1) {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let groups = x.shape(1) / GROUP;
    let xrow = row * x.stride(0);
    let mut acc = 0.0f32;
    let mut g = lane;
    while g < groups {
        let (a, b) = group_affine::<Q>(words, scales, mins, n, g, fmt);
        for i in 0..GROUP {
            let k = g * GROUP + i;
            let w = affine(a, quant::<Q>(words, n, k, fmt), b, fmt);
            acc += f32::cast_from(x[xrow + k * x.stride(1)]) * w;
        }
        g += MATVEC_UNITS as usize;
    }
    // A 16-bit row's values past its last whole group.
    let mut k = groups * GROUP + lane;
    while k < x.shape(1) {
        let w = weight_value::<Q>(words, scales, mins, n, k, fmt);
        acc += f32::cast_from(x[xrow + k * x.stride(1)]) * w;
        k += MATVEC_UNITS as usize;
    }
    let total = cube_sum(acc, lane, MATVEC_UNITS);
    if lane == 0 {
        out[row * out.stride(0) + n * out.stride(1)] = F::cast_from(total);
    }
}

/// A TILE × TILE tile of `out = a · Wᵀ` (`backward` false: `a[m, k]`, out `[m, n]`, reducing over
/// the weight's columns) or of `out = a · W` (`backward` true: `a = dY[m, n]`, out `[m, k]`,
/// reducing over the weight's rows). Each step stages TILE × STEP values of `a` and of the
/// weight (decoded) in shared memory.
#[cube(launch)]
fn tiled_kernel<F: Float, Q: Int>(
    a: &Tensor<F>,
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] fmt: Format,
    #[comptime] backward: bool,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let tile = TILE as usize;
    let step = STEP as usize;
    let m = out.shape(0);
    let cols = out.shape(1);
    let reduce = a.shape(1);
    let c = UNIT_POS_X as usize;
    let r = UNIT_POS_Y as usize;
    let unit = r * tile + c;
    let col0 = CUBE_POS_X as usize * tile;
    let row0 = CUBE_POS_Y as usize * tile;

    let mut a_sm = SharedMemory::<f32>::new(TILE as usize * STEP as usize);
    let mut w_sm = SharedMemory::<f32>::new(TILE as usize * STEP as usize);
    let mut acc = 0.0f32;
    let mut k0 = 0usize;
    while k0 < reduce {
        // TILE × STEP values of each operand: two per unit.
        for half in 0..2usize {
            let i = unit + half * tile * tile;
            let rr = i / step;
            let j = i % step;
            let kk = k0 + j;
            let arow = row0 + rr;
            let mut av = 0.0f32;
            if arow < m && kk < reduce {
                av = f32::cast_from(a[arow * a.stride(0) + kk * a.stride(1)]);
            }
            a_sm[i] = av;
            let wcol = col0 + rr;
            let mut wv = 0.0f32;
            if wcol < cols && kk < reduce {
                if comptime!(backward) {
                    wv = weight_value::<Q>(words, scales, mins, kk, wcol, fmt);
                } else {
                    wv = weight_value::<Q>(words, scales, mins, wcol, kk, fmt);
                }
            }
            w_sm[i] = wv;
        }
        sync_cube();
        for j in 0..step {
            acc += a_sm[r * step + j] * w_sm[c * step + j];
        }
        sync_cube();
        k0 += step;
    }
    let row = row0 + r;
    let col = col0 + c;
    if row < m && col < cols {
        out[row * out.stride(0) + col * out.stride(1)] = F::cast_from(acc);
    }
}

/// `out[i, :]` = row `ids[i]` of the weight, widened; one unit per value. An id past the
/// weight's rows gives a row of zeros (a device cannot raise an error; callers check ids).
#[cube(launch)]
fn rows_kernel<F: Float, Q: Int, I: Int>(
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    ids: &Tensor<I>,
    out: &mut Tensor<F>,
    #[comptime] fmt: Format,
    #[define(F, Q, I)] _dtypes: [StorageType; 3],
) {
    let pos = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * ROWS_UNITS as usize
        + UNIT_POS_X as usize;
    let cols = out.shape(1);
    if pos >= out.shape(0) * cols {
        terminate!();
    }
    let i = pos / cols;
    let k = pos % cols;
    // A negative id wraps past every row.
    let id = u32::cast_from(ids[i * ids.stride(0)]) as usize;
    let mut v = 0.0f32;
    if id < words.shape(0) {
        v = weight_value::<Q>(words, scales, mins, id, k, fmt);
    }
    out[i * out.stride(0) + k * out.stride(1)] = F::cast_from(v);
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

/// A packed weight's device tensors; the blocks layout has no scales or mins, and a format that
/// does not read them gets a one-value stand-in.
pub(super) struct Weight<R: CubeRuntime> {
    pub words: CubeTensor<R>,
    pub scales: Option<CubeTensor<R>>,
    pub mins: Option<CubeTensor<R>>,
    pub fmt: Format,
}

impl<R: CubeRuntime> Weight<R> {
    /// (words, scales, mins) as kernel arguments' tensors.
    fn parts(self) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
        let words = into_contiguous_aligned(self.words);
        let scales = self.scales.map(into_contiguous_aligned).unwrap_or_else(|| {
            let shape = Shape::new([1, 1]);
            empty_device_contiguous_dtype(
                words.client.clone(),
                words.device.clone(),
                shape,
                DType::F32,
            )
        });
        let mins = self
            .mins
            .map(into_contiguous_aligned)
            .unwrap_or_else(|| scales.clone());
        (words, scales, mins)
    }
}

fn tiled<R: CubeRuntime>(
    a: CubeTensor<R>,
    w: Weight<R>,
    out_cols: usize,
    backward: bool,
) -> CubeTensor<R> {
    let fmt = w.fmt;
    let (words, scales, mins) = w.parts();
    let m = a.shape().dims::<2>()[0];
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::new([m, out_cols]),
        a.dtype,
    );
    let dtypes = [a.dtype.into(), words.dtype.into()];
    tiled_kernel::launch::<R>(
        &a.client,
        CubeCount::Static(
            out_cols.div_ceil(TILE as usize) as u32,
            m.div_ceil(TILE as usize) as u32,
            1,
        ),
        CubeDim::new_2d(TILE, TILE),
        a.clone().into_tensor_arg(),
        words.into_tensor_arg(),
        scales.into_tensor_arg(),
        mins.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        fmt,
        backward,
        dtypes,
    );
    out
}

/// `x[m, k] · dequant(W)[n, k]ᵀ`.
pub(super) fn matmul<R: CubeRuntime>(x: CubeTensor<R>, w: Weight<R>) -> CubeTensor<R> {
    let [m, _k] = x.shape().dims::<2>();
    let n = w.words.shape().dims::<2>()[0];
    if m > MATVEC_MAX_ROWS {
        return tiled(x, w, n, false);
    }
    let fmt = w.fmt;
    let (words, scales, mins) = w.parts();
    let out = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([m, n]),
        x.dtype,
    );
    let (cx, cy) = spread(n);
    let dtypes = [x.dtype.into(), words.dtype.into()];
    matvec_kernel::launch::<R>(
        &x.client,
        CubeCount::Static(cx, cy, m as u32),
        CubeDim::new_1d(MATVEC_UNITS),
        x.clone().into_tensor_arg(),
        words.into_tensor_arg(),
        scales.into_tensor_arg(),
        mins.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        fmt,
        dtypes,
    );
    out
}

/// `dy[m, n] · dequant(W)[n, k]`, a weight of `cols` = k values per row.
pub(super) fn matmul_backward<R: CubeRuntime>(
    dy: CubeTensor<R>,
    w: Weight<R>,
    cols: usize,
) -> CubeTensor<R> {
    tiled(dy, w, cols, true)
}

/// Rows `ids` of the weight (`cols` values each), widened to `dtype`.
pub(super) fn rows<R: CubeRuntime>(
    w: Weight<R>,
    ids: CubeTensor<R>,
    cols: usize,
    dtype: DType,
) -> CubeTensor<R> {
    let fmt = w.fmt;
    let (words, scales, mins) = w.parts();
    let count = ids.shape().num_elements();
    let out = empty_device_contiguous_dtype(
        words.client.clone(),
        words.device.clone(),
        Shape::new([count, cols]),
        dtype,
    );
    let (cx, cy) = spread((count * cols).div_ceil(ROWS_UNITS as usize));
    let dtypes = [dtype.into(), words.dtype.into(), ids.dtype.into()];
    rows_kernel::launch::<R>(
        &ids.client.clone(),
        CubeCount::Static(cx, cy, 1),
        CubeDim::new_1d(ROWS_UNITS),
        words.into_tensor_arg(),
        scales.into_tensor_arg(),
        mins.into_tensor_arg(),
        ids.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        fmt,
        dtypes,
    );
    out
}
