//! cubecl kernels: the [`ToyBackend`] overrides for burn's `CubeBackend` (`--backend wgpu`,
//! `--backend cuda`).
//!
//! Portability rules every kernel here keeps: no plane (warp/subgroup) operations — lavapipe
//! exposes none and real GPUs differ in width (8 to 64) — so reductions go through shared
//! memory; at most a few KiB of shared memory per cube (lavapipe and Metal give 32 KiB); no
//! infinities as literals (WGSL rejects them), so masked scores are tracked explicitly. Tensors
//! are indexed through their strides: CUDA pads rows (pitched memory), and attention reads
//! K/V caches that are views.
//!
//! Quantized matmuls compute what llama.cpp computes: the activation row is quantized to 8-bit
//! blocks (Q8_0, or Q8_1 for Q4_1 weights) with an f16 scale, each block's dot product is an
//! exact integer sum, and one `d_w * d_x` multiply per block scales it. Only the order in which
//! block results are summed differs from llama.cpp's CPU code, so logits agree to float rounding
//! and greedy tokens agree wherever llama.cpp's own decision is not a near-tie.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous_aligned;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use crate::packed::{BLOCK, GgmlType};
use crate::{AttentionOptions, PackedTensor, RopeLayout, ToyBackend, reference};

/// Weight block formats, as comptime kernel parameters.
const FMT_Q8_0: u32 = 0;
const FMT_Q4_0: u32 = 1;
const FMT_Q4_1: u32 = 2;

/// Largest number of activation rows the matrix-vector kernel takes; more rows go to the tiled
/// kernel, which reads each weight tile once for 16 rows.
const MATVEC_MAX_ROWS: usize = 8;
/// Units per cube of the matrix-vector kernel: they stride over a row's blocks.
const MATVEC_UNITS: u32 = 64;
/// Output tile of the tiled quantized matmul: TILE × TILE outputs, one per unit.
const TILE: u32 = 16;
/// Keys scored per step of the attention kernel (one per unit).
const ATTN_KEYS: u32 = 32;
/// The largest cube count per grid dimension every runtime accepts (wgpu's limit).
const MAX_CUBES: usize = 65535;

// ---------------------------------------------------------------------------------------------
// Shared device functions
// ---------------------------------------------------------------------------------------------

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

/// An i8 stored in the low byte of `b` (0..=255), sign-extended.
#[cube]
fn sext8(b: u32) -> i32 {
    let s = i32::cast_from(b);
    s - ((s >> 7) << 8)
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

/// Split `n` cubes over the x and y grid dimensions (each at most 65535).
fn spread(n: usize) -> (u32, u32) {
    let x = n.clamp(1, MAX_CUBES);
    (x as u32, n.div_ceil(x).max(1) as u32)
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
    let mut partial = SharedMemory::<f32>::new(units as usize);
    partial[lane] = acc;
    sync_cube();
    let mut width = (units / 2).runtime() as usize;
    while width > 0 {
        if lane < width {
            let other = partial[lane + width];
            partial[lane] += other;
        }
        sync_cube();
        width /= 2;
    }
    if lane == 0 {
        out[row * out.stride(0) + n * out.stride(1)] = F::cast_from(partial[0]);
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

fn qmatmul<R: CubeRuntime>(
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

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

/// One unit per output element of `x[b, h, t, d]`: rotated pairs read both members, the dims
/// past the rotated ones are copied.
#[cube(launch)]
fn rope_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<f32>,
    sin: &Tensor<f32>,
    out: &mut Tensor<F>,
    #[comptime] neox: bool,
    #[define(F)] _dtype: StorageType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= out.len() {
        terminate!();
    }
    let d = out.shape(3);
    let t_len = out.shape(2);
    let h_len = out.shape(1);
    let di = pos % d;
    let ti = (pos / d) % t_len;
    let hi = (pos / (d * t_len)) % h_len;
    let bi = pos / (d * t_len * h_len);
    let half = cos.shape(1);
    let base = bi * x.stride(0) + hi * x.stride(1) + ti * x.stride(2);
    let xs = x.stride(3);
    let mut y = x[base + di * xs];
    if di < 2 * half {
        let mut i = di / 2;
        let mut first = di % 2 == 0;
        let mut partner = di + 1;
        if comptime!(neox) {
            i = di % half;
            first = di < half;
            partner = di + half;
            if !first {
                partner = di - half;
            }
        } else if !first {
            partner = di - 1;
        }
        let c = F::cast_from(cos[ti * cos.stride(0) + i]);
        let s = F::cast_from(sin[ti * sin.stride(0) + i]);
        let other = x[base + partner * xs];
        if first {
            y = y * c - other * s;
        } else {
            y = other * s + y * c;
        }
    }
    out[pos] = y;
}

fn rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    layout: RopeLayout,
) -> CubeTensor<R> {
    let cos = into_contiguous_aligned(cos);
    let sin = into_contiguous_aligned(sin);
    let out = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), x.shape(), x.dtype);
    let total = x.shape().num_elements();
    let units = 256u32;
    let (cx, cy) = spread(total.div_ceil(units as usize));
    rope_kernel::launch::<R>(
        &x.client,
        CubeCount::Static(cx, cy, 1),
        CubeDim::new_1d(units),
        x.clone().into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        layout == RopeLayout::Neox,
        x.dtype.into(),
    );
    out
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

