//! Quantized matmul for the split layouts (Q8_0, Q4_0, Q4_1), as llama.cpp computes it: the
//! activation row is quantized to 8-bit blocks (Q8_0, or Q8_1 for Q4_1 weights) with an f16
//! scale, each block's dot product is an exact integer sum, and one `d_w * d_x` multiply per
//! block scales it. Only the order in which block results are summed differs from llama.cpp's
//! CPU code, so logits agree to float rounding and greedy tokens agree wherever llama.cpp's own
//! decision is not a near-tie.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous_aligned;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_sum, sext8, spread};
use crate::packed::{BLOCK, GgmlType};

/// Weight block formats, as comptime kernel parameters.
const FMT_Q8_0: u32 = 0;
const FMT_Q4_0: u32 = 1;
const FMT_Q4_1: u32 = 2;

/// The comptime format of a split-layout type.
pub(super) fn split_format(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::Q8_0 => Some(FMT_Q8_0),
        GgmlType::Q4_0 => Some(FMT_Q4_0),
        GgmlType::Q4_1 => Some(FMT_Q4_1),
        _ => None,
    }
}

/// Largest number of activation rows the matrix-vector kernel takes; more rows go to the tiled
/// kernel, which reads each weight tile once for 16 rows.
const MATVEC_MAX_ROWS: usize = 8;
/// Units per cube of the matrix-vector kernel: they stride over a row's blocks.
const MATVEC_UNITS: u32 = 64;
/// Output tile of the tiled quantized matmul: TILE × TILE outputs, one per unit.
const TILE: u32 = 16;

/// `x` rounded to the nearest f16 value (ties to even), returned as f32: llama.cpp stores the
/// activation blocks' scales as f16. Done on the bits so it needs no f16 support on the device.
#[cube]
fn round_to_f16(x: f32) -> f32 {
    let bits = u32::reinterpret(x);
    let magnitude = bits & 0x7FFF_FFFFu32;
    // Subnormal f16: multiples of 2^-24 (scaling by powers of two is exact).
    let mut out = (x * 16777216.0).round() / 16777216.0;
    if magnitude >= 0x3880_0000u32 {
        // Normal f16 range: keep 10 mantissa bits, rounding half to even.
        let rounded = (bits + 0x0FFFu32 + ((bits >> 13u32) & 1u32)) & 0xFFFF_E000u32;
        out = f32::reinterpret(rounded);
    }
    out
}

/// Signed quant `j` (0..32) of weight block `blk` of row `row`, as llama.cpp multiplies it:
/// the i8 of Q8_0, the nibble − 8 of Q4_0, the unsigned nibble of Q4_1.
#[allow(unused_assignments)] // `q` is set in whichever comptime branch the format selects
#[cube]
fn weight_quant<Q: Int>(
    words: &Tensor<Q>,
    row: usize,
    blk: usize,
    j: usize,
    #[comptime] fmt: u32,
) -> i32 {
    let base = row * words.stride(0);
    let mut q = 0i32;
    if comptime!(fmt == FMT_Q8_0) {
        let w = u32::cast_from(words[base + blk * 8 + j / 4]);
        q = sext8((w >> (8 * (j % 4)) as u32) & 0xFF);
    } else {
        let byte_index = j % 16;
        let w = u32::cast_from(words[base + blk * 4 + byte_index / 4]);
        let byte = (w >> (8 * (byte_index % 4)) as u32) & 0xFF;
        let mut nibble = byte & 0xF;
        if j >= 16 {
            nibble = byte >> 4;
        }
        q = i32::cast_from(nibble);
        if comptime!(fmt == FMT_Q4_0) {
            q -= 8;
        }
    }
    q
}

// ---------------------------------------------------------------------------------------------
// Activation quantization
// ---------------------------------------------------------------------------------------------

