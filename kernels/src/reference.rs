//! Reference bodies of the [`ToyBackend`](crate::ToyBackend) ops, in plain burn tensor ops.
//!
//! These are the specification: short, obviously right, and run by any backend. Faster
//! implementations are tested against them.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{
    Bool, DType, ElementConversion, FloatDType, IndexingUpdateOp, Int, Shape, Tensor, TensorData,
    TensorMetadata, TensorPrimitive, activation,
};

use crate::packed::{BLOCK, GgmlType, HostPackedView, PackedTensor, RowLayout, dequantize_rows};
use crate::{AdamWStep, AttentionOptions, RopeLayout};

fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Byte `b` (0..4) of every u32 word, as an Int tensor of values 0..=255. Works for U32 words
/// and for words bit-cast to I32/I64 (the mask discards sign extension).
fn word_byte<B: Backend>(words: &Tensor<B, 2, Int>, b: usize) -> Tensor<B, 2, Int> {
    words
        .clone()
        .bitwise_right_shift_scalar(((8 * b) as i64).elem())
        .bitwise_and_scalar(0xFF.elem())
}

/// Dequantize a packed Q8_0 weight (`words[n, k/4]`, `scales[n, k/32]`) to `[n, k]`.
pub fn dequant_q8_0<B: Backend>(words: Tensor<B, 2, Int>, scales: Tensor<B, 2>) -> Tensor<B, 2> {
    let [n, kw] = words.dims();
    let k = kw * 4;
    let bytes: Vec<_> = (0..4).map(|b| word_byte(&words, b)).collect();
    // Byte b of word j is element 4j + b.
    let u = Tensor::stack::<3>(bytes, 2)
        .reshape([n, k])
        .float()
        .cast(scales.dtype());
    // i8 sign. (`float()` makes the device's default float type — f16 under `--dtype f16` —
    // so the mask is cast to the quants' type like them.)
    let negative = u.clone().greater_equal_elem(128.0).float().cast(u.dtype());
    let q = u - negative.mul_scalar(256.0);
    (q.reshape([n, k / BLOCK, BLOCK]) * scales.unsqueeze_dim::<3>(2)).reshape([n, k])
}

/// The unsigned nibbles of packed Q4 words, `[n, k/32, 32]` in ggml's element order.
fn q4_nibbles<B: Backend>(words: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let [n, kw] = words.dims();
    let k = kw * 8;
    // Nibble s of a word: s = 2b is the low nibble of byte b, s = 2b + 1 its high nibble.
    // Order them (low nibbles of bytes 0..4, then high nibbles) so that a block's 4 words
    // become [half, word, byte]: element half*16 + 4*word + byte, ggml's Q4_0 order.
    let nibbles: Vec<_> = [0, 2, 4, 6, 1, 3, 5, 7]
        .into_iter()
        .map(|s| {
            words
                .clone()
                .bitwise_right_shift_scalar(((4 * s) as i64).elem())
                .bitwise_and_scalar(0xF.elem())
        })
        .collect();
    Tensor::stack::<3>(nibbles, 2)
        .reshape([n, k / BLOCK, 4, 2, 4])
        .permute([0, 1, 3, 2, 4])
        .reshape([n, k / BLOCK, BLOCK])
        .float()
}

/// Dequantize a packed Q4_0 weight (`words[n, k/8]`, `scales[n, k/32]`) to `[n, k]`.
pub fn dequant_q4_0<B: Backend>(words: Tensor<B, 2, Int>, scales: Tensor<B, 2>) -> Tensor<B, 2> {
    let [n, kw] = words.dims();
    let q = q4_nibbles(words).cast(scales.dtype()).sub_scalar(8.0);
    (q * scales.unsqueeze_dim::<3>(2)).reshape([n, kw * 8])
}

/// Dequantize a packed Q4_1 weight to `[n, k]`: `scale * q + min` per block.
pub fn dequant_q4_1<B: Backend>(
    words: Tensor<B, 2, Int>,
    scales: Tensor<B, 2>,
    mins: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let [n, kw] = words.dims();
    let q = q4_nibbles(words).cast(scales.dtype());
    (q * scales.unsqueeze_dim::<3>(2) + mins.unsqueeze_dim::<3>(2)).reshape([n, kw * 8])
}