/// Flash attention, one cube per (query row, head, batch): the units score ATTN_KEYS keys at a
/// time, and the row keeps a running max and sum (online softmax), so memory is O(head_dim)
/// whatever the sequence length. Query head `h` reads K/V head `h / (heads / kv_heads)`.
/// Only the keys the row may see are visited: up to its position, and within the sliding window.
/// A running max of -3e38 stands for "no key yet" (WGSL has no infinity literals).
#[cube(launch)]
fn attention_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    q_offset: u32,
    window: u32,
    #[comptime] head_dim: u32,
    #[define(F)] _dtype: StorageType,
) {
    let keys = ATTN_KEYS as usize;
    let hd = head_dim as usize;
    let i = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let lane = UNIT_POS_X as usize;
    let group = q.shape(1) / k.shape(1);
    let hk = h / group;
    let tk = k.shape(2);

    let mut q_sm = SharedMemory::<f32>::new(head_dim as usize);
    let mut acc = SharedMemory::<f32>::new(head_dim as usize);
    let mut scores = SharedMemory::<f32>::new(ATTN_KEYS as usize);
    let mut probs = SharedMemory::<f32>::new(ATTN_KEYS as usize);

    let q_base = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
    let mut e = lane;
    while e < hd {
        q_sm[e] = f32::cast_from(q[q_base + e * q.stride(3)]);
        acc[e] = 0.0;
        e += keys;
    }
    sync_cube();

    // Keys j with first <= j < last are visible to this row.
    let pos = i + q_offset as usize;
    let mut last = pos + 1;
    if last > tk {
        last = tk;
    }
    let mut first = 0usize;
    if window > 0 && pos + 1 > window as usize {
        first = pos + 1 - window as usize;
    }
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);

    let mut run_max = f32::new(-3.0e38);
    let mut run_sum = 0.0f32;
    let mut j0 = first;
    while j0 < last {
        // Score this unit's key.
        let j = j0 + lane;
        let visible = j < last;
        let mut s = f32::new(-3.0e38);
        if visible {
            let row = k_base + j * k.stride(2);
            let mut dot = 0.0f32;
            for d in 0..hd {
                dot += q_sm[d] * f32::cast_from(k[row + d * k.stride(3)]);
            }
            s = dot * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
        }
        scores[lane] = s;
        sync_cube();

        // Online softmax: every unit computes the same max, correction and sum.
        let mut tile_max = f32::new(-3.0e38);
        for u in 0..keys {
            let su = scores[u];
            if su > tile_max {
                tile_max = su;
            }
        }
        let mut new_max = run_max;
        if tile_max > new_max {
            new_max = tile_max;
        }
        let correction = (run_max - new_max).exp();
        let mut p = 0.0f32;
        if visible {
            p = (s - new_max).exp();
        }
        probs[lane] = p;
        sync_cube();
        let mut tile_sum = 0.0f32;
        for u in 0..keys {
            tile_sum += probs[u];
        }
        run_sum = run_sum * correction + tile_sum;
        run_max = new_max;

        // This unit's output dims: acc = acc * correction + Σ p_j v_j.
        let mut e = lane;
        while e < hd {
            let mut sum = 0.0f32;
            for u in 0..keys {
                let j = j0 + u;
                if j < last {
                    sum += probs[u] * f32::cast_from(v[v_base + j * v.stride(2) + e * v.stride(3)]);
                }
            }
            acc[e] = acc[e] * correction + sum;
            e += keys;
        }
        sync_cube();
        j0 += keys;
    }

    let o_base = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
    let mut e = lane;
    while e < hd {
        out[o_base + e * out.stride(3)] = F::cast_from(acc[e] / run_sum);
        e += keys;
    }
}

