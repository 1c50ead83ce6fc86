//! The llama-family transformer (Llama, SmolLM2/3, TinyLlama, Mistral, Qwen2/3, Gemma2/3, Phi-3,
//! Granite, OLMoE): pre-norm blocks of grouped-query attention with RoPE and a gated MLP,
//! RMSNorm, token embedding and an output head (tied or not). The variants are config fields,
//! not copies: Q/K/V biases, Q/K norms (per head or over the whole projection), post-sublayer
//! norms, embedding, residual and logit scales, GELU or SiLU gate, attention and final logit
//! soft-caps, sliding-window layers with their own RoPE base, layers without RoPE, LongRoPE
//! factors, and a mixture-of-experts MLP. The hot ops go through [`ToyBackend`]: quantized matmuls (in
//! [`QLinear`]), RMSNorm, SwiGLU, RoPE and causal attention; the rest are plain burn ops written
//! to compute what ggml computes (see [`gelu_ggml`]).

use std::borrow::Cow;

use burn::module::{Module, Param};
use burn::nn::RmsNorm;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive, activation};
use toy_core::rope::RopeAngles;
use toy_kernels::{AttentionOptions, AttentionPart, RopeLayout, ToyBackend};

use crate::cache::{self, KvCache, Segment};
use crate::embedding::TokenEmbedding;
use crate::lora::{
    Adaptable, BlockLora, LoraBlock, LoraError, Target, fused_deltas, project, project_each,
    project_with,
};
use crate::qlinear::QLinear;

mod config;

pub use config::{LlamaConfig, LongRope};

/// The whole model.
#[derive(Module, Debug)]
pub struct Transformer<B: Backend> {
    /// The token embedding table, `[vocab_size, d_model]`.
    pub token_embd: TokenEmbedding<B>,
    /// The transformer blocks, first to last.
    pub blocks: Vec<Block<B>>,
    /// The final RMSNorm, applied before the output head.
    pub output_norm: RmsNorm<B>,
    /// The output head's own matrix, or `None` for a tied head: then the head multiplies by
    /// `token_embd` itself ([`Transformer::head`]), so training updates one table through both
    /// uses and saving writes that table once, as a tied GGUF holds it.
    pub output: Option<QLinear<B>>,
    /// How RoPE angles are computed (host-side, as llama.cpp does; not a parameter): one set,
    /// or (gemma3) a second for the sliding-window layers; each layer's attention names its set.
    #[module(skip)]
    pub ropes: Vec<RopeAngles>,
    /// LongRoPE factors (phi3); [`Transformer::set_context`] picks long or short.
    #[module(skip)]
    pub long_rope: Option<LongRope>,
    /// RoPE rotates interleaved pairs (GGUF `llama`) rather than half-split pairs.
    pub rope_interleaved: bool,
    /// The context this model runs with (the file's trained length unless set).
    pub context_length: usize,
    /// Token embeddings are multiplied by this (gemma: `sqrt(d_model)`, granite).
    #[module(skip)]
    pub embed_scale: Option<f32>,
    /// Logits are multiplied by `1 / logit_scale` (granite).
    #[module(skip)]
    pub logit_scale: Option<f32>,
    /// Output logits soft-cap (gemma2).
    #[module(skip)]
    pub final_softcap: Option<f32>,
}

/// One pre-norm transformer block: attention, then the feed-forward half, each added to the
/// residual stream.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// RMSNorm before attention.
    pub attn_norm: RmsNorm<B>,
    /// The self-attention sublayer.
    pub attn: Attention<B>,
    /// Norm of the attention output before the residual add (gemma2).
    pub post_attn_norm: Option<RmsNorm<B>>,
    /// RMSNorm before the feed-forward half.
    pub ffn_norm: RmsNorm<B>,
    /// The feed-forward sublayer.
    pub ffn: Ffn<B>,
    /// Norm of the MLP output before the residual add (gemma2).
    pub post_ffn_norm: Option<RmsNorm<B>>,
    /// Both sublayers' outputs are multiplied by this before the residual add (granite).
    #[module(skip)]
    pub residual_scale: Option<f32>,
    /// LoRA adapters on this block's projections (`None`: the plain model).
    pub lora: Option<BlockLora<B>>,
}