/// Quantize each 32-value block of `x[m, k]` as ggml's x86 `quantize_row_q8_0/q8_1`:
/// `d = amax / 127` (stored as f16), `q = round_half_even(x * 127 / amax)`, and Q8_1's
/// `s = f16(d * Σq)` with the unrounded `d`. One cube of 32 units per block.
#[cube(launch)]
fn quantize_q8_kernel<F: Float>(
    x: &Tensor<F>,
    quants: &mut Tensor<u32>,
    scales: &mut Tensor<f32>,
    sums: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let blocks = x.shape(1) / 32;
    let blk = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let row = CUBE_POS_Z as usize;
    if blk >= blocks {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let v = f32::cast_from(x[row * x.stride(0) + (blk * 32 + lane) * x.stride(1)]);

    let mut amax = SharedMemory::<f32>::new(32usize);
    let mut q_sm = SharedMemory::<i32>::new(32usize);
    amax[lane] = v.abs();
    sync_cube();
    let mut width = 16usize.runtime();
    while width > 0 {
        if lane < width {
            let other = amax[lane + width];
            if other > amax[lane] {
                amax[lane] = other;
            }
        }
        sync_cube();
        width /= 2;
    }
    let a = amax[0];
    let d = a / 127.0;
    let mut id = 0.0f32;
    if a != 0.0 {
        id = 127.0 / a;
    }
    let q = i32::cast_from((v * id).round());
    q_sm[lane] = q;
    sync_cube();
    if lane < 8 {
        let mut word = 0u32;
        for b in 0..4usize {
            word |= (u32::cast_from(q_sm[lane * 4 + b]) & 0xFF) << (8 * b) as u32;
        }
        quants[row * quants.stride(0) + blk * 8 + lane] = word;
    }
    if lane == 0 {
        let mut sum = 0i32;
        for i in 0..32usize {
            sum += q_sm[i];
        }
        scales[row * scales.stride(0) + blk] = round_to_f16(d);
        sums[row * sums.stride(0) + blk] = round_to_f16(d * f32::cast_from(sum));
    }
}

/// Activation quants of `x[m, k]`: words `[m, k/4]` (4 i8 per u32, Q8_0's layout), f16-rounded
/// scales and Q8_1 sums `[m, k/32]`.
struct QuantizedRows<R: CubeRuntime> {
    quants: CubeTensor<R>,
    scales: CubeTensor<R>,
    sums: CubeTensor<R>,
}

fn quantize_rows<R: CubeRuntime>(x: &CubeTensor<R>) -> QuantizedRows<R> {
    let [m, k] = x.shape().dims::<2>();
    let blocks = k / BLOCK;
    let empty = |shape: [usize; 2], dtype| {
        empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), Shape::new(shape), dtype)
    };
    let quants = empty([m, k / 4], DType::U32);
    let scales = empty([m, blocks], DType::F32);
    let sums = empty([m, blocks], DType::F32);
    let (cx, cy) = spread(blocks);
    quantize_q8_kernel::launch::<R>(
        &x.client,
        CubeCount::Static(cx, cy, m as u32),
        CubeDim::new_1d(32),
        x.clone().into_tensor_arg(),
        quants.clone().into_tensor_arg(),
        scales.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        x.dtype.into(),
    );
    QuantizedRows {
        quants,
        scales,
        sums,
    }
}

// ---------------------------------------------------------------------------------------------
// Quantized matmul
// ---------------------------------------------------------------------------------------------

