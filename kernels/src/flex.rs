//! Native overrides for burn's Flex backend (`--backend cpu`).
//!
//! The quantized matmuls follow ggml's CPU algorithm: each activation row is quantized to
//! 8-bit blocks of 32 (scale `amax / 127` rounded to f16, quants rounded half to even — ggml's
//! Q8_0, or Q8_1 which also keeps `scale * Σq` for Q4_1's offsets), each block's dot product with
//! the weight block is an exact integer sum, and the sum is scaled once by
//! `d_weight * d_activation`. That is both much faster than dequantizing the weight and the
//! way to reproduce llama.cpp's numbers. Rows of the output are computed in parallel with rayon.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, TensorData, TensorMetadata};
use half::f16;
use rayon::prelude::*;

use crate::quant::BLOCK;
use crate::{ToyBackend, reference};

impl ToyBackend for Flex {
    fn q8_0_matmul(x: FloatTensor<Self>, words: IntTensor<Self>, scales: FloatTensor<Self>) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(ops) => ops.run(dot_q8_0),
            None => reference::q8_0_matmul::<Self>(x, words, scales),
        }
    }

    fn q4_0_matmul(x: FloatTensor<Self>, words: IntTensor<Self>, scales: FloatTensor<Self>) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(ops) => ops.run(dot_q4_0),
            None => reference::q4_0_matmul::<Self>(x, words, scales),
        }
    }

    fn q4_1_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
        mins: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match Operands::new(&x, &words, &scales) {
            Some(mut ops) if mins.dtype() == DType::F32 && mins.shape() == scales.shape() => {
                ops.mins = Some(mins.to_contiguous());
                ops.run(dot_q4_1)
            }
            _ => reference::q4_1_matmul::<Self>(x, words, scales, mins),
        }
    }
}

/// An activation row quantized to 8-bit blocks (ggml's Q8_0 / Q8_1).
struct QuantRow {
    quants: Vec<i8>,
    scales: Vec<f32>,
    /// Q8_1's `f16(d * Σq)` per block: what Q4_1's offsets multiply.
    sums: Vec<f32>,
}

/// ggml's `quantize_row_q8_0` / `quantize_row_q8_1` (x86 path): `d = amax / 127` stored as
/// f16, `q = round_half_even(x * 127 / amax)`, and for Q8_1 `s = f16(d * Σq)` with the unrounded d.
fn quantize_row(x: &[f32]) -> QuantRow {
    let mut quants = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / BLOCK);
    let mut sums = Vec::with_capacity(x.len() / BLOCK);
    for block in x.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        scales.push(f16::from_f32(d).to_f32());
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let start = quants.len();
        quants.extend(block.iter().map(|v| (v * id).round_ties_even() as i8));
        let sum: i32 = quants[start..].iter().map(|&q| q as i32).sum();
        sums.push(f16::from_f32(d * sum as f32).to_f32());
    }
    QuantRow { quants, scales, sums }
}

/// Dot product of a quantized activation row with one Q8_0 weight row (bytes = i8 quants).
fn dot_q8_0(x: &QuantRow, w_bytes: &[u8], w_scales: &[f32], _: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (b, (xq, wq)) in x.quants.chunks_exact(BLOCK).zip(w_bytes.chunks_exact(BLOCK)).enumerate() {
        let mut sumi = 0i32;
        for i in 0..BLOCK {
            sumi += xq[i] as i32 * (wq[i] as i8) as i32;
        }
        sum += sumi as f32 * (w_scales[b] * x.scales[b]);
    }
    sum
}

/// Dot product of a quantized activation row with one Q4_0 weight row (16 nibble bytes a block).
fn dot_q4_0(x: &QuantRow, w_bytes: &[u8], w_scales: &[f32], _: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (b, (xq, wq)) in x.quants.chunks_exact(BLOCK).zip(w_bytes.chunks_exact(BLOCK / 2)).enumerate() {
        let mut sumi = 0i32;
        for j in 0..BLOCK / 2 {
            let lo = (wq[j] & 0x0F) as i32 - 8;
            let hi = (wq[j] >> 4) as i32 - 8;
            sumi += lo * xq[j] as i32 + hi * xq[j + BLOCK / 2] as i32;
        }
        sum += sumi as f32 * (w_scales[b] * x.scales[b]);
    }
    sum
}

