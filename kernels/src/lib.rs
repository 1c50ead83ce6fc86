//! toy-kernels: the hot operations of toy behind one extension trait, [`ToyBackend`].
//!
//! Every op has a default body written with plain burn tensor ops ([`mod@reference`]): that body is
//! the specification every faster implementation is tested against, and it is what backends
//! without an override run (`ndarray`). Overrides:
//! - `CubeBackend` (`--backend wgpu`, `--backend cuda`): cubecl kernels ([`cube`]).
//! - `Autodiff<B>`: the inner backend's forward with a custom backward per op.
//! - `Flex` (`--backend cpu`): native Rust loops on the tensor's host memory ([`flex`]), computing
//!   quantized products the way ggml's CPU backend does (activations quantized to 8-bit blocks,
//!   integer dot products, one scale multiply per block) — both the fast path and the way to
//!   match llama.cpp's numbers.
//!
//! This crate knows nothing of models: ops take tensors and plain options.

#![warn(missing_docs)]

mod autodiff;
pub mod cube;
pub mod flex;
pub mod packed;
pub mod reference;

use burn::backend::NdArray;
use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
pub use packed::PackedTensor;

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Rotate pairs `(2i, 2i+1)` (ggml's normal mode; GGUF `llama` weights are permuted for it).
    Interleaved,
    /// Rotate pairs `(i, i + d/2)` (ggml's neox mode).
    Neox,
}

/// Options of causal attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies `q·k` before the soft-cap and softmax (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Position of the first query row among the keys: query row `i` sees keys `j <= i + q_offset`.
    /// With a KV cache holding `past` tokens, `q_offset = past` (seq_k = past + seq_q).
    pub q_offset: usize,
    /// Sliding window: query row `i` sees only the last `window` keys up to its own position.
    pub window: Option<usize>,
    /// Logit soft-cap: `scores = cap * tanh(scores / cap)`.
    pub softcap: Option<f32>,
}

impl AttentionOptions {
    /// Attention in which every query row sees all `keys` keys (an encoder's, as in ViT): the
    /// causal limit `j <= i + q_offset` put at the last key, so no key is masked. Every
    /// implementation clamps the visible keys at `keys`, so this needs no mode of its own.
    pub fn full(scale: f32, keys: usize) -> Self {
        AttentionOptions {
            scale,
            q_offset: keys.saturating_sub(1),
            window: None,
            softcap: None,
        }
    }
}

/// One sequence's share of [`ToyBackend::attention_batch`]: the arguments of
/// [`ToyBackend::attention`].
#[derive(Debug, Clone)]
pub struct AttentionPart<B: Backend> {
    /// Queries `[b, h, tq, d]`.
    pub q: FloatTensor<B>,
    /// Keys `[b, h_kv, tk, d]`.
    pub k: FloatTensor<B>,
    /// Values `[b, h_kv, tk, d]`.
    pub v: FloatTensor<B>,
    /// This sequence's scale, offset, window and soft-cap.
    pub options: AttentionOptions,
}

/// One AdamW step's settings: burn's `AdamW` with its learning rate and the step number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate: the step is `lr · m̂ / (sqrt(v̂) + epsilon)`.
    pub lr: f64,
    /// Decay of the first moment (the running mean of the gradient).
    pub beta_1: f32,
    /// Decay of the second moment (the running mean of the squared gradient).
    pub beta_2: f32,
    /// Added to `sqrt(v̂)` in the denominator, against division by zero.
    pub epsilon: f32,
    /// Decoupled weight decay: the parameter is first multiplied by `1 - lr · weight_decay`.
    pub weight_decay: f32,
    /// The step number, from 1 (what the bias corrections raise the betas to).
    pub time: usize,
}

/// A burn backend with toy's hot ops. Default bodies are the reference implementation.
///
/// Quantized and 16-bit weights are passed packed ([`PackedTensor`], layouts in [`packed`]).
pub trait ToyBackend: Backend {
    /// Run `f`, a forward pass, where this backend's parallel ops start cheapest. The default
    /// runs it in place.
    fn run_pass<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Run `f` with the activation rows of its matmuls declared as independent sequences of
    /// `lens[0]`, `lens[1]`, … rows, one after another (a continuous-batching pass). Where a
    /// backend's matmul numbers depend on the row count — on the CPU, as llama.cpp's kernels
    /// do — it then computes each row as that sequence alone would, so batching changes no
    /// sequence's logits. A matmul whose row count is not the sum of `lens` computes as usual.
    /// The default ignores the declaration.
    fn with_row_groups<R>(lens: &[usize], f: impl FnOnce() -> R) -> R {
        let _ = lens;
        f()
    }

    /// The layout this backend prefers for the matmul weights llama.cpp repacks (Q4_K, Q4_0:
    /// [`packed::RowLayout`]; each weight gets what [`packed::row_layout_for`] allows it): the
    /// CPU's interleaved ones,
    /// which its kernels read as one stream with the outputs in lanes. The default keeps the
    /// file's rows.
    fn row_layout() -> packed::RowLayout {
        packed::RowLayout::Rows
    }