/// `x · wᵀ` in the activations' float type (the dequantized weights are f32, like the packed
/// scales; with `--dtype f16` the activations are f16).
fn matmul_transposed<B: Backend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> FloatTensor<B> {
    let w = w.cast(x.dtype());
    x.matmul(w.transpose()).into_primitive().tensor()
}

/// `x · dequant(w)ᵀ`.
pub fn packed_matmul<B: Backend>(x: FloatTensor<B>, w: PackedTensor<B>) -> FloatTensor<B> {
    matmul_transposed(float(x), packed_dequantize::<B>(w))
}

/// `dy · dequant(w)`.
pub fn packed_matmul_backward<B: Backend>(
    dy: FloatTensor<B>,
    w: PackedTensor<B>,
) -> FloatTensor<B> {
    let dy = float::<B, 2>(dy);
    let w = packed_dequantize::<B>(w).cast(dy.dtype());
    dy.matmul(w).into_primitive().tensor()
}

/// Rows `ids` of `w`, dequantized: the packed rows are selected first, so only they are
/// widened.
pub fn packed_rows<B: Backend>(w: PackedTensor<B>, ids: IntTensor<B>) -> FloatTensor<B> {
    let w = deinterleaved(w);
    let ids = Tensor::<B, 1, Int>::from_primitive(ids);
    let rows = |t: IntTensor<B>| Tensor::<B, 2, Int>::from_primitive(t).select(0, ids.clone());
    let rows_f = |t: FloatTensor<B>| float::<B, 2>(t).select(0, ids.clone());
    let selected = PackedTensor {
        ty: w.ty,
        cols: w.cols,
        words: rows(w.words).into_primitive(),
        scales: w.scales.map(|t| rows_f(t).into_primitive().tensor()),
        mins: w.mins.map(|t| rows_f(t).into_primitive().tensor()),
        repackable: w.repackable,
        layout: RowLayout::Rows,
    };
    packed_dequantize::<B>(selected).into_primitive().tensor()
}

/// `w` widened to f32 `[rows, cols]`. The split layouts (Q8_0, Q4_0, Q4_1) are dequantized with
/// tensor ops on the device; the others on the host with `toy_quant`, ggml's `dequantize_row_*`.
pub fn packed_dequantize<B: Backend>(w: PackedTensor<B>) -> Tensor<B, 2> {
    // The split layouts are widened by tensor ops on rows in the file's order; the others by
    // `dequantize_rows`, which reads any layout.
    let w = match crate::packed::is_split(w.ty) {
        true => deinterleaved(w),
        false => w,
    };
    let words = Tensor::<B, 2, Int>::from_primitive(w.words);
    let scales = || float::<B, 2>(w.scales.clone().expect("a split layout has scales"));
    match w.ty {
        GgmlType::Q8_0 => dequant_q8_0(words, scales()),
        GgmlType::Q4_0 => dequant_q4_0(words, scales()),
        GgmlType::Q4_1 => dequant_q4_1(
            words,
            scales(),
            float(w.mins.clone().expect("Q4_1 has mins")),
        ),
        ty => {
            let device = words.device();
            let [rows, _] = words.dims();
            let host = host_words(words.into_data());
            let view = HostPackedView {
                ty,
                rows,
                cols: w.cols,
                words: &host,
                scales: &[],
                mins: &[],
                layout: w.layout,
            };
            let values = dequantize_rows(&view, 0..rows);
            Tensor::from_data(
                TensorData::new(values, [rows, w.cols]),
                (&device, DType::F32),
            )
        }
    }
}