/// Flash attention for many query rows (prefill, training): a cube takes `rows` consecutive
/// query rows of one head and walks the keys in tiles of `keys`, staging each K and V tile in
/// shared memory once for all its rows. Unit (u, r) scores key u for row r; every unit of row r
/// keeps the same running max and sum (online softmax) and owns the output dims
/// `u, u + keys, …` of its row.
#[cube(launch)]
fn attention_tiled_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    scale: f32,
    softcap: f32,
    q_offset: u32,
    window: u32,
    #[comptime] head_dim: u32,
    #[comptime] keys: u32,
    #[comptime] rows: u32,
    #[define(F)] _dtype: StorageType,
) {
    let hd = head_dim as usize;
    let kn = keys as usize;
    let rn = rows as usize;
    let u = UNIT_POS_X as usize;
    let r = UNIT_POS_Y as usize;
    let unit = r * kn + u;
    let units = kn * rn;
    let i0 = CUBE_POS_X as usize * rn;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let tq = q.shape(2);
    let tk = k.shape(2);
    let group = q.shape(1) / k.shape(1);
    let hk = h / group;

    let mut q_sm = SharedMemory::<f32>::new(head_dim as usize * rows as usize);
    let mut acc = SharedMemory::<f32>::new(head_dim as usize * rows as usize);
    let mut k_sm = SharedMemory::<f32>::new(head_dim as usize * keys as usize);
    let mut v_sm = SharedMemory::<f32>::new(head_dim as usize * keys as usize);
    let mut probs = SharedMemory::<f32>::new(keys as usize * rows as usize);

    // Stage the rows' queries (zeros past the end) and clear the accumulators.
    let mut idx = unit;
    while idx < rn * hd {
        let rr = idx / hd;
        let e = idx % hd;
        let i = i0 + rr;
        let mut val = 0.0f32;
        if i < tq {
            val = f32::cast_from(
                q[b * q.stride(0) + h * q.stride(1) + i * q.stride(2) + e * q.stride(3)],
            );
        }
        q_sm[idx] = val;
        acc[idx] = 0.0;
        idx += units;
    }

    // This row's visible keys, and the span of keys any row of the cube sees.
    let i = i0 + r;
    let pos = i + q_offset as usize;
    let mut first_own = 0usize;
    if window > 0 && pos + 1 > window as usize {
        first_own = pos + 1 - window as usize;
    }
    let mut last_row = i0 + rn;
    if last_row > tq {
        last_row = tq;
    }
    let mut span_end = last_row - 1 + q_offset as usize + 1;
    if span_end > tk {
        span_end = tk;
    }
    let mut span_start = 0usize;
    if window > 0 && i0 + q_offset as usize + 1 > window as usize {
        span_start = i0 + q_offset as usize + 1 - window as usize;
    }
    let k_base = b * k.stride(0) + hk * k.stride(1);
    let v_base = b * v.stride(0) + hk * v.stride(1);
    sync_cube();

    let mut run_max = f32::new(-3.0e38);
    let mut run_sum = 0.0f32;
    let mut j0 = span_start;
    while j0 < span_end {
        // Stage K and V rows j0 .. j0 + keys (zeros past the end).
        let mut idx = unit;
        while idx < kn * hd {
            let jj = idx / hd;
            let e = idx % hd;
            let j = j0 + jj;
            let mut kv = 0.0f32;
            let mut vv = 0.0f32;
            if j < tk {
                kv = f32::cast_from(k[k_base + j * k.stride(2) + e * k.stride(3)]);
                vv = f32::cast_from(v[v_base + j * v.stride(2) + e * v.stride(3)]);
            }
            k_sm[idx] = kv;
            v_sm[idx] = vv;
            idx += units;
        }
        sync_cube();

        let j = j0 + u;
        let visible = i < tq && j < tk && j <= pos && j >= first_own;
        let mut s = f32::new(-3.0e38);
        if visible {
            let mut dot = 0.0f32;
            for e in 0..hd {
                dot += q_sm[r * hd + e] * k_sm[u * hd + e];
            }
            s = dot * scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
        }
        probs[r * kn + u] = s;
        sync_cube();
        let mut tile_max = f32::new(-3.0e38);
        for uu in 0..kn {
            let su = probs[r * kn + uu];
            if su > tile_max {
                tile_max = su;
            }
        }
        sync_cube();
        let mut new_max = run_max;
        if tile_max > new_max {
            new_max = tile_max;
        }
        let correction = (run_max - new_max).exp();
        let mut p = 0.0f32;
        if visible {
            p = (s - new_max).exp();
        }
        probs[r * kn + u] = p;
        sync_cube();
        let mut tile_sum = 0.0f32;
        for uu in 0..kn {
            tile_sum += probs[r * kn + uu];
        }
        run_sum = run_sum * correction + tile_sum;
        run_max = new_max;
        let mut e = u;
        while e < hd {
            let mut sum = 0.0f32;
            for uu in 0..kn {
                sum += probs[r * kn + uu] * v_sm[uu * hd + e];
            }
            acc[r * hd + e] = acc[r * hd + e] * correction + sum;
            e += kn;
        }
        sync_cube();
        j0 += kn;
    }

    if i < tq {
        let o_base = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let mut e = u;
        while e < hd {
            out[o_base + e * out.stride(3)] = F::cast_from(acc[r * hd + e] / run_sum);
            e += kn;
        }
    }
}