/// The feed-forward half of a block. (One per layer, so the variants' size difference costs
/// nothing worth a `Box`, which burn's `Module` derive does not take.)
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Ffn<B: Backend> {
    /// One gated MLP.
    Dense(Mlp<B>),
    /// A mixture of experts.
    Moe(Moe<B>),
}

/// Mixture of experts (olmoe): a softmax router scores every expert for each token, the
/// `n_used` best run, and their outputs are summed weighted by their router probabilities
/// (renormalized over the chosen ones if `norm_weights`), as llama.cpp's `build_moe_ffn`.
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    /// `[n_expert, d_model]`: one router logit per expert.
    pub router: QLinear<B>,
    /// The experts, gated MLPs of width `d_ff`.
    pub experts: Vec<Mlp<B>>,
    /// Experts each token runs through.
    pub n_used: usize,
    /// Renormalize the chosen experts' weights to sum to 1.
    pub norm_weights: bool,
}

/// Grouped-query causal self-attention with RoPE, and the variants' biases, norms, scales,
/// soft-cap and sliding window.
#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// Query projection, `[n_head * head_dim, d_model]`.
    pub wq: QLinear<B>,
    /// Key projection, `[n_head_kv * head_dim, d_model]`.
    pub wk: QLinear<B>,
    /// Value projection, `[n_head_kv * head_dim, d_model]`.
    pub wv: QLinear<B>,
    /// Output projection, `[d_model, n_head * head_dim]`.
    pub wo: QLinear<B>,
    /// Q/K/V biases (qwen2).
    pub bq: Option<Param<Tensor<B, 1>>>,
    /// Key bias (qwen2).
    pub bk: Option<Param<Tensor<B, 1>>>,
    /// Value bias (qwen2).
    pub bv: Option<Param<Tensor<B, 1>>>,
    /// Query/key RMSNorm before RoPE: per head (qwen3) or, with `qk_norm_full`, over the whole
    /// projection (olmoe).
    pub q_norm: Option<RmsNorm<B>>,
    /// Key RMSNorm before RoPE, as `q_norm`.
    pub k_norm: Option<RmsNorm<B>>,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (`n_head` is a multiple: grouped-query attention).
    pub n_head_kv: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// `q_norm` and `k_norm` span the whole projection rather than each head.
    pub qk_norm_full: bool,
    /// Queries are multiplied by this after RoPE and scores are not scaled again (gemma2).
    #[module(skip)]
    pub query_scale: Option<f32>,
    /// Otherwise the scores are scaled by this (granite), or by `1/sqrt(head_dim)`.
    #[module(skip)]
    pub kq_scale: Option<f32>,
    /// Attention logit soft-cap (gemma2).
    #[module(skip)]
    pub softcap: Option<f32>,
    /// Sliding-window size of this layer; `None`: it attends to every past token.
    #[module(skip)]
    pub window: Option<usize>,
    /// The RoPE angle set of this layer (`Transformer::ropes`); `None`: no RoPE (smollm3).
    #[module(skip)]
    pub rope_set: Option<usize>,
}

/// A gated MLP: `down(act(gate(x)) * up(x))`, act = SiLU or (`gelu`) ggml's GELU-tanh.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// Gate projection, `[d_ff, d_model]`.
    pub gate: QLinear<B>,
    /// Up projection, `[d_ff, d_model]`.
    pub up: QLinear<B>,
    /// Down projection, `[d_model, d_ff]`.
    pub down: QLinear<B>,
    /// Gate activation: ggml's GELU-tanh (gemma2) instead of SiLU.
    pub gelu: bool,
}