/// Dot product of a Q8_1 activation row with one Q4_1 weight row: per block
/// `d_w * d_x * Σ q_w q_x + m_w * s_x` (ggml's `vec_dot_q4_1_q8_1`).
fn dot_q4_1(x: &QuantRow, w_bytes: &[u8], w_scales: &[f32], w_mins: &[f32]) -> f32 {
    let mut sum = 0.0f32;
    for (b, (xq, wq)) in x.quants.chunks_exact(BLOCK).zip(w_bytes.chunks_exact(BLOCK / 2)).enumerate() {
        let mut sumi = 0i32;
        for j in 0..BLOCK / 2 {
            sumi += (wq[j] & 0x0F) as i32 * xq[j] as i32 + (wq[j] >> 4) as i32 * xq[j + BLOCK / 2] as i32;
        }
        sum += (w_scales[b] * x.scales[b]) * sumi as f32 + w_mins[b] * x.sums[b];
    }
    sum
}

/// Host views of the operands, when they are in the layout the native loops need.
struct Operands {
    x: Vec<f32>,
    m: usize,
    k: usize,
    n: usize,
    words: FlexTensor,
    scales: FlexTensor,
    mins: Option<FlexTensor>,
}

impl Operands {
    fn new(x: &FlexTensor, words: &FlexTensor, scales: &FlexTensor) -> Option<Self> {
        let (xs, ws, ss) = (x.shape(), words.shape(), scales.shape());
        if x.dtype() != DType::F32 || scales.dtype() != DType::F32 || xs.num_dims() != 2 || ws.num_dims() != 2 {
            return None;
        }
        let (m, k, n) = (xs[0], xs[1], ws[0]);
        if k % BLOCK != 0 || ss[0] != n || ss[1] != k / BLOCK {
            return None;
        }
        let x = x.to_contiguous();
        let words = words.to_contiguous();
        let scales = scales.to_contiguous();
        if !matches!(words.dtype(), DType::U32 | DType::I32) {
            return None;
        }
        Some(Operands { x: x.as_slice::<f32>()?.to_vec(), m, k, n, words, scales, mins: None })
    }

    fn word_bytes(&self) -> &[u8] {
        match self.words.dtype() {
            DType::U32 => bytemuck::cast_slice(self.words.as_slice::<u32>().expect("contiguous u32")),
            _ => bytemuck::cast_slice(self.words.as_slice::<i32>().expect("contiguous i32")),
        }
    }

    fn run(self, dot: fn(&QuantRow, &[u8], &[f32], &[f32]) -> f32) -> FlexTensor {
        let (m, k, n) = (self.m, self.k, self.n);
        let rows: Vec<QuantRow> = self.x.chunks_exact(k).map(quantize_row).collect();
        let bytes = self.word_bytes();
        let row_bytes = bytes.len() / n;
        let scales = self.scales.as_slice::<f32>().expect("contiguous f32");
        let mins = self.mins.as_ref().map(|t| t.as_slice::<f32>().expect("contiguous f32")).unwrap_or(&[]);
        let blocks = k / BLOCK;
        // Output column j (weight row j) for every activation row, computed in parallel over j.
        let mut out_t = vec![0.0f32; n * m];
        out_t.par_chunks_mut(m).enumerate().for_each(|(j, col)| {
            let w = &bytes[j * row_bytes..(j + 1) * row_bytes];
            let s = &scales[j * blocks..(j + 1) * blocks];
            let mn = if mins.is_empty() { &[][..] } else { &mins[j * blocks..(j + 1) * blocks] };
            for (i, row) in rows.iter().enumerate() {
                col[i] = dot(row, w, s, mn);
            }
        });
        let out = if m == 1 {
            out_t
        } else {
            let mut out = vec![0.0f32; m * n];
            for j in 0..n {
                for i in 0..m {
                    out[i * n + j] = out_t[j * m + i];
                }
            }
            out
        };
        FlexTensor::from_data(TensorData::new(out, [m, n]))
    }
}