/// `w` in the file's row layout: an interleaved weight (`packed::RowLayout`) read back, put
/// back in row order (its words, and a split type's scales) and uploaded again; any other
/// weight as it is.
pub fn deinterleaved<B: Backend>(w: PackedTensor<B>) -> PackedTensor<B> {
    if w.layout == RowLayout::Rows {
        return w;
    }
    let words = Tensor::<B, 2, Int>::from_primitive(w.words);
    let (device, [rows, per_row]) = (words.device(), words.dims());
    let host = host_words(words.into_data());
    let plain = crate::packed::deinterleave_rows(w.layout, w.ty, &host, rows, w.cols);
    let words = Tensor::<B, 2, Int>::from_data(
        TensorData::new(plain, [rows, per_row]),
        (&device, DType::U32),
    );
    let scales = w.scales.map(|t| {
        let t = float::<B, 2>(t);
        let shape = t.dims();
        let host: Vec<f32> = t
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("f32 scales");
        let plain = crate::packed::deinterleave_scales(w.layout, &host, rows, w.cols);
        Tensor::<B, 2>::from_data(TensorData::new(plain, shape), (&device, DType::F32))
            .into_primitive()
            .tensor()
    });
    PackedTensor {
        words: words.into_primitive(),
        scales,
        layout: RowLayout::Rows,
        ..w
    }
}

/// Packed words read back from a device, whatever integer type holds their bits.
pub fn host_words(data: TensorData) -> Vec<u32> {
    match data.dtype {
        DType::U32 => data.into_vec::<u32>().expect("u32 data"),
        DType::I32 => data.iter::<i32>().map(|w| w as u32).collect(),
        _ => data.iter::<i64>().map(|w| w as u32).collect(),
    }
}

/// `x[m, k] · w[n, k]ᵀ` (see `ToyBackend::dense_linear`).
pub fn dense_linear<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B> {
    let y = float::<B, 2>(x).matmul(float::<B, 2>(w).transpose());
    y.into_primitive().tensor()
}

/// `dx = dy · w` and, when `x` is given, `dw = dyᵀ · x` (see
/// `ToyBackend::dense_linear_backward`).
pub fn dense_linear_backward<B: Backend>(
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    x: Option<FloatTensor<B>>,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let dy = float::<B, 2>(dy);
    let dw = x.map(|x| {
        let dw = dy.clone().transpose().matmul(float::<B, 2>(x));
        dw.into_primitive().tensor()
    });
    let dx = dy.matmul(float::<B, 2>(w));
    (dx.into_primitive().tensor(), dw)
}

/// `x / sqrt(mean(x²) + eps) * weight` over the last dim, computed in f32 and cast back to the
/// activations' type.
pub fn rms_norm<B: Backend>(x: FloatTensor<B>, weight: FloatTensor<B>, eps: f32) -> FloatTensor<B> {
    let shape = x.shape();
    let d = shape[shape.num_dims() - 1];
    let x: Tensor<B, 2> = float(B::float_reshape(
        x,
        Shape::new([shape.num_elements() / d, d]),
    ));
    // The mean of squares in f32 whatever the activation type: squares of f16 activations
    // overflow past 256 (as HF's LlamaRMSNorm, which upcasts too).
    let dtype = x.dtype();
    let x32 = x.cast(FloatDType::F32);
    let scale = rms_scale(x32.clone(), eps);
    let weight = float::<B, 1>(weight).cast(FloatDType::F32);
    let y = (x32 * scale * weight.unsqueeze::<2>()).cast(dtype);
    B::float_reshape(y.into_primitive().tensor(), shape)
}

/// `1 / sqrt(mean(x²) + eps)` of each row of `x[rows, d]`: `[rows, 1]`.
fn rms_scale<B: Backend>(x: Tensor<B, 2>, eps: f32) -> Tensor<B, 2> {
    x.square().mean_dim(1).add_scalar(eps).sqrt().recip()
}

/// The gradients `(dx, dweight)` of `rms_norm` (see `ToyBackend::rms_norm_backward`), in f32
/// as the forward; `dweight` only when `weight_grad`.
pub fn rms_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f32,
    dy: FloatTensor<B>,
    weight_grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let shape = x.shape();
    let d = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / d;
    let flat = |t| float::<B, 2>(B::float_reshape(t, Shape::new([rows, d])));
    let (x, dy) = (flat(x), flat(dy));
    let (dtype, weight_dtype) = (x.dtype(), weight.dtype());
    // In f32, as the forward.
    let (x, dy) = (x.cast(FloatDType::F32), dy.cast(FloatDType::F32));
    let r = rms_scale(x.clone(), eps);
    let w = float::<B, 1>(weight).cast(FloatDType::F32).unsqueeze::<2>();
    let g = dy.clone() * w;
    let mean_gx = (g.clone() * x.clone()).mean_dim(1);
    let dx = (g - x.clone() * r.clone().square() * mean_gx) * r.clone();
    let dweight = weight_grad.then(|| {
        (dy * x * r)
            .sum_dim(0)
            .reshape([d])
            .cast(weight_dtype)
            .into_primitive()
            .tensor()
    });
    let dx = B::float_reshape(dx.cast(dtype).into_primitive().tensor(), shape);
    (dx, dweight)
}