/// The RoPE tables of one segment's new positions: `(cos, sin)` per RoPE angle set.
type RopeTables<B> = Vec<(Tensor<B, 2>, Tensor<B, 2>)>;

impl<B: ToyBackend> Transformer<B> {
    /// Number of transformer blocks.
    pub fn n_layer(&self) -> usize {
        self.blocks.len()
    }

    /// The device the model's weights live on.
    pub fn device(&self) -> B::Device {
        self.output_norm.gamma.device()
    }

    /// The output head: its own matrix, or a view of the token embedding when tied (no copy;
    /// a packed table stays packed, as llama.cpp multiplies by it).
    pub fn head(&self) -> Cow<'_, QLinear<B>> {
        match &self.output {
            Some(output) => Cow::Borrowed(output),
            None => Cow::Owned(self.token_embd.tied_head()),
        }
    }

    /// Run with a context of `n_ctx` tokens (what the KV cache may hold). This matters to
    /// LongRoPE, whose factors depend on it as in llama.cpp (`n_ctx` there).
    pub fn set_context(&mut self, n_ctx: usize) {
        self.context_length = n_ctx;
        if let Some(long) = &self.long_rope {
            self.ropes[0].freq_factors = Some(long.factors(n_ctx).to_vec());
        }
    }

    /// An empty KV cache for one sequence of this model.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.blocks.len())
    }

    /// Run `tokens[batch, t]` after the `cache.len()` tokens already in the cache and append
    /// them to it. Returns the final hidden states `[batch, t, d_model]` (after the output norm).
    pub fn forward_hidden(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let t = tokens.dims()[1];
        self.forward_segments(tokens, &mut cache::segments(vec![cache], &[t]))
    }

    /// Run several sequences in one pass: `tokens[1, T]` holds each segment's new tokens one
    /// after another ([`crate::cache`]). Returns the final hidden states `[1, T, d_model]`;
    /// with one segment, `tokens` may have any batch size.
    pub fn forward_segments(
        &self,
        tokens: Tensor<B, 2, Int>,
        segments: &mut [Segment<'_, B>],
    ) -> Tensor<B, 3> {
        let device = tokens.device();
        let tables = |s: &Segment<'_, B>| -> RopeTables<B> {
            let (past, t) = (s.past, s.len);
            let table = |rope: &RopeAngles| {
                let (cos, sin) = rope.cos_sin(past as i64..(past + t) as i64);
                let half = cos.len() / t;
                // f32 tables whatever the activation type: the angles need the precision.
                let f32_table =
                    |v| Tensor::from_data(TensorData::new(v, [t, half]), (&device, DType::F32));
                (f32_table(cos), f32_table(sin))
            };
            self.ropes.iter().map(table).collect()
        };
        let tables: Vec<RopeTables<B>> = segments.iter().map(tables).collect();
        B::run_pass(|| {
            let mut x = self.token_embd.forward(tokens);
            // A packed table's rows come out f32; the model may run in f16 (`--dtype f16`).
            let dtype = self.output_norm.gamma.val().dtype();
            if x.dtype() != dtype {
                x = x.cast(dtype);
            }
            if let Some(s) = self.embed_scale {
                x = x.mul_scalar(s);
            }
            for (i, block) in self.blocks.iter().enumerate() {
                x = block.forward(x, i, segments, &tables, self);
            }
            cache::advance(segments);
            rms_norm(&self.output_norm, x)
        })
    }

    /// Logits `[batch, t, vocab]` for every new position.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.logits(self.forward_hidden(tokens, cache))
    }

    /// Logits `[batch, vocab]` of the last new position only (what generation needs).
    pub fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        let h = self.forward_hidden(tokens, cache);
        let [b, t, d] = h.dims();
        self.logits(h.narrow(1, t - 1, 1).reshape([b, d]))
    }

    /// Mean next-token cross-entropy of `tokens[b, t]` (from an empty cache) against
    /// `targets[b, t]`: what training minimizes. Without a final soft-cap the head's loss need
    /// not hold the logits ([`QLinear::cross_entropy`]); without a logit scale either.
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let h = self.forward_hidden(tokens, &mut self.new_cache());
        if self.final_softcap.is_some() || self.logit_scale.is_some() {
            crate::qlinear::cross_entropy(self.logits(h), targets)
        } else {
            B::run_pass(|| self.head().cross_entropy(h, targets))
        }
    }

    /// The output head (granite's logit scale, gemma's final soft-cap) on final hidden states.
    pub fn logits<const D: usize>(&self, h: Tensor<B, D>) -> Tensor<B, D> {
        let mut logits = B::run_pass(|| self.head().forward(h));
        if let Some(s) = self.logit_scale {
            logits = logits.mul_scalar(1.0 / s);
        }
        match self.final_softcap {
            Some(cap) => softcap(logits, cap),
            None => logits,
        }
    }
}

