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
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use toy_kernels::{AttentionPart, ToyBackend};

/// Prompt tokens per forward pass, as llama.cpp's default micro-batch (`n_ubatch`): a longer
/// prompt runs in pieces of this many tokens (the last shorter), by `toy infer` and `toy serve`
/// alike, so its rows meet the kernels in the same groups — and get the same numbers — whatever
/// runs it.
pub const PROMPT_CHUNK: usize = 512;

/// Keys and values of the tokens seen so far, per layer, in buffers preallocated along the token
/// axis (`[batch, n_head_kv, capacity, head_dim]`, the first [`KvCache::len`] tokens valid): a
/// step writes its keys into the free tail in place (burn writes a uniquely held tensor in place,
/// on the CPU and on cubecl) instead of concatenating the whole history into a new tensor, and
/// attention reads a view of the valid tokens. A buffer that fills up is regrown to twice its
/// capacity (or to [`KvCache::reserve`]'s), so a sequence's history is copied O(log n) times in
/// all, not once per token. llama.cpp preallocates the whole context the same way.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<Option<(Tensor<B, 4>, Tensor<B, 4>)>>,
    len: usize,
    /// Tokens the first allocation makes room for (the prompt plus the new tokens a generation
    /// may add); 0 when unknown.
    reserve: usize,
}

/// Capacities are multiples of this many tokens.
const CAPACITY_STEP: usize = 64;

impl<B: Backend> KvCache<B> {
    /// An empty cache for a model of `n_layer` layers (buffers are allocated at the first token).
    pub fn new(n_layer: usize) -> Self {
        KvCache {
            layers: vec![None; n_layer],
            len: 0,
            reserve: 0,
        }
    }

    /// Make room for `tokens` tokens in all, so that a generation of known length allocates its
    /// buffers once (takes effect at the next allocation).
    pub fn reserve(&mut self, tokens: usize) {
        self.reserve = self.reserve.max(tokens);
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
            reserve: 0,
        }
    }

    /// Layer `i`'s keys and values, `[batch, n_head_kv, len, head_dim]` (None before the first
    /// token).
    pub fn layer(&self, i: usize) -> Option<(Tensor<B, 4>, Tensor<B, 4>)> {
        let (k, v) = self.layers.get(i)?.as_ref()?;
        Some((
            k.clone().narrow(2, 0, self.len),
            v.clone().narrow(2, 0, self.len),
        ))
    }

    /// Tokens the buffers have room for without regrowing.
    pub fn capacity(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|(k, _)| k.dims()[2])
            .min()
            .unwrap_or(0)
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no tokens are held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A cache of the first `n` tokens of this one (a prefix cache's hit). It shares the
    /// buffers until either side writes: burn copies a shared tensor before writing into it, so
    /// neither sees the other's later tokens.
    pub fn prefix(&self, n: usize) -> Self {
        assert!(
            n <= self.len,
            "prefix of {n} tokens from a cache of {}",
            self.len
        );
        KvCache {
            layers: if n == 0 {
                vec![None; self.layers.len()]
            } else {
                self.layers.clone()
            },
            len: n,
            reserve: 0,
        }
    }

    /// Bytes the key and value buffers take (their whole capacity).
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
}

impl<B: ToyBackend> KvCache<B> {
    /// Drop the free tail of every buffer (a cache kept for later reuse holds only its tokens).
    pub fn shrink_to_fit(&mut self) {
        let len = self.len;
        for (k, v) in self.layers.iter_mut().flatten() {
            if k.dims()[2] > len {
                *k = regrow(k.clone(), len, len);
                *v = regrow(v.clone(), len, len);
            }
        }
    }

    /// Write this step's keys and values for `layer` after the tokens held; returns a view of
    /// everything held for it, `[batch, n_head_kv, len + t, head_dim]`.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let (past, t) = (self.len, k.dims()[2]);
        let need = past + t;
        let (kb, vb) = match self.layers[layer].take() {
            // The first tokens with no room asked for (a training or scoring pass): the step's
            // own tensors are the buffers, so the pass gains no op.
            None if self.reserve <= need => {
                self.layers[layer] = Some((k.clone(), v.clone()));
                return (k, v);
            }
            None => {
                let capacity = self.reserve.next_multiple_of(CAPACITY_STEP);
                (zeros_like(&k, capacity), zeros_like(&v, capacity))
            }
            Some((kb, vb)) if kb.dims()[2] < need => {
                let capacity = need
                    .max(2 * kb.dims()[2])
                    .max(self.reserve)
                    .next_multiple_of(CAPACITY_STEP);
                (regrow(kb, past, capacity), regrow(vb, past, capacity))
            }
            Some(buffers) => buffers,
        };
        let (kb, vb) = (write(kb, k, past), write(vb, v, past));
        let held = (kb.clone().narrow(2, 0, need), vb.clone().narrow(2, 0, need));
        self.layers[layer] = Some((kb, vb));
        held
    }
}

/// A zeroed buffer shaped like `x` with room for `capacity` tokens.
fn zeros_like<B: Backend>(x: &Tensor<B, 4>, capacity: usize) -> Tensor<B, 4> {
    let [b, h, _, d] = x.dims();
    Tensor::zeros([b, h, capacity, d], (&x.device(), x.dtype()))
}

/// `x[b, h, t, d]` written into `buffer` at tokens `at..at + t` ([`ToyBackend::write_tokens`]:
/// in place when the buffer is held once).
fn write<B: ToyBackend>(buffer: Tensor<B, 4>, x: Tensor<B, 4>, at: usize) -> Tensor<B, 4> {
    let (buffer, x) = (
        buffer.into_primitive().tensor(),
        x.into_primitive().tensor(),
    );
    Tensor::from_primitive(TensorPrimitive::Float(B::write_tokens(buffer, x, at)))
}