/// `silu(gate) * up`, elementwise.
pub fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let shape = up.shape();
    let flat = |t| float::<B, 1>(B::float_reshape(t, Shape::new([shape.num_elements()])));
    let y = activation::silu(flat(gate)) * flat(up);
    B::float_reshape(y.into_primitive().tensor(), shape)
}

/// The gradients `(dgate, dup)` of `swiglu` (see `ToyBackend::swiglu_backward`).
pub fn swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = up.shape();
    let flat = |t| float::<B, 1>(B::float_reshape(t, Shape::new([shape.num_elements()])));
    let (g, u, dy) = (flat(gate), flat(up), flat(dy));
    let s = activation::sigmoid(g.clone());
    let d_up = dy.clone() * g.clone() * s.clone();
    let d_gate = dy * u * s.clone() * (g * s.neg().add_scalar(1.0)).add_scalar(1.0);
    let shaped = |t: Tensor<B, 1>| B::float_reshape(t.into_primitive().tensor(), shape.clone());
    (shaped(d_gate), shaped(d_up))
}

/// `x[b, t, heads · d]` as `[b, heads, t, d]`: a reshape and a swap of dims, no copy.
pub fn split_heads<B: Backend>(x: FloatTensor<B>, heads: usize) -> FloatTensor<B> {
    let x: Tensor<B, 3> = float(x);
    let [b, t, width] = x.dims();
    let heads = x.reshape([b, t, heads, width / heads]).swap_dims(1, 2);
    heads.into_primitive().tensor()
}

/// `x[b, heads, t, d]` as `[b, t, heads · d]`.
pub fn merge_heads<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let x: Tensor<B, 4> = float(x);
    let [b, heads, t, d] = x.dims();
    let merged = x.swap_dims(1, 2).reshape([b, t, heads * d]);
    merged.into_primitive().tensor()
}

/// Rotary embedding of `x[b, h, t, d]` by the f32 tables `cos[t, half]` and `sin[t, half]`, in
/// the activations' type: the first `2 · half` dims of each head rotate, the rest pass through.
pub fn rope<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    layout: RopeLayout,
) -> FloatTensor<B> {
    let x: Tensor<B, 4> = float(x);
    let [b, h, t, d] = x.dims();
    // The tables are f32; the rotation runs in the activations' type.
    let cos = float::<B, 2>(cos).cast(x.dtype());
    let half = cos.dims()[1];
    let rot = 2 * half;
    let cos = cos.reshape([1, 1, t, half]);
    let sin = float::<B, 2>(sin).cast(x.dtype()).reshape([1, 1, t, half]);

    let x_rot = x.clone().narrow(3, 0, rot);
    let (x0, x1) = match layout {
        RopeLayout::Interleaved => {
            let pairs = x_rot.reshape([b, h, t, half, 2]);
            (
                pairs.clone().narrow(4, 0, 1).reshape([b, h, t, half]),
                pairs.narrow(4, 1, 1).reshape([b, h, t, half]),
            )
        }
        RopeLayout::Neox => (
            x_rot.clone().narrow(3, 0, half),
            x_rot.narrow(3, half, half),
        ),
    };
    let y0 = x0.clone() * cos.clone() - x1.clone() * sin.clone();
    let y1 = x0 * sin + x1 * cos;
    let rotated = match layout {
        RopeLayout::Interleaved => Tensor::stack::<5>(vec![y0, y1], 4).reshape([b, h, t, rot]),
        RopeLayout::Neox => Tensor::cat(vec![y0, y1], 3),
    };
    let out = if rot < d {
        Tensor::cat(vec![rotated, x.narrow(3, rot, d - rot)], 3)
    } else {
        rotated
    };
    out.into_primitive().tensor()
}

