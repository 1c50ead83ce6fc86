//! What a forward pass runs after: each sequence's KV cache, and how a batched pass splits its
//! rows between sequences.
//!
//! A batched pass (continuous batching, [`crate::CausalLm::forward_batch_last`]) runs the new
//! tokens of several sequences as the rows of one `[1, T, ·]` activation: every matmul, norm
//! and MLP sees all `T` rows at once (decode on a CPU or GPU is bound by reading the weights, so
//! one pass over 16 sequences costs little more than one over a single sequence), and only RoPE
//! and attention, which depend on a sequence's positions and past keys, run per [`Segment`].
//!
//! A sequence's numbers do not depend on what else is in its pass: the pass declares each
//! sequence's rows to the kernels (`ToyBackend::with_row_groups`; llama.cpp's CPU kernels
//! differ by row count), and a prompt always runs in the same pieces ([`PROMPT_CHUNK`]),
//! whether alone (`generate`) or batched (`toy serve`).

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

/// Prompt tokens per forward pass, as llama.cpp's default micro-batch (`n_ubatch`): a longer
/// prompt runs in pieces of this many tokens (the last shorter), by `toy infer` and `toy serve`
/// alike, so its rows meet the kernels in the same groups — and get the same numbers — whatever
/// runs it.
pub const PROMPT_CHUNK: usize = 512;

/// Keys and values of the tokens seen so far, per layer: `[batch, n_head_kv, len, head_dim]`.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(n_layer: usize) -> Self {
        KvCache {
            layers: vec![None; n_layer],
            len: 0,
        }
    }

    /// A cache from each layer's keys and values, `[batch, n_head_kv, len, head_dim]`, all of
    /// the same `len` (restoring a saved cache; the prefix cache's tests).
    pub fn from_layers(layers: Vec<(Tensor<B, 4>, Tensor<B, 4>)>) -> Self {
        let len = layers.first().map_or(0, |(k, _)| k.dims()[2]);
        assert!(
            layers
                .iter()
                .all(|(k, v)| k.dims()[2] == len && v.dims()[2] == len),
            "every layer's keys and values hold the same tokens"
        );
        KvCache {
            layers: layers.into_iter().map(Some).collect(),
            len,
        }
    }

    /// Layer `i`'s keys and values (None before the first token).
    pub fn layer(&self, i: usize) -> Option<&(Tensor<B, 4>, Tensor<B, 4>)> {
        self.layers.get(i)?.as_ref()
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A cache of the first `n` tokens of this one (a prefix cache's hit). Shares nothing that
    /// either side later changes: appending concatenates into new tensors.
    pub fn prefix(&self, n: usize) -> Self {
        assert!(
            n <= self.len,
            "prefix of {n} tokens from a cache of {}",
            self.len
        );
        if n == self.len {
            return self.clone();
        }
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|kv| {
                    let (k, v) = kv.as_ref()?;
                    (n > 0).then(|| (k.clone().narrow(2, 0, n), v.clone().narrow(2, 0, n)))
                })
                .collect(),
            len: n,
        }
    }

    /// Bytes the keys and values take.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| {
                k.shape().num_elements() * k.dtype().size()
                    + v.shape().num_elements() * v.dtype().size()
            })
            .sum()
    }

    /// Count `t` new tokens as held (after every layer appended them).
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }

    /// Append this step's keys and values for `layer`; returns everything held for it.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let kv = match self.layers[layer].take() {
            None => (k, v),
            Some((pk, pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
        };
        self.layers[layer] = Some(kv.clone());
        kv
    }
}

/// One sequence's share of a forward pass: `len` new tokens, rows `start..start + len` of the
/// pass's activations, placed after the `past` tokens its cache holds.
pub struct Segment<'c, B: Backend> {
    pub start: usize,
    pub len: usize,
    pub past: usize,
    pub cache: &'c mut KvCache<B>,
}

/// The segments of a pass over `lens[i]` new tokens of each `caches[i]`, one after another.
pub(crate) fn segments<'c, B: Backend>(
    caches: Vec<&'c mut KvCache<B>>,
    lens: &[usize],
) -> Vec<Segment<'c, B>> {
    assert_eq!(caches.len(), lens.len(), "one length per cache");
    let mut start = 0;
    caches
        .into_iter()
        .zip(lens)
        .map(|(cache, &len)| {
            let segment = Segment {
                start,
                len,
                past: cache.len(),
                cache,
            };
            start += len;
            segment
        })
        .collect()
}

/// `x[.., rows, ..]` of `segment` (dimension 1 holds the tokens); the whole tensor when the pass
/// has one segment, so the single-sequence path (and training's autodiff graph) gains no op.
pub(crate) fn rows<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
    segment: &Segment<'_, B>,
    n_segments: usize,
) -> Tensor<B, D> {
    if n_segments == 1 {
        x.clone()
    } else {
        x.clone().narrow(1, segment.start, segment.len)
    }
}

/// The per-segment results put back in row order along dimension 1.
pub(crate) fn join<B: Backend, const D: usize>(mut parts: Vec<Tensor<B, D>>) -> Tensor<B, D> {
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(parts, 1)
    }
}

/// Count each segment's new tokens as held by its cache (after every layer appended them).
pub(crate) fn advance<B: Backend>(segments: &mut [Segment<'_, B>]) {
    for s in segments {
        s.cache.advance(s.len);
    }
}

/// The tokens of a batched pass, `[1, T]`: each sequence's new ids one after another.
pub(crate) fn batch_tokens<B: Backend>(tokens: &[&[u32]], device: &B::Device) -> Tensor<B, 2, Int> {
    let ids: Vec<i64> = tokens
        .iter()
        .flat_map(|t| t.iter().map(|&i| i as i64))
        .collect();
    let n = ids.len();
    Tensor::from_data(TensorData::new(ids, [1, n]), device)
}

/// Each segment's last row of `h[1, T, d]`, as `[n_segments, d]`.
pub(crate) fn last_rows<B: Backend>(h: Tensor<B, 3>, segments: &[Segment<'_, B>]) -> Tensor<B, 2> {
    let [_, _, d] = h.dims();
    let last: Vec<i64> = segments
        .iter()
        .map(|s| (s.start + s.len - 1) as i64)
        .collect();
    let n = last.len();
    let index = Tensor::<B, 1, Int>::from_data(TensorData::new(last, [n]), &h.device());
    h.select(1, index).reshape([n, d])
}