    /// `y[m, n] = x[m, k] · dequant(W)[n, k]ᵀ` for a weight `W` kept in its GGUF block format
    /// (any of [`packed::PACKED_TYPES`]). On the CPU this computes what llama.cpp's x86 build
    /// computes for that type, bit for bit: the activations quantized to the 8-bit blocks the
    /// type pairs with (Q8_0, Q8_1 or Q8_K; f16 or bf16 for 16-bit weights), exact integer block
    /// dot products, and llama.cpp's float accumulation order.
    fn packed_matmul(x: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        reference::packed_matmul::<Self>(x, w)
    }

    /// [`packed_matmul`](Self::packed_matmul) of the same activations with each of `ws` (a
    /// block's Q, K and V projections, or its gate and up), the products in the order of `ws`.
    /// The default computes them one after another; the CPU runs them as one parallel region,
    /// so that its threads meet once for the group instead of once per weight.
    fn packed_matmuls(x: FloatTensor<Self>, ws: Vec<PackedTensor<Self>>) -> Vec<FloatTensor<Self>> {
        ws.into_iter()
            .map(|w| Self::packed_matmul(x.clone(), w))
            .collect()
    }

    /// The rows `ids[n]` of a packed weight, dequantized: `[n, cols]` (an embedding lookup that
    /// widens only the rows it reads).
    fn packed_rows(w: PackedTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        reference::packed_rows::<Self>(w, ids)
    }

    /// `dy[m, n] · dequant(W)[n, k]`: the gradient of [`packed_matmul`](Self::packed_matmul)
    /// with respect to its activations (a packed weight is frozen: it gets none).
    fn packed_matmul_backward(dy: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        reference::packed_matmul_backward::<Self>(dy, w)
    }

    /// The whole packed weight widened to f32 `[rows, cols]`, as ggml's `dequantize_row_*`
    /// computes it (merging adapters into a quantized base, `toy convert`).
    fn packed_dequantize(w: PackedTensor<Self>) -> FloatTensor<Self> {
        reference::packed_dequantize::<Self>(w)
            .into_primitive()
            .tensor()
    }