/// Integer dot product of activation block `blk` of row `row` with weight block `blk` of
/// weight row `n`.
#[cube]
fn block_dot<Q: Int>(
    xq: &Tensor<u32>,
    words: &Tensor<Q>,
    row: usize,
    n: usize,
    blk: usize,
    #[comptime] fmt: u32,
) -> i32 {
    let xbase = row * xq.stride(0) + blk * 8;
    let wbase = n * words.stride(0);
    let mut isum = 0i32;
    if comptime!(fmt == FMT_Q8_0) {
        for w in 0..8usize {
            let xw = xq[xbase + w];
            let ww = u32::cast_from(words[wbase + blk * 8 + w]);
            for b in 0..4usize {
                let shift = (8 * b) as u32;
                isum += sext8((xw >> shift) & 0xFF) * sext8((ww >> shift) & 0xFF);
            }
        }
    } else {
        // A Q4 block's 16 bytes hold element i (low nibble) and i + 16 (high nibble) of byte i.
        for w in 0..4usize {
            let ww = u32::cast_from(words[wbase + blk * 4 + w]);
            let x_lo = xq[xbase + w];
            let x_hi = xq[xbase + 4 + w];
            for b in 0..4usize {
                let shift = (8 * b) as u32;
                let byte = (ww >> shift) & 0xFF;
                let mut lo = i32::cast_from(byte & 0xF);
                let mut hi = i32::cast_from(byte >> 4);
                if comptime!(fmt == FMT_Q4_0) {
                    lo -= 8;
                    hi -= 8;
                }
                isum += lo * sext8((x_lo >> shift) & 0xFF) + hi * sext8((x_hi >> shift) & 0xFF);
            }
        }
    }
    isum
}

/// `out[m, n]` for a few rows: one cube per output element, its units striding over the blocks
/// of the row, then a shared-memory tree sum.
#[cube(launch)]
fn qmatvec_kernel<F: Float, Q: Int>(
    xq: &Tensor<u32>,
    xd: &Tensor<f32>,
    xs: &Tensor<f32>,
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] fmt: u32,
    #[comptime] units: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let n = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let row = CUBE_POS_Z as usize;
    if n >= out.shape(1) {
        terminate!();
    }
    let lane = UNIT_POS_X as usize;
    let blocks = xd.shape(1);
    let mut acc = 0.0f32;
    let mut blk = lane;
    while blk < blocks {
        let isum = block_dot::<Q>(xq, words, row, n, blk, fmt);
        let d = scales[n * scales.stride(0) + blk] * xd[row * xd.stride(0) + blk];
        acc += d * f32::cast_from(isum);
        if comptime!(fmt == FMT_Q4_1) {
            acc += mins[n * mins.stride(0) + blk] * xs[row * xs.stride(0) + blk];
        }
        blk += units as usize;
    }
    let total = cube_sum(acc, lane, units);
    if lane == 0 {
        out[row * out.stride(0) + n * out.stride(1)] = F::cast_from(total);
    }
}