/// `cap * tanh(x / cap)` as ggml computes it (`ggml_scale` by `1/cap`, `tanhf`, scale by `cap`).
fn softcap<B: Backend, const D: usize>(x: Tensor<B, D>, cap: f32) -> Tensor<B, D> {
    x.mul_scalar(1.0 / cap).tanh().mul_scalar(cap)
}

/// `x` rounded to the nearest f16 value (ties to even), computed in f32 arithmetic so that it
/// runs on every backend (NdArray has no f16): for `|x|` below 10 (all this is used for), the
/// f16 spacing `q` is a power of two found by comparisons with exact powers of two, and adding
/// then subtracting `1.5 · 2²³ · q` rounds to a multiple of `q` in one correctly rounded f32 add.
fn round_to_f16<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if x.dtype() == DType::F16 {
        return x; // f16 activations (`--dtype f16`) are rounded already
    }
    let a = x.clone().abs();
    // Subnormal f16 spacing below 2^-14, then 2^(e-10) for |x| in [2^e, 2^(e+1)).
    let mut q = a.zeros_like().add_scalar(2f32.powi(-24));
    for e in -14..=4 {
        q = q.mask_fill(
            a.clone().greater_equal_elem(2f32.powi(e)),
            2f32.powi(e - 10),
        );
    }
    let c = q.mul_scalar(1.5 * 2f32.powi(23));
    let r = (a + c.clone()) - c;
    r * x.sign()
}

/// ggml's GELU (`ggml_vec_gelu_f32` with `GGML_GELU_FP16`, llama.cpp's CPU default): `x` is
/// rounded to f16, looked up in a table of `0.5x(1 + tanh(√(2/π)·x·(1 + 0.044715x²)))` computed
/// in f32 and stored as f16; `x ≤ -10` gives 0 and `x ≥ 10` gives `x`. Here the table entry is
/// computed on the fly from the same f16 input with the same f32 formula. (GCC may fuse
/// `1 + 0.044715x·x` into an FMA when it builds the table; the unit test below shows that this
/// changes exactly one of the 37376 f16 entries in (-10, 10).)
pub fn gelu_ggml<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    const GELU_COEF_A: f32 = 0.044715;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let h = round_to_f16(x.clone().clamp(-10.0, 10.0));
    let inner = h.clone().mul_scalar(SQRT_2_OVER_PI).mul(
        h.clone()
            .mul_scalar(GELU_COEF_A)
            .mul(h.clone())
            .add_scalar(1.0),
    );
    let g = round_to_f16(h.mul_scalar(0.5).mul(inner.tanh().add_scalar(1.0)));
    let g = g.mask_where(x.clone().greater_equal_elem(10.0), x.clone());
    g.mask_fill(x.lower_equal_elem(-10.0), 0.0)
}

/// RMSNorm through the backend's op (burn's `RmsNorm` holds the weight and epsilon).
fn rms_norm<B: ToyBackend, const D: usize>(norm: &RmsNorm<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(B::rms_norm(
        x.into_primitive().tensor(),
        norm.gamma.val().into_primitive().tensor(),
        norm.epsilon as f32,
    )))
}