/// Which keys each query row may not see: `[tq, tk]`, true = masked.
pub fn causal_mask(tq: usize, tk: usize, options: &AttentionOptions) -> Vec<bool> {
    let mut mask = Vec::with_capacity(tq * tk);
    for i in 0..tq {
        let pos = i + options.q_offset;
        for j in 0..tk {
            let future = j > pos;
            let too_old = options.window.is_some_and(|w| pos - j.min(pos) >= w);
            mask.push(future || too_old);
        }
    }
    mask
}

/// Softmax attention probabilities of query rows stacked per K/V head: `q_rows[b, h_kv, group·tq,
/// d]` (the `group` query heads sharing a K/V head, `tq` rows each) against `k[b, h_kv, tk, d]`,
/// giving `[b, h_kv, group·tq, tk]`; with a soft-cap, also `tanh(scores / cap)` (what the
/// backward pass differentiates through).
pub fn attention_probs<B: Backend>(
    q_rows: Tensor<B, 4>,
    k: Tensor<B, 4>,
    tq: usize,
    options: &AttentionOptions,
) -> (Tensor<B, 4>, Option<Tensor<B, 4>>) {
    let [b, h_kv, rows, _] = q_rows.dims();
    let tk = k.dims()[2];
    let group = rows / tq;
    let raw = q_rows.matmul(k.transpose()).mul_scalar(options.scale);
    let (scores, capped) = match options.softcap {
        Some(cap) => {
            let t = raw.div_scalar(cap).tanh();
            (t.clone().mul_scalar(cap), Some(t))
        }
        None => (raw, None),
    };
    let mask = causal_mask(tq, tk, options);
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [tq, tk]), &scores.device())
        .unsqueeze_dim::<3>(0)
        .expand([group, tq, tk])
        .reshape([1, 1, group * tq, tk])
        .expand([b, h_kv, group * tq, tk]);
    let probs = activation::softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 3);
    (probs, capped)
}

/// Query rows per chunk of the attention backward: the recomputed probabilities of one chunk
/// take `batch · heads · ROWS · keys` floats, so memory grows as O(T), not O(T²).
const BACKWARD_ROWS: usize = 64;

/// Gradients of attention w.r.t. q, k, v, from the saved inputs and `dO`, one chunk of
/// `BACKWARD_ROWS` query positions at a time (FlashAttention's recomputation, in tensor ops):
/// each chunk recomputes its probabilities against only the keys its rows can see (up to its
/// last position, and from its first row's window start), adds its `Pᵀ·dO` and `dSᵀ·Q` into the
/// K/V gradients and writes its own rows of `dQ`. Query heads that share a K/V head are stacked
/// as rows (as in the reference), so those products also sum over the group.
pub fn attention_backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    grad: FloatTensor<B>,
    options: &AttentionOptions,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let q: Tensor<B, 4> = float(q);
    let k: Tensor<B, 4> = float(k);
    let v: Tensor<B, 4> = float(v);
    let [b, h, tq, d] = q.dims();
    let [_, h_kv, tk, _] = k.dims();
    let group = h / h_kv;
    // [b, h_kv, group, tq, d]: a chunk of positions is a narrow of dim 3 for every group.
    let q = q.reshape([b, h_kv, group, tq, d]);
    let d_out = float::<B, 4>(grad).reshape([b, h_kv, group, tq, d]);
    let mut d_k = k.zeros_like();
    let mut d_v = v.zeros_like();
    let mut d_q = Vec::new();
    for i0 in (0..tq).step_by(BACKWARD_ROWS) {
        let rows = BACKWARD_ROWS.min(tq - i0);
        // Keys the chunk can see: j <= its last position, j > its first position − window.
        let j_end = tk.min(options.q_offset + i0 + rows);
        let j0 = options
            .window
            .map_or(0, |w| (options.q_offset + i0 + 1).saturating_sub(w));
        let keys = j_end - j0;
        // Positions relative to the first visible key: the mask depends on `pos − j` only.
        let chunk_options = AttentionOptions {
            q_offset: options.q_offset + i0 - j0,
            ..*options
        };
        let chunk = |t: &Tensor<B, 5>| {
            t.clone()
                .narrow(3, i0, rows)
                .reshape([b, h_kv, group * rows, d])
        };
        let (q_c, d_out_c) = (chunk(&q), chunk(&d_out));
        let k_c = k.clone().narrow(2, j0, keys);
        let v_c = v.clone().narrow(2, j0, keys);

        let (probs, capped) = attention_probs(q_c.clone(), k_c.clone(), rows, &chunk_options);
        let d_v_c = probs.clone().transpose().matmul(d_out_c.clone());
        let d_probs = d_out_c.matmul(v_c.transpose());
        let row_dot = (d_probs.clone() * probs.clone()).sum_dim(3);
        let mut d_scores = probs * (d_probs - row_dot);
        if let Some(t) = capped {
            // d/ds of cap·tanh(s/cap) = 1 − tanh².
            d_scores = d_scores * (t.clone() * t).neg().add_scalar(1.0);
        }
        let d_scores = d_scores.mul_scalar(options.scale);
        d_q.push(
            d_scores
                .clone()
                .matmul(k_c)
                .reshape([b, h_kv, group, rows, d]),
        );
        let d_k_c = d_scores.transpose().matmul(q_c);
        let range = [0..b, 0..h_kv, j0..j_end, 0..d];
        d_k = d_k
            .clone()
            .slice_assign(range.clone(), d_k.slice(range.clone()) + d_k_c);
        d_v = d_v
            .clone()
            .slice_assign(range.clone(), d_v.slice(range) + d_v_c);
    }
    let d_q = Tensor::cat(d_q, 3).reshape([b, h, tq, d]);
    (
        d_q.into_primitive().tensor(),
        d_k.into_primitive().tensor(),
        d_v.into_primitive().tensor(),
    )
}