/// `out[m, n]` for many rows: a TILE × TILE output tile per cube; each step stages one block of
/// 32 quants for the tile's rows and columns in shared memory, so a weight block is read once
/// per 16 rows.
#[cube(launch)]
fn qmatmul_tiled_kernel<F: Float, Q: Int>(
    xq: &Tensor<u32>,
    xd: &Tensor<f32>,
    xs: &Tensor<f32>,
    words: &Tensor<Q>,
    scales: &Tensor<f32>,
    mins: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] fmt: u32,
    #[define(F, Q)] _dtypes: [StorageType; 2],
) {
    let tile = TILE as usize;
    let m = out.shape(0);
    let n = out.shape(1);
    let blocks = xd.shape(1);
    let c = UNIT_POS_X as usize;
    let r = UNIT_POS_Y as usize;
    let unit = r * tile + c;
    let col0 = CUBE_POS_X as usize * tile;
    let row0 = CUBE_POS_Y as usize * tile;

    let mut x_sm = SharedMemory::<i32>::new(TILE as usize * 32);
    let mut w_sm = SharedMemory::<i32>::new(TILE as usize * 32);
    let mut xd_sm = SharedMemory::<f32>::new(TILE as usize);
    let mut xs_sm = SharedMemory::<f32>::new(TILE as usize);
    let mut wd_sm = SharedMemory::<f32>::new(TILE as usize);
    let mut wm_sm = SharedMemory::<f32>::new(TILE as usize);

    let mut acc = 0.0f32;
    for blk in 0..blocks {
        // Stage 16 × 32 activation quants and 16 × 32 weight quants: two of each per unit.
        for half in 0..2usize {
            let i = unit + half * tile * tile;
            let rr = i / 32;
            let j = i % 32;
            let xrow = row0 + rr;
            let mut xv = 0i32;
            if xrow < m {
                let w = xq[xrow * xq.stride(0) + blk * 8 + j / 4];
                xv = sext8((w >> (8 * (j % 4)) as u32) & 0xFF);
            }
            x_sm[i] = xv;
            let wrow = col0 + rr;
            let mut wv = 0i32;
            if wrow < n {
                wv = weight_quant::<Q>(words, wrow, blk, j, fmt);
            }
            w_sm[i] = wv;
        }
        if unit < tile {
            let xrow = row0 + unit;
            let mut d = 0.0f32;
            let mut s = 0.0f32;
            if xrow < m {
                d = xd[xrow * xd.stride(0) + blk];
                s = xs[xrow * xs.stride(0) + blk];
            }
            xd_sm[unit] = d;
            xs_sm[unit] = s;
        } else if unit < 2 * tile {
            let wrow = col0 + unit - tile;
            let mut d = 0.0f32;
            let mut mn = 0.0f32;
            if wrow < n {
                d = scales[wrow * scales.stride(0) + blk];
                if comptime!(fmt == FMT_Q4_1) {
                    mn = mins[wrow * mins.stride(0) + blk];
                }
            }
            wd_sm[unit - tile] = d;
            wm_sm[unit - tile] = mn;
        }
        sync_cube();
        let mut isum = 0i32;
        for j in 0..32usize {
            isum += x_sm[r * 32 + j] * w_sm[c * 32 + j];
        }
        acc += (wd_sm[c] * xd_sm[r]) * f32::cast_from(isum);
        if comptime!(fmt == FMT_Q4_1) {
            acc += wm_sm[c] * xs_sm[r];
        }
        sync_cube();
    }
    let row = row0 + r;
    let col = col0 + c;
    if row < m && col < n {
        out[row * out.stride(0) + col * out.stride(1)] = F::cast_from(acc);
    }
}

pub(super) fn qmatmul<R: CubeRuntime>(
    x: CubeTensor<R>,
    words: CubeTensor<R>,
    scales: CubeTensor<R>,
    mins: Option<CubeTensor<R>>,
    fmt: u32,
) -> CubeTensor<R> {
    let x = into_contiguous_aligned(x);
    let words = into_contiguous_aligned(words);
    let scales = into_contiguous_aligned(scales);
    // Symmetric formats never read the mins: pass the scales in their place.
    let mins = mins
        .map(into_contiguous_aligned)
        .unwrap_or_else(|| scales.clone());
    let [m, _k] = x.shape().dims::<2>();
    let n = words.shape().dims::<2>()[0];
    let act = quantize_rows(&x);
    let out = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([m, n]),
        x.dtype,
    );
    let dtypes = [x.dtype.into(), words.dtype.into()];
    if m <= MATVEC_MAX_ROWS {
        let (cx, cy) = spread(n);
        qmatvec_kernel::launch::<R>(
            &x.client,
            CubeCount::Static(cx, cy, m as u32),
            CubeDim::new_1d(MATVEC_UNITS),
            act.quants.into_tensor_arg(),
            act.scales.into_tensor_arg(),
            act.sums.into_tensor_arg(),
            words.into_tensor_arg(),
            scales.into_tensor_arg(),
            mins.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            fmt,
            MATVEC_UNITS,
            dtypes,
        );
    } else {
        let tiles_n = n.div_ceil(TILE as usize) as u32;
        let tiles_m = m.div_ceil(TILE as usize) as u32;
        qmatmul_tiled_kernel::launch::<R>(
            &x.client,
            CubeCount::Static(tiles_n, tiles_m, 1),
            CubeDim::new_2d(TILE, TILE),
            act.quants.into_tensor_arg(),
            act.scales.into_tensor_arg(),
            act.sums.into_tensor_arg(),
            words.into_tensor_arg(),
            scales.into_tensor_arg(),
            mins.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            fmt,
            dtypes,
        );
    }
    out
}