impl<B: ToyBackend> Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        layer: usize,
        segments: &mut [Segment<'_, B>],
        tables: &[RopeTables<B>],
        model: &Transformer<B>,
    ) -> Tensor<B, 3> {
        let post = |norm: &Option<RmsNorm<B>>, y: Tensor<B, 3>| match norm {
            Some(n) => rms_norm(n, y),
            None => y,
        };
        let lora = self.lora.as_ref();
        let a = self.attn.forward(
            rms_norm(&self.attn_norm, x.clone()),
            layer,
            segments,
            tables,
            model,
            lora,
        );
        let scaled = |y: Tensor<B, 3>| match self.residual_scale {
            Some(s) => y.mul_scalar(s),
            None => y,
        };
        let h = scaled(post(&self.post_attn_norm, a)) + x;
        let f = match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward(rms_norm(&self.ffn_norm, h.clone()), lora),
            Ffn::Moe(moe) => moe.forward(rms_norm(&self.ffn_norm, h.clone())),
        };
        scaled(post(&self.post_ffn_norm, f)) + h
    }
}

impl<B: ToyBackend> Attention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        layer: usize,
        segments: &mut [Segment<'_, B>],
        tables: &[RopeTables<B>],
        model: &Transformer<B>,
        lora: Option<&BlockLora<B>>,
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        let adapter = |target: Target| lora.and_then(|l| l.get(target));
        // Project every row at once, Q, K and V together; a fused Q|K|V adapter (phi3) gives
        // each projection its rows.
        let weights = [&self.wq, &self.wk, &self.wv];
        let outs = weights.map(|w| w.dims()[0]);
        let [q_all, k_all, v_all] = project_each(
            weights,
            [adapter(Target::Q), adapter(Target::K), adapter(Target::V)],
            fused_deltas(adapter(Target::Qkv), &x, outs),
            x,
        );
        // + bias, + norm: the norms are per token (or per head).
        let finish = |mut y: Tensor<B, 3>,
                      bias: &Option<Param<Tensor<B, 1>>>,
                      norm: &Option<RmsNorm<B>>,
                      n: usize| {
            if let Some(bias) = bias {
                y = y + bias.val().unsqueeze::<3>();
            }
            match norm {
                Some(norm) if self.qk_norm_full => y = rms_norm(norm, y),
                _ => {}
            }
            match norm {
                Some(norm) if !self.qk_norm_full => {
                    let per_head = rms_norm(norm, y.reshape([b, t, n, self.head_dim]));
                    y = per_head.reshape([b, t, n * self.head_dim]);
                }
                _ => {}
            }
            y
        };
        let q_all = finish(q_all, &self.bq, &self.q_norm, self.n_head);
        let k_all = finish(k_all, &self.bk, &self.k_norm, self.n_head_kv);
        let v_all = finish(v_all, &self.bv, &None, self.n_head_kv);
        // RoPE and attention per sequence: its positions, its cache.
        let n_segments = segments.len();
        let heads = |y: Tensor<B, 3>, n: usize| {
            Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(B::split_heads(
                y.into_primitive().tensor(),
                n,
            )))
        };
        let mut parts = Vec::with_capacity(n_segments);
        for (segment, tables) in segments.iter_mut().zip(tables) {
            let q = heads(cache::rows(&q_all, segment, n_segments), self.n_head);
            let k = heads(cache::rows(&k_all, segment, n_segments), self.n_head_kv);
            let v = heads(cache::rows(&v_all, segment, n_segments), self.n_head_kv);
            let (mut q, k) = match self.rope_set {
                Some(set) => (
                    self.rope(q, &tables[set], model),
                    self.rope(k, &tables[set], model),
                ),
                None => (q, k),
            };
            let (k, v) = segment.cache.append(layer, k, v);
            let scale = match self.query_scale {
                Some(s) => {
                    q = q.mul_scalar(s);
                    1.0
                }
                None => self.kq_scale.unwrap_or(1.0 / (self.head_dim as f32).sqrt()),
            };
            let options = AttentionOptions {
                scale,
                q_offset: segment.past,
                window: self.window,
                softcap: self.softcap,
            };
            parts.push(AttentionPart {
                q: q.into_primitive().tensor(),
                k: k.into_primitive().tensor(),
                v: v.into_primitive().tensor(),
                options,
            });
        }
        project(&self.wo, adapter(Target::O), cache::attend(parts))
    }

    fn rope(
        &self,
        x: Tensor<B, 4>,
        (cos, sin): &(Tensor<B, 2>, Tensor<B, 2>),
        model: &Transformer<B>,
    ) -> Tensor<B, 4> {
        let layout = if model.rope_interleaved {
            RopeLayout::Interleaved
        } else {
            RopeLayout::Neox
        };
        Tensor::from_primitive(TensorPrimitive::Float(B::rope(
            x.into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
            layout,
        )))
    }
}