/// [`crate::ToyBackend::write_tokens`] with burn's `slice_assign`.
pub fn write_tokens<B: Backend>(
    buffer: FloatTensor<B>,
    x: FloatTensor<B>,
    at: usize,
) -> FloatTensor<B> {
    let [b, h, t, d] = x.shape().dims::<4>();
    let slices = [0..b, 0..h, at..at + t, 0..d].map(burn::tensor::Slice::from);
    B::float_slice_assign(buffer, &slices, x)
}

/// Causal grouped-query attention (see `ToyBackend::attention`): the softmax of the masked
/// (and optionally soft-capped) scores times `v`, with the query heads that share a K/V head
/// stacked as rows against it instead of copying K/V.
pub fn attention<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    options: AttentionOptions,
) -> FloatTensor<B> {
    let q: Tensor<B, 4> = float(q);
    let k: Tensor<B, 4> = float(k);
    let v: Tensor<B, 4> = float(v);
    let [b, h, tq, d] = q.dims();
    let h_kv = k.dims()[1];
    let group = h / h_kv;
    // Grouped-query attention without copying K/V: the `group` query heads that share a K/V
    // head become `group * tq` rows against that head.
    let q = q.reshape([b, h_kv, group * tq, d]);
    let (probs, _) = attention_probs(q, k, tq, &options);
    probs
        .matmul(v)
        .reshape([b, h, tq, d])
        .into_primitive()
        .tensor()
}

/// Mean cross-entropy of `logits[n, vocab]` against `targets[n]` (see
/// [`ToyBackend::cross_entropy`](crate::ToyBackend::cross_entropy)), and each row's
/// `logsumexp` `[n, 1]`, which the backward needs. The arithmetic is burn's `log_softmax`
/// (`x - max` first, then `log Σ exp`) read at the target only, so the loss has the same bits as
/// `-mean(gather(log_softmax(x), target))` without the vocabulary-wide `log_softmax` tensor.
pub fn cross_entropy<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = float::<B, 2>(logits);
    let [n, _] = x.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets).reshape([n, 1]);
    let max = x.clone().max_dim(1);
    let log_sum = (x.clone() - max.clone()).exp().sum_dim(1).log();
    let target_shifted = x.gather(1, targets) - max.clone();
    let loss = (log_sum.clone() - target_shifted).mean();
    let logsumexp = log_sum + max;
    (
        loss.into_primitive().tensor(),
        logsumexp.into_primitive().tensor(),
    )
}

