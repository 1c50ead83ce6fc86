//! `ToyBackend` for `Autodiff<B>`: the forward of each hot op runs the inner backend's
//! implementation (cubecl kernels on wgpu/cuda, native loops on Flex), and a custom `Backward`
//! gives the gradients.
//!
//! - Dense linear layers: the inner backend's `dense_linear_backward`; `x` is kept only when the
//!   weight is tracked (a frozen base weight's layer needs only `dx = dy · w`).
//! - Splitting into heads and merging them back: each is the other's backward.
//! - RMSNorm and SwiGLU: the inner backend's `rms_norm_backward` / `swiglu_backward` from the
//!   saved inputs. burn's autodiff of their reference bodies records about ten elementwise ops
//!   each and runs their backward one tensor-wide pass at a time.
//! - Packed (quantized, 16-bit) matmuls: gradient w.r.t. `x` only (`dX = dY · dequant(W)`, the
//!   inner backend's `packed_matmul_backward`); the packed base is frozen (QLoRA). The forward
//!   rounds activations to 8-bit blocks as llama.cpp does; the backward is that of the exact
//!   product (a straight-through estimate of the rounding).
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
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::{AttentionOptions, PackedTensor, RopeLayout, ToyBackend, reference};

/// Registers each gradient whose parent is tracked (an untracked parent is `None`).
fn register<B: ToyBackend>(
    grads: &mut Gradients,
    pairs: impl IntoIterator<Item = (Option<NodeId>, Option<FloatTensor<B>>)>,
) {
    for (node, grad) in pairs {
        if let (Some(id), Some(grad)) = (node, grad) {
            grads.register::<B>(id, grad);
        }
    }
}

fn float<B: ToyBackend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: ToyBackend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

#[derive(Debug)]
struct PackedMatmulBackward;

impl<B: ToyBackend> Backward<B, 1> for PackedMatmulBackward {
    type State = PackedTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node_x) = node_x else { return };
        grads.register::<B>(node_x.id, B::packed_matmul_backward(grad, ops.state));
    }
}

/// The inner backend's view of a packed weight (its scales enter as constants, never as graph
/// nodes: a packed weight is frozen).
fn inner_packed<B: ToyBackend, C: CheckpointStrategy>(
    w: PackedTensor<Autodiff<B, C>>,
) -> PackedTensor<B> {
    PackedTensor {
        ty: w.ty,
        cols: w.cols,
        words: w.words,
        scales: w.scales.map(|t| t.primitive),
        mins: w.mins.map(|t| t.primitive),
        repackable: w.repackable,
        layout: w.layout,
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<B: ToyBackend> Backward<B, 2> for LinearBackward {
    /// `x` (kept only when the weight is tracked: its gradient needs it) and the weight.
    type State = (Option<FloatTensor<B>>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents.map(|p| p.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw) = B::dense_linear_backward(w, grad, x);
        register::<B>(grads, [(node_x, Some(dx)), (node_w, dw)]);
    }
}

#[derive(Debug)]
struct SplitHeadsBackward;

impl<B: ToyBackend> Backward<B, 1> for SplitHeadsBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::merge_heads(grad));
        }
    }
}

#[derive(Debug)]
struct MergeHeadsBackward(usize);

impl<B: ToyBackend> Backward<B, 1> for MergeHeadsBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::split_heads(grad, self.0));
        }
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: ToyBackend> Backward<B, 2> for RmsNormBackward {
    /// `x`, the weight and epsilon.
    type State = (FloatTensor<B>, FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents.map(|p| p.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, weight, eps, grad, node_w.is_some());
        register::<B>(grads, [(node_x, Some(dx)), (node_w, dw)]);
    }
}

#[derive(Debug)]
struct SwigluBackward;

impl<B: ToyBackend> Backward<B, 2> for SwigluBackward {
    /// The gate and the up projection.
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents.map(|p| p.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        register::<B>(grads, [(node_gate, Some(d_gate)), (node_up, Some(d_up))]);
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
        let [node_q, node_k, node_v] = ops.parents.map(|p| p.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, options) = ops.state;
        let (dq, dk, dv) = B::attention_backward(q, k, v, grad, options);
        register::<B>(
            grads,
            [(node_q, Some(dq)), (node_k, Some(dk)), (node_v, Some(dv))],
        );
    }
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
        let [node_h, node_w] = ops.parents.map(|p| p.map(|n| n.id));
        let grad = grads.consume::<B>(&ops.node);
        let (h, w, targets, logsumexp) = ops.state;
        let weight_grad = node_w.is_some();
        let (dh, dw) =
            B::linear_cross_entropy_backward(h, w, targets, logsumexp, grad, weight_grad);
        register::<B>(grads, [(node_h, Some(dh)), (node_w, dw)]);
    }
}

impl<B: ToyBackend, C: CheckpointStrategy> ToyBackend for Autodiff<B, C> {
    fn with_row_groups<R>(lens: &[usize], f: impl FnOnce() -> R) -> R {
        B::with_row_groups(lens, f)
    }

    fn row_layout() -> crate::packed::RowLayout {
        B::row_layout()
    }

    fn packed_matmul(x: FloatTensor<Self>, w: PackedTensor<Self>) -> FloatTensor<Self> {
        let w = inner_packed(w);
        match PackedMatmulBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::packed_matmul(x.primitive, w.clone());
                prep.finish(w, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::packed_matmul(x.primitive, w)),
        }
    }

    fn packed_rows(w: PackedTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        // A frozen weight's rows: a constant of the graph.
        <Self as AutodiffBackend>::from_inner(B::packed_rows(inner_packed(w), ids))
    }

    fn packed_dequantize(w: PackedTensor<Self>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::packed_dequantize(inner_packed(w)))
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let weight_tracked = w.is_tracked();
        match LinearBackward
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.primitive, w.primitive);
                let out = B::dense_linear_tracked(x.clone(), w.clone());
                prep.finish((weight_tracked.then_some(x), w), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::dense_linear(x.primitive, w.primitive)),
        }
    }

    fn split_heads(x: FloatTensor<Self>, heads: usize) -> FloatTensor<Self> {
        SplitHeadsBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(B::split_heads(x.primitive, heads))
    }

    fn merge_heads(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let heads = x.primitive.shape()[1];
        MergeHeadsBackward(heads)
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateless(B::merge_heads(x.primitive))
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