impl<B: Backend> Block<B> {
    /// The weight of projection `t`; `None` for a fused target (the model keeps the parts
    /// apart) and for the MLP of a mixture of experts.
    pub fn projection(&self, t: Target) -> Option<&QLinear<B>> {
        let mlp = match &self.ffn {
            Ffn::Dense(mlp) => Some(mlp),
            Ffn::Moe(_) => None,
        };
        match t {
            Target::Q => Some(&self.attn.wq),
            Target::K => Some(&self.attn.wk),
            Target::V => Some(&self.attn.wv),
            Target::O => Some(&self.attn.wo),
            Target::Gate => mlp.map(|m| &m.gate),
            Target::Up => mlp.map(|m| &m.up),
            Target::Down => mlp.map(|m| &m.down),
            Target::Qkv | Target::GateUp => None,
        }
    }

    /// The weight of projection `t`, to replace it (see [`Self::projection`]).
    pub fn projection_mut(&mut self, t: Target) -> Option<&mut QLinear<B>> {
        let mlp = match &mut self.ffn {
            Ffn::Dense(mlp) => Some(mlp),
            Ffn::Moe(_) => None,
        };
        match t {
            Target::Q => Some(&mut self.attn.wq),
            Target::K => Some(&mut self.attn.wk),
            Target::V => Some(&mut self.attn.wv),
            Target::O => Some(&mut self.attn.wo),
            Target::Gate => mlp.map(|m| &mut m.gate),
            Target::Up => mlp.map(|m| &mut m.up),
            Target::Down => mlp.map(|m| &mut m.down),
            Target::Qkv | Target::GateUp => None,
        }
    }
}

impl<B: Backend> LoraBlock<B> for Block<B> {
    fn adapted(&self, t: Target) -> Result<Vec<&QLinear<B>>, LoraError> {
        let a = &self.attn;
        match (t, &self.ffn) {
            (Target::Qkv, _) => Ok(vec![&a.wq, &a.wk, &a.wv]),
            (Target::GateUp, Ffn::Dense(m)) => Ok(vec![&m.gate, &m.up]),
            _ => Ok(vec![self.projection(t).ok_or(LoraError::Moe)?]),
        }
    }

    fn adapted_mut(&mut self, t: Target) -> Result<Vec<&mut QLinear<B>>, LoraError> {
        match t {
            Target::Qkv => {
                let a = &mut self.attn;
                Ok(vec![&mut a.wq, &mut a.wk, &mut a.wv])
            }
            Target::GateUp => match &mut self.ffn {
                Ffn::Dense(m) => Ok(vec![&mut m.gate, &mut m.up]),
                Ffn::Moe(_) => Err(LoraError::Moe),
            },
            _ => Ok(vec![self.projection_mut(t).ok_or(LoraError::Moe)?]),
        }
    }

