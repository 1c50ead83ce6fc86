//! `ToyBackend` for `Autodiff<B>`: the forward of each hot op runs the inner backend's
//! implementation (cubecl kernels on wgpu/cuda, native loops on Flex), and a custom `Backward`
//! gives the gradients.
//!
//! - RMSNorm and SwiGLU: the inner backend's `rms_norm_backward` / `swiglu_backward` from the
//!   saved inputs. burn's autodiff of their reference bodies records about ten elementwise ops
//!   each and runs their backward one tensor-wide pass at a time.
//! - Quantized matmuls: gradient w.r.t. `x` only (`dX = dY · dequant(W)`); the quantized base is
//!   frozen (QLoRA). The forward rounds activations to 8-bit blocks as llama.cpp does; the
//!   backward is that of the exact product (a straight-through estimate of the rounding).
//! - RoPE: a rotation, so its backward is the inverse rotation — the same op with `-sin`.
//! - Attention: recomputes the probabilities from the saved Q, K, V (the forward kept no
//!   `T × T` matrix) chunk by chunk of query rows, so memory stays O(T), and applies the softmax
//!   backward; grouped-query heads sum their K/V gradients through the same reshape the
//!   reference uses.
//! - Cross-entropy: `dlogits = (softmax - onehot) · dloss / n`, from the saved logits and each
//!   row's `logsumexp`.
//! - The output head's cross-entropy (`linear_cross_entropy`): the inner backend's
//!   `linear_cross_entropy_backward`, from the saved `h`, `w` and each row's `logsumexp`; on Flex
//!   it recomputes the logits a slice of the vocabulary at a time instead of keeping them.

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive};

use crate::{AttentionOptions, RopeLayout, ToyBackend, reference};

fn float<B: ToyBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: ToyBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// Which quantized weight format a matmul reads.
#[derive(Debug, Clone, Copy)]
enum QFormat {
    Q8_0,
    Q4_0,
    Q4_1,
}

#[derive(Debug)]
struct QMatmulBackward(QFormat);

type QWeight<B> = (IntTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

impl<B: ToyBackend> Backward<B, 1> for QMatmulBackward {
    type State = QWeight<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node_x) = node_x else { return };
        let (words, scales, mins) = ops.state;
        let words = Tensor::from_primitive(words);
        let w = match self.0 {
            QFormat::Q8_0 => reference::dequant_q8_0::<B>(words, float(scales)),
            QFormat::Q4_0 => reference::dequant_q4_0::<B>(words, float(scales)),
            QFormat::Q4_1 => reference::dequant_q4_1::<B>(
                words,
                float(scales),
                float(mins.expect("Q4_1 has mins")),
            ),
        };
        let dx = float::<B, 2>(grad).matmul(w);
        grads.register::<B>(node_x.id, prim(dx));
    }
}

fn qmatmul<B: ToyBackend, C: CheckpointStrategy>(
    format: QFormat,
    x: FloatTensor<Autodiff<B, C>>,
    words: IntTensor<B>,
    scales: FloatTensor<Autodiff<B, C>>,
    mins: Option<FloatTensor<Autodiff<B, C>>>,
) -> FloatTensor<Autodiff<B, C>> {
    // The weight is frozen: its scales enter as constants, never as graph nodes.
    let scales = scales.primitive;
    let mins = mins.map(|m| m.primitive);
    let forward =
        |x, words: IntTensor<B>, scales: FloatTensor<B>, mins: Option<FloatTensor<B>>| match format
        {
            QFormat::Q8_0 => B::q8_0_matmul(x, words, scales),
            QFormat::Q4_0 => B::q4_0_matmul(x, words, scales),
            QFormat::Q4_1 => B::q4_1_matmul(x, words, scales, mins.expect("Q4_1 has mins")),
        };
    match QMatmulBackward(format)
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = forward(x.primitive, words.clone(), scales.clone(), mins.clone());
            prep.finish((words, scales, mins), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive, words, scales, mins)),
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: ToyBackend> Backward<B, 2> for RmsNormBackward {
    /// `x`, the weight and epsilon.
    type State = (FloatTensor<B>, FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, weight, eps, grad, node_w.is_some());
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw);
        }
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: ToyBackend> Backward<B, 2> for SwigluBackward {
    /// The gate and the up projection.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        for (node, g) in [(node_gate, d_gate), (node_up, d_up)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

#[derive(Debug)]
struct RopeBackward;

impl<B: ToyBackend> Backward<B, 1> for RopeBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, RopeLayout);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node_x) = node_x else { return };
        let (cos, sin, layout) = ops.state;
        let inverse_sin = prim(float::<B, 2>(sin).neg());
        grads.register::<B>(node_x.id, B::rope(grad, cos, inverse_sin, layout));
    }
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: ToyBackend> Backward<B, 3> for AttentionBackward {
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        AttentionOptions,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, options) = ops.state;
        let (dq, dk, dv) = attention_backward::<B>(q, k, v, grad, &options);
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// Query rows per chunk of the attention backward: the recomputed probabilities of one chunk
/// take `batch · heads · ROWS · keys` floats, so memory grows as O(T), not O(T²).
const BACKWARD_ROWS: usize = 64;