/// The gradient of [`cross_entropy`] with respect to the logits, given each row's `logsumexp`
/// and the loss's gradient `dloss[1]`: `(softmax - onehot(target)) · dloss / n`.
pub fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    logsumexp: FloatTensor<B>,
    dloss: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = float::<B, 2>(logits);
    let [n, _] = x.dims();
    let targets = Tensor::<B, 1, Int>::from_primitive(targets).reshape([n, 1]);
    let softmax = (x - float::<B, 2>(logsumexp)).exp();
    let minus_one = Tensor::<B, 2>::full([n, 1], -1.0, (&softmax.device(), softmax.dtype()));
    let dlogits = softmax.scatter(1, targets, minus_one, IndexingUpdateOp::Add);
    let dloss = float::<B, 1>(dloss).div_scalar(n as f32).reshape([1, 1]);
    (dlogits * dloss).into_primitive().tensor()
}

/// [`cross_entropy`] of the logits `h[n, d] · w[vocab, d]ᵀ` (see
/// [`ToyBackend::linear_cross_entropy`](crate::ToyBackend::linear_cross_entropy)): the loss and
/// each row's `logsumexp`.
pub fn linear_cross_entropy<B: Backend>(
    h: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = float::<B, 2>(h).matmul(float::<B, 2>(w).transpose());
    cross_entropy::<B>(logits.into_primitive().tensor(), targets)
}

/// The gradients `(dh, dw)` of [`linear_cross_entropy`] given each row's `logsumexp` and the
/// loss's gradient `dloss[1]` (`dw` only when `weight_grad`).
pub fn linear_cross_entropy_backward<B: Backend>(
    h: FloatTensor<B>,
    w: FloatTensor<B>,
    targets: IntTensor<B>,
    logsumexp: FloatTensor<B>,
    dloss: FloatTensor<B>,
    weight_grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let (h, w) = (float::<B, 2>(h), float::<B, 2>(w));
    let logits = h.clone().matmul(w.clone().transpose());
    let dlogits = float::<B, 2>(cross_entropy_backward::<B>(
        logits.into_primitive().tensor(),
        targets,
        logsumexp,
        dloss,
    ));
    let dh = dlogits.clone().matmul(w);
    let dw = weight_grad.then(|| dlogits.transpose().matmul(h).into_primitive().tensor());
    (dh.into_primitive().tensor(), dw)
}

/// One AdamW update (see [`ToyBackend::adamw_step`](crate::ToyBackend::adamw_step)): burn 0.21's
/// `AdamW::step` without AMSGrad or cautious decay, op for op, so that every backend that runs
/// this body steps exactly as burn's optimizer would.
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<(FloatTensor<B>, FloatTensor<B>)>,
    s: AdamWStep,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let shape = param.shape();
    let (p, g) = (flat::<B>(param), flat::<B>(grad));
    let (factor_1, factor_2) = (1.0 - s.beta_1, 1.0 - s.beta_2);
    let (m, v) = match moments {
        Some((m, v)) => (
            flat::<B>(m)
                .mul_scalar(s.beta_1)
                .add(g.clone().mul_scalar(factor_1)),
            flat::<B>(v)
                .mul_scalar(s.beta_2)
                .add(g.square().mul_scalar(factor_2)),
        ),
        None => (
            g.clone().mul_scalar(factor_1),
            g.square().mul_scalar(factor_2),
        ),
    };
    let time = s.time as i32;
    let m_hat = m.clone().div_scalar(1f32 - s.beta_1.powi(time));
    let v_hat = v.clone().div_scalar(1f32 - s.beta_2.powi(time));
    let delta = m_hat.div(v_hat.sqrt().add_scalar(s.epsilon));
    let decay_rate = s.lr * s.weight_decay as f64;
    let p = if decay_rate == 0.0 {
        p
    } else {
        p.mul_scalar(1.0 - decay_rate)
    };
    let p = p - delta.mul_scalar(s.lr);
    let shaped = |t: Tensor<B, 1>| B::float_reshape(t.into_primitive().tensor(), shape.clone());
    (shaped(p), shaped(m), shaped(v))
}

/// `t` of any rank as a vector.
fn flat<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 1> {
    let n = t.shape().num_elements();
    float(B::float_reshape(t, Shape::new([n])))
}

/// `Σ x²`, shape `[1]`.
pub fn sum_squares<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    flat::<B>(x).square().sum().into_primitive().tensor()
}