    fn lora(&self) -> Option<&BlockLora<B>> {
        self.lora.as_ref()
    }

    fn lora_mut(&mut self) -> &mut Option<BlockLora<B>> {
        &mut self.lora
    }
}

impl<B: Backend> Adaptable<B> for Transformer<B> {
    fn lora_blocks(&self) -> Vec<&dyn LoraBlock<B>> {
        self.blocks.iter().map(|b| b as &dyn LoraBlock<B>).collect()
    }
    fn lora_blocks_mut(&mut self) -> Vec<&mut dyn LoraBlock<B>> {
        self.blocks
            .iter_mut()
            .map(|b| b as &mut dyn LoraBlock<B>)
            .collect()
    }
    fn lora_device(&self) -> B::Device {
        self.output_norm.gamma.device()
    }
}

impl<B: ToyBackend> Mlp<B> {
    fn forward<const D: usize>(
        &self,
        x: Tensor<B, D>,
        lora: Option<&BlockLora<B>>,
    ) -> Tensor<B, D> {
        let adapter = |target: Target| lora.and_then(|l| l.get(target));
        // A fused gate|up adapter (phi3) gives each its rows.
        let outs = [self.gate.dims()[0], self.up.dims()[0]];
        let [gate_delta, up_delta] = fused_deltas(adapter(Target::GateUp), &x, outs);
        let [gate, up] = project_each(
            [&self.gate, &self.up],
            [adapter(Target::Gate), adapter(Target::Up)],
            [gate_delta, up_delta],
            x,
        );
        let h = if self.gelu {
            gelu_ggml(gate) * up
        } else {
            Tensor::from_primitive(TensorPrimitive::Float(B::swiglu(
                gate.into_primitive().tensor(),
                up.into_primitive().tensor(),
            )))
        };
        project_with(&self.down, adapter(Target::Down), None, h)
    }
}