/// A new buffer of `capacity` tokens holding the first `keep` tokens of `old`.
fn regrow<B: ToyBackend>(old: Tensor<B, 4>, keep: usize, capacity: usize) -> Tensor<B, 4> {
    let buffer = zeros_like(&old, capacity);
    if keep == 0 {
        return buffer;
    }
    write(buffer, old.narrow(2, 0, keep), 0)
}

/// One sequence's share of a forward pass: `len` new tokens, rows `start..start + len` of the
/// pass's activations, placed after the `past` tokens its cache holds.
pub struct Segment<'c, B: Backend> {
    /// First row of the pass's activations that is this sequence's.
    pub start: usize,
    /// New tokens (rows) of this sequence in the pass.
    pub len: usize,
    /// Tokens the cache held before the pass (the position of the first new token).
    pub past: usize,
    /// The sequence's cache, which the pass appends to.
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

/// Every segment's attention in one call ([`ToyBackend::attention_batch`]), heads merged and put
/// back in row order: `[1, T, n_head·head_dim]` (or the one segment's `[b, t, ·]`).
pub(crate) fn attend<B: ToyBackend>(parts: Vec<AttentionPart<B>>) -> Tensor<B, 3> {
    let outs = B::attention_batch(parts)
        .into_iter()
        .map(|out| Tensor::from_primitive(TensorPrimitive::Float(B::merge_heads(out))))
        .collect();
    join(outs)
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    /// Keys `[1, 2, t, 3]` whose every element is the token's position (so a view shows which
    /// tokens it holds).
    fn keys(from: usize, t: usize) -> Tensor<B, 4> {
        let v: Vec<f32> = (0..2 * t * 3)
            .map(|i| (from + (i / 3) % t) as f32)
            .collect();
        Tensor::from_data(TensorData::new(v, [1, 2, t, 3]), &Default::default())
    }

    fn positions(k: &Tensor<B, 4>) -> Vec<f32> {
        let [_, _, t, _] = k.dims();
        let v = k.clone().into_data().to_vec::<f32>().unwrap();
        (0..t).map(|j| v[j * 3]).collect()
    }

    /// Append `t` tokens to both layers of `c` (as a forward pass does) and advance.
    fn step(c: &mut KvCache<B>, t: usize) -> Tensor<B, 4> {
        let past = c.len();
        let (k, _) = c.append(0, keys(past, t), keys(past, t));
        c.append(1, keys(past, t), keys(past, t));
        c.advance(t);
        k
    }

    #[test]
    fn appending_writes_into_the_buffers_and_regrows_them_by_doubling() {
        let mut c = KvCache::<B>::new(2);
        c.reserve(100);
        let k = step(&mut c, 7);
        assert_eq!(positions(&k), (0..7).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(c.capacity(), 128, "the reserve, rounded up to 64");
        let mut capacities = vec![c.capacity()];
        for _ in 0..300 {
            let k = step(&mut c, 1);
            assert_eq!(k.dims()[2], c.len(), "attention sees the held tokens only");
            capacities.push(c.capacity());
        }
        let held = c.layer(1).unwrap().0;
        assert_eq!(
            positions(&held),
            (0..307).map(|i| i as f32).collect::<Vec<_>>()
        );
        capacities.dedup();
        assert_eq!(
            capacities,
            [128, 256, 512],
            "doubling, not one copy per token"
        );
    }

    /// Where layer 0's key buffer lives.
    fn buffer_address(c: &KvCache<B>) -> usize {
        let (k, _) = c.layers[0].clone().unwrap();
        k.into_primitive().tensor().storage::<f32>().as_ptr() as usize
    }

    #[test]
    fn a_step_writes_into_the_buffer_it_has_without_copying_it() {
        let mut c = KvCache::<B>::new(2);
        c.reserve(64);
        step(&mut c, 3);
        let at = buffer_address(&c);
        for _ in 0..20 {
            let k = step(&mut c, 1);
            drop(k); // attention is done with its view before the next step
            assert_eq!(buffer_address(&c), at, "the buffer was copied");
        }
    }

    #[test]
    fn a_first_pass_with_no_reserve_keeps_its_own_tensors() {
        // A training or scoring pass: no buffer beyond the tokens.
        let mut c = KvCache::<B>::new(2);
        step(&mut c, 5);
        assert_eq!(c.capacity(), 5);
        assert_eq!(c.bytes(), 2 * 2 * (2 * 5 * 3) * 4);
    }

    #[test]
    fn a_prefix_and_its_source_do_not_see_each_others_tokens() {
        let mut a = KvCache::<B>::new(2);
        a.reserve(64);
        step(&mut a, 10);
        let mut b = a.prefix(4);
        // b writes its token 4 where a holds its own token 4: a must keep its value.
        let v: Vec<f32> = vec![99.0; 2 * 3];
        let x = Tensor::<B, 4>::from_data(TensorData::new(v, [1, 2, 1, 3]), &Default::default());
        b.append(0, x.clone(), x.clone());
        b.append(1, x.clone(), x);
        b.advance(1);
        step(&mut a, 1);
        assert_eq!(
            positions(&a.layer(0).unwrap().0),
            (0..11).map(|i| i as f32).collect::<Vec<_>>()
        );
        assert_eq!(
            positions(&b.layer(0).unwrap().0),
            [0.0, 1.0, 2.0, 3.0, 99.0]
        );
        let held = a.bytes();
        a.shrink_to_fit();
        assert!(a.bytes() < held);
        assert_eq!(a.capacity(), 11);
    }
}