/// Gradients of attention w.r.t. q, k, v, from the saved inputs and `dO`, one chunk of
/// [`BACKWARD_ROWS`] query positions at a time (FlashAttention's recomputation, in tensor ops):
/// each chunk recomputes its probabilities against only the keys its rows can see (up to its
/// last position, and from its first row's window start), adds its `Pᵀ·dO` and `dSᵀ·Q` into the
/// K/V gradients and writes its own rows of `dQ`. Query heads that share a K/V head are stacked
/// as rows (as in the reference), so those products also sum over the group.
fn attention_backward<B: ToyBackend>(
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

        let (probs, capped) =
            reference::attention_probs(q_c.clone(), k_c.clone(), rows, &chunk_options);
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
    (prim(d_q), prim(d_k), prim(d_v))
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: ToyBackend> Backward<B, 1> for CrossEntropyBackward {
    /// The logits, the targets and each row's `logsumexp`.
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node_logits) = node_logits else {
            return;
        };
        let (logits, targets, logsumexp) = ops.state;
        let dlogits = reference::cross_entropy_backward::<B>(logits, targets, logsumexp, grad);
        grads.register::<B>(node_logits.id, dlogits);
    }
}

#[derive(Debug)]
struct LinearCrossEntropyBackward;

impl<B: ToyBackend> Backward<B, 2> for LinearCrossEntropyBackward {
    /// `h`, `w`, the targets and each row's `logsumexp`.
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_h, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (h, w, targets, logsumexp) = ops.state;
        let weight_grad = node_w.is_some();
        let (dh, dw) =
            B::linear_cross_entropy_backward(h, w, targets, logsumexp, grad, weight_grad);
        if let Some(node) = node_h {
            grads.register::<B>(node.id, dh);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw);
        }
    }
}

impl<B: ToyBackend, C: CheckpointStrategy> ToyBackend for Autodiff<B, C> {
    fn q8_0_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        qmatmul::<B, C>(QFormat::Q8_0, x, words, scales, None)
    }

    fn q4_0_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        qmatmul::<B, C>(QFormat::Q4_0, x, words, scales, None)
    }

    fn q4_1_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: FloatTensor<Self>,
        mins: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        qmatmul::<B, C>(QFormat::Q4_1, x, words, scales, Some(mins))
    }

    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        match RmsNormBackward
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, weight) = (x.primitive, weight.primitive);
                let out = B::rms_norm(x.clone(), weight.clone(), eps);
                prep.finish((x, weight, eps), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::rms_norm(x.primitive, weight.primitive, eps))
            }
        }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        match SwigluBackward
            .prepare::<C>([gate.node.clone(), up.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (gate, up) = (gate.primitive, up.primitive);
                let out = B::swiglu(gate.clone(), up.clone());
                prep.finish((gate, up), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate.primitive, up.primitive)),
        }
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        layout: RopeLayout,
    ) -> FloatTensor<Self> {
        // The tables are constants (computed on the host from positions).
        let (cos, sin) = (cos.primitive, sin.primitive);
        match RopeBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::rope(x.primitive, cos.clone(), sin.clone(), layout);
                prep.finish((cos, sin, layout), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rope(x.primitive, cos, sin, layout)),
        }
    }

    fn attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        match AttentionBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (qp, kp, vp) = (q.primitive, k.primitive, v.primitive);
                let out = <B as ToyBackend>::attention(qp.clone(), kp.clone(), vp.clone(), options);
                prep.finish((qp, kp, vp, options), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(<B as ToyBackend>::attention(
                q.primitive,
                k.primitive,
                v.primitive,
                options,
            )),
        }
    }
    fn cross_entropy(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        match CrossEntropyBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                // The reference body, not `B::cross_entropy`: the backward needs its logsumexp.
                let (loss, logsumexp) =
                    reference::cross_entropy::<B>(logits.primitive.clone(), targets.clone());
                prep.finish((logits.primitive, targets, logsumexp), loss)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::cross_entropy(logits.primitive, targets)),
        }
    }

    fn linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match LinearCrossEntropyBackward
            .prepare::<C>([h.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (h, w) = (h.primitive, w.primitive);
                let (loss, logsumexp) =
                    B::linear_cross_entropy_forward(h.clone(), w.clone(), targets.clone());
                prep.finish((h, w, targets, logsumexp), loss)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::linear_cross_entropy(h.primitive, w.primitive, targets))
            }
        }
    }
}