    /// A dense linear layer without bias: `y[m, n] = x[m, k] · w[n, k]ᵀ` (PyTorch's
    /// `F.linear`). Under `Autodiff` its backward is
    /// [`dense_linear_backward`](Self::dense_linear_backward).
    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::dense_linear::<Self>(x, w)
    }

    /// [`dense_linear`](Self::dense_linear) as the forward of a layer autodiff is tracking
    /// (training): the same product, in whatever order of summation is fastest. The CPU backend
    /// reproduces llama.cpp's order in `dense_linear` (inference) and uses blocked `gemm` here,
    /// which is faster on training's large batches.
    fn dense_linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::dense_linear(x, w)
    }

    /// The gradients `(dx, dw)` of [`dense_linear`](Self::dense_linear) for the output gradient `dy[m, n]`:
    /// `dx = dy · w` and, when the layer's input `x` is given, `dw = dyᵀ · x` (a frozen weight
    /// needs no gradient, and its layer keeps no `x` for one).
    fn dense_linear_backward(
        w: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        x: Option<FloatTensor<Self>>,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        reference::dense_linear_backward::<Self>(w, dy, x)
    }

    /// RMS normalization over the last dim: `y = x / sqrt(mean(x²) + eps) * weight`.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        reference::rms_norm::<Self>(x, weight, eps)
    }

    /// The gradients `(dx, dweight)` of [`rms_norm`](Self::rms_norm) for the output gradient
    /// `dy`: per row, with `r = 1 / sqrt(mean(x²) + eps)` and `g = dy · weight`,
    /// `dx = r · (g − x · r² · mean(g · x))`, and `dweight = Σ_rows dy · x · r`. `dweight` only
    /// when `weight_grad` (a frozen norm, as in LoRA, needs none).
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        eps: f32,
        dy: FloatTensor<Self>,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        reference::rms_norm_backward::<Self>(x, weight, eps, dy, weight_grad)
    }

    /// The SwiGLU gate: `silu(gate) * up`, elementwise.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::swiglu::<Self>(gate, up)
    }

    /// The gradients `(dgate, dup)` of [`swiglu`](Self::swiglu) for the output gradient `dy`:
    /// with `s = sigmoid(gate)`, `dgate = dy · up · s · (1 + gate · (1 − s))` and
    /// `dup = dy · gate · s`.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        dy: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::swiglu_backward::<Self>(gate, up, dy)
    }

    /// The `heads` attention heads of `x[b, t, heads · d]`, heads before tokens: `[b, heads, t,
    /// d]`, the layout [`rope`](Self::rope) and [`attention`](Self::attention) take. The
    /// default is a view (no copy).
    fn split_heads(x: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        reference::split_heads::<Self>(x, heads)
    }

    /// The inverse of [`split_heads`](Self::split_heads): `x[b, heads, t, d]` to
    /// `[b, t, heads · d]`, contiguous. Under `Autodiff` each is the other's backward.
    fn merge_heads(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::merge_heads::<Self>(x)
    }

    /// Rotary embedding of `x[b, h, t, d]`: pair `i` of token `t` is rotated by the angle whose
    /// `cos[t, i]` and `sin[t, i]` are given (`toy_core::rope` computes them as llama.cpp does);
    /// the first `2 * cos.dims()[1]` dims of each head rotate, the rest pass through.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        reference::rope::<Self>(x, cos, sin, layout)
    }

    /// Causal attention. `q[b, h, tq, d]`, `k`/`v` `[b, h_kv, tk, d]` with `h` a multiple of
    /// `h_kv`: query head `i` uses K/V head `i / (h / h_kv)` (grouped-query attention).
    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        reference::attention::<Self>(q, k, v, options)
    }

    /// Write `x[b, h, t, d]` into `buffer[b, h, capacity, d]` at tokens `at..at + t` and return
    /// the buffer (a KV cache's append). Backends write in place when the buffer is theirs
    /// alone; the default is burn's `slice_assign`, which on Flex copies the whole buffer first
    /// (its `slice_assign` keeps a second handle to the data while it writes).
    fn write_tokens(
        buffer: FloatTensor<Self>,
        x: FloatTensor<Self>,
        at: usize,
    ) -> FloatTensor<Self> {
        reference::write_tokens::<Self>(buffer, x, at)
    }

    /// [`attention`](Self::attention) of several sequences in one call: a batched pass gives
    /// each sequence its own queries, keys, values and offset. Backends override it to run every
    /// sequence's heads in one parallel region instead of one region (or launch) per sequence:
    /// with many decoding sequences each call has a few rows only, and the per-call cost would
    /// dominate.
    fn attention_batch(parts: Vec<AttentionPart<Self>>) -> Vec<FloatTensor<Self>> {
        parts
            .into_iter()
            .map(|p| <Self as ToyBackend>::attention(p.q, p.k, p.v, p.options))
            .collect()
    }

    /// The gradients `(dq, dk, dv)` of [`attention`](Self::attention) for the output gradient
    /// `d_out[b, h, tq, d]`, recomputing the probabilities from `q`, `k`, `v` (the forward keeps
    /// no `T × T` matrix). The K/V gradients sum over the query heads that share each K/V head.
    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        d_out: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::attention_backward::<Self>(q, k, v, d_out, &options)
    }

    /// Mean cross-entropy (natural log) of `logits[n, vocab]` against class ids `targets[n]`:
    /// `mean(logsumexp(row) - row[target])`, shape `[1]`. Under `Autodiff` its backward is the
    /// closed form `(softmax - onehot) / n`, instead of burn's graph through `log_softmax` and
    /// `gather` (several vocabulary-wide temporaries per token).
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        reference::cross_entropy::<Self>(logits, targets).0
    }

    /// [`cross_entropy`](Self::cross_entropy) of the logits of an output head:
    /// `logits = h[n, d] · w[vocab, d]ᵀ`, shape `[1]`. A backend may compute it a slice of the
    /// vocabulary at a time, never holding the `[n, vocab]` logits (at a 49,152-token vocabulary
    /// those are 192 KiB per token, and every vocabulary-wide op over them costs as much as the
    /// rest of a small model's step). Under `Autodiff` its backward is
    /// [`linear_cross_entropy_backward`](Self::linear_cross_entropy_backward).
    fn linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::linear_cross_entropy_forward(h, w, targets).0
    }

    /// The loss of [`linear_cross_entropy`](Self::linear_cross_entropy) and each row's
    /// `logsumexp` `[n, 1]`, which the backward needs.
    fn linear_cross_entropy_forward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        reference::linear_cross_entropy::<Self>(h, w, targets)
    }

    /// The gradients `(dh[n, d], dw[vocab, d])` of
    /// [`linear_cross_entropy`](Self::linear_cross_entropy) for the loss gradient `dloss[1]`:
    /// `dh = G · w` and `dw = Gᵀ · h` with `G = (softmax(logits) - onehot) · dloss / n`. `dw`
    /// only when `weight_grad` (a frozen head, as in LoRA, needs none: a quarter of the work).
    fn linear_cross_entropy_backward(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        logsumexp: FloatTensor<Self>,
        dloss: FloatTensor<Self>,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        reference::linear_cross_entropy_backward::<Self>(
            h,
            w,
            targets,
            logsumexp,
            dloss,
            weight_grad,
        )
    }

    /// One AdamW update of a parameter with burn's `AdamW` arithmetic: returns the new
    /// `(param, moment_1, moment_2)`; `moments` is `None` at the first step. burn composes it of
    /// about fifteen elementwise tensor ops, each allocating a parameter-sized output; a backend
    /// may do it in one pass, in place.
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        moments: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
        step: AdamWStep,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        reference::adamw_step::<Self>(param, grad, moments, step)
    }

    /// `Σ x²` over all elements, shape `[1]` (what the global gradient norm adds up).
    fn sum_squares(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::sum_squares::<Self>(x)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> ToyBackend for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}