fn attention<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    options: AttentionOptions,
) -> CubeTensor<R> {
    let [b, h, tq, d] = q.shape().dims::<4>();
    let out = empty_device_contiguous_dtype(q.client.clone(), q.device.clone(), q.shape(), q.dtype);
    let (scale, softcap) = (options.scale, options.softcap.unwrap_or(0.0));
    let q_offset = options.q_offset as u32;
    let window = options.window.map_or(0, |w| w as u32);
    // Tiles for many rows: 16 keys × 8 rows, or 8 × 4 for heads wider than 128, when the
    // staged Q, K, V and accumulators fit the device's shared memory.
    let (keys, rows) = if d <= 128 { (16u32, 8u32) } else { (8, 4) };
    let shared_bytes = 4 * (2 * d * (keys + rows) as usize + (keys * rows) as usize);
    let max_shared = q.client.properties().hardware.max_shared_memory_size;
    if tq >= 2 * rows as usize && shared_bytes <= max_shared {
        let tiles = tq.div_ceil(rows as usize);
        assert!(
            tiles <= MAX_CUBES && h <= MAX_CUBES && b <= MAX_CUBES,
            "attention grid too large"
        );
        attention_tiled_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(tiles as u32, h as u32, b as u32),
            CubeDim::new_2d(keys, rows),
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            softcap,
            q_offset,
            window,
            d as u32,
            keys,
            rows,
            q.dtype.into(),
        );
    } else {
        assert!(
            tq <= MAX_CUBES && h <= MAX_CUBES && b <= MAX_CUBES,
            "attention grid too large"
        );
        attention_kernel::launch::<R>(
            &q.client,
            CubeCount::Static(tq as u32, h as u32, b as u32),
            CubeDim::new_1d(ATTN_KEYS),
            q.clone().into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            softcap,
            q_offset,
            window,
            d as u32,
            q.dtype.into(),
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The overrides
// ---------------------------------------------------------------------------------------------

/// Whether `TOY_CUBE_REFERENCE` (a comma-separated list of `matmul`, `rope`, `attention`, or
/// `all`) sends `op` to its reference body instead of the kernel: a switch for narrowing down a
/// wrong result on a new device to one kernel.
fn use_reference(op: &str) -> bool {
    static LIST: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let list = LIST.get_or_init(|| {
        std::env::var("TOY_CUBE_REFERENCE")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .collect()
    });
    list.iter().any(|s| s == op || s == "all")
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> ToyBackend
    for CubeBackend<R, F, I, BT>
{
    fn packed_matmul(x: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        let fmt = match w.ty {
            GgmlType::Q8_0 => FMT_Q8_0,
            GgmlType::Q4_0 => FMT_Q4_0,
            GgmlType::Q4_1 => FMT_Q4_1,
            _ => return reference::packed_matmul::<Self>(x, w),
        };
        if use_reference("matmul") {
            return reference::packed_matmul::<Self>(x, w);
        }
        let scales = w.scales.expect("a split layout has scales");
        qmatmul(x, w.words, scales, w.mins, fmt)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        if use_reference("rope") || cos.dtype != DType::F32 || sin.dtype != DType::F32 {
            return reference::rope::<Self>(x, cos, sin, layout);
        }
        rope(x, cos, sin, layout)
    }

    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        if use_reference("attention") {
            return reference::attention::<Self>(q, k, v, options);
        }
        attention(q, k, v, options)
    }
}