impl<B: ToyBackend> Moe<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, t, d] = x.dims();
        let n = b * t;
        let (k, n_expert) = (self.n_used, self.experts.len());
        let x = x.reshape([n, d]);
        let device = x.device();
        // Routing on the host: softmax over the experts, the k most probable (ties: lower id).
        // The weights themselves are taken from the device tensor (below), so a backward pass
        // reaches the router and, through it, the layers before (LoRA on the attention).
        let probs_t = activation::softmax(self.router.forward(x.clone()), 1);
        let probs = probs_t
            .clone()
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("router probabilities read back as f32");
        let flat = probs_t.reshape([n * n_expert]);
        let pick = |idx: Vec<i64>| {
            let m = idx.len();
            flat.clone().select(
                0,
                Tensor::<B, 1, Int>::from_data(TensorData::new(idx, [m]), &device),
            )
        };
        // Slot `token * k + rank` holds the rank-th chosen expert of a token.
        let mut slots = Vec::with_capacity(n * k);
        for row in probs.chunks(n_expert) {
            let mut order: Vec<usize> = (0..n_expert).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
            slots.extend_from_slice(&order[..k]);
        }
        // Renormalizing: each token's sum over its chosen experts, added in rank order (as
        // llama.cpp sums them; the same bits as a host sum), clamped as ggml clamps it.
        let norm = self.norm_weights.then(|| {
            let rank = |r: usize| {
                pick(
                    (0..n)
                        .map(|i| (i * n_expert + slots[i * k + r]) as i64)
                        .collect(),
                )
            };
            let mut sum = rank(0);
            for r in 1..k {
                sum = sum + rank(r);
            }
            sum.clamp_min(6.103_515_6e-5)
        });
        // Each expert runs once on the tokens routed to it; outputs are weighted, put back in
        // slot order and summed over the ranks in order (as llama.cpp adds them).
        let mut outputs = Vec::new();
        let mut position = vec![0i64; n * k];
        let mut next = 0;
        for (e, expert) in self.experts.iter().enumerate() {
            let mine: Vec<usize> = (0..n * k).filter(|&s| slots[s] == e).collect();
            if mine.is_empty() {
                continue;
            }
            let m = mine.len();
            let rows: Vec<i64> = mine.iter().map(|&s| (s / k) as i64).collect();
            let mut weights = pick(
                rows.iter()
                    .map(|&i| i * n_expert as i64 + e as i64)
                    .collect(),
            );
            let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [m]), &device);
            if let Some(sum) = &norm {
                weights = weights / sum.clone().select(0, rows.clone());
            }
            let weights = weights.reshape([m, 1]);
            outputs.push(expert.forward(x.clone().select(0, rows), None) * weights);
            for s in mine {
                position[s] = next;
                next += 1;
            }
        }
        let position = Tensor::<B, 1, Int>::from_data(TensorData::new(position, [n * k]), &device);
        let y = Tensor::cat(outputs, 0)
            .select(0, position)
            .reshape([n, k, d]);
        let mut out = y.clone().narrow(1, 0, 1);
        for r in 1..k {
            out = out + y.clone().narrow(1, r, 1);
        }
        out.reshape([b, t, d])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::f16;

    fn host(t: Tensor<Flex, 1>) -> Vec<f32> {
        t.into_data().into_vec::<f32>().unwrap()
    }

    /// f16 rounding in f32 arithmetic equals a real f32 -> f16 conversion (ties to even).
    #[test]
    fn round_to_f16_is_exact() {
        let mut xs: Vec<f32> = (0..200_000)
            .map(|i| (i as f32 * 0.618_034).sin() * 9.99 * ((i % 13) as f32 / 13.0 + 1e-6))
            .collect();
        // Exact ties between two f16 values, and f16 subnormals.
        xs.extend((0..2000u16).map(|b| {
            let lo = f16::from_bits(b * 29 % 0x4900).to_f32();
            let hi = f16::from_bits(b * 29 % 0x4900 + 1).to_f32();
            (lo + hi) / 2.0
        }));
        let n = xs.len();
        let got = host(round_to_f16(Tensor::from_data(
            TensorData::new(xs.clone(), [n]),
            &Default::default(),
        )));
        for (x, r) in xs.iter().zip(got) {
            assert_eq!(f16::from_f32(*x).to_f32(), r, "x = {x:e}");
        }
    }

    /// ggml's GELU table, built as ggml-cpu.c builds it (without and with the FMA GCC may use),
    /// against `gelu_ggml` on every f16 input in (-10, 10).
    #[test]
    fn gelu_matches_ggml_table() {
        fn gelu_f32(x: f32, fma: bool) -> f32 {
            const A: f32 = 0.044715;
            const S: f32 = 0.797_884_6;
            let inner = if fma {
                (A * x).mul_add(x, 1.0)
            } else {
                A * x * x + 1.0
            };
            0.5 * x * (1.0 + (S * x * inner).tanh())
        }
        let xs: Vec<f32> = (0..=u16::MAX)
            .map(|b| f16::from_bits(b).to_f32())
            .filter(|x| x.abs() < 10.0)
            .collect();
        let n = xs.len();
        let table = |fma| -> Vec<f32> {
            xs.iter()
                .map(|&x| f16::from_f32(gelu_f32(x, fma)).to_f32())
                .collect()
        };
        let got = host(gelu_ggml(Tensor::from_data(
            TensorData::new(xs.clone(), [n]),
            &Default::default(),
        )));
        assert_eq!(got, table(false));
        let differ = table(true).iter().zip(&got).filter(|(a, b)| a != b).count();
        assert_eq!(differ, 1);
        // Outside (-10, 10): 0 below, the identity above.
        let edge = host(gelu_ggml(Tensor::from_data(
            TensorData::new(vec![-12.0f32, -10.0, 10.0, 12.5], [4]),
            &Default::default(),
        )));
        assert_eq!(edge, vec![0.0, 0.0, 10.0, 12.5]);
    }
}
