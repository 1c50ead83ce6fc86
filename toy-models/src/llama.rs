//! The llama-family transformer (Llama, SmolLM2, TinyLlama, Mistral): pre-norm blocks of
//! grouped-query attention with RoPE and a SwiGLU MLP, RMSNorm, token embedding and an output
//! head (tied or not). The hot ops go through [`ToyBackend`]: quantized matmuls (in
//! [`QLinear`]), RoPE and causal attention.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Embedding, EmbeddingConfig, RmsNorm, RmsNormConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorPrimitive};
use toy_core::rope::RopeAngles;
use toy_kernels::{AttentionOptions, RopeLayout, ToyBackend};

use crate::qlinear::QLinear;

/// The shape of a llama-family model.
#[derive(Config, Debug)]
pub struct LlamaConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (`n_head` must be a multiple; fewer = grouped-query attention).
    pub n_head_kv: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU MLP.
    pub d_ff: usize,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Longest context the model supports (KV cache capacity).
    pub context_length: usize,
    /// RMSNorm epsilon.
    #[config(default = 1e-5)]
    pub rms_eps: f64,
    /// RoPE base frequency θ.
    #[config(default = 10000.0)]
    pub rope_theta: f32,
    /// Dimensions of each head that RoPE rotates (0 = all of `head_dim`).
    #[config(default = 0)]
    pub rope_dim: usize,
    /// Rotate interleaved pairs (GGUF `llama`) rather than half-split pairs.
    #[config(default = true)]
    pub rope_interleaved: bool,
    /// The output head reuses the token embedding.
    #[config(default = true)]
    pub tied_embeddings: bool,
    /// Q/K/V projections have biases (qwen2).
    #[config(default = false)]
    pub attn_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
}

impl LlamaConfig {
    pub fn from_model_config(c: &toy_core::config::ModelConfig) -> Self {
        LlamaConfig::new(
            c.n_layer,
            c.d_model,
            c.n_head,
            c.n_head_kv,
            c.head_dim,
            c.d_ff,
            c.vocab_size,
            c.context_length,
        )
        .with_rms_eps(c.rms_eps as f64)
        .with_rope_theta(c.rope_theta)
        .with_rope_dim(c.rope_dim)
        .with_rope_interleaved(c.rope_layout == toy_core::config::RopeLayout::Interleaved)
        .with_tied_embeddings(c.tied_embeddings)
        .with_attn_bias(c.attn_bias)
        .with_qk_norm(c.qk_norm)
    }

    fn rope_dim(&self) -> usize {
        if self.rope_dim == 0 {
            self.head_dim
        } else {
            self.rope_dim
        }
    }

    /// A randomly initialized model (small normal weights), for training from scratch and tests.
    pub fn init<B: ToyBackend>(&self, device: &B::Device) -> Transformer<B> {
        let dense = |out: usize, inp: usize| {
            let std = (1.0 / inp as f64).sqrt();
            QLinear::Dense(Param::from_tensor(Tensor::random(
                [out, inp],
                Distribution::Normal(0.0, std),
                device,
            )))
        };
        let norm = || {
            RmsNormConfig::new(self.d_model)
                .with_epsilon(self.rms_eps)
                .init(device)
        };
        let head_norm = || {
            RmsNormConfig::new(self.head_dim)
                .with_epsilon(self.rms_eps)
                .init(device)
        };
        let bias = |n: usize| Param::from_tensor(Tensor::zeros([n], device));
        let blocks = (0..self.n_layer)
            .map(|_| Block {
                attn_norm: norm(),
                attn: Attention {
                    wq: dense(self.n_head * self.head_dim, self.d_model),
                    wk: dense(self.n_head_kv * self.head_dim, self.d_model),
                    wv: dense(self.n_head_kv * self.head_dim, self.d_model),
                    wo: dense(self.d_model, self.n_head * self.head_dim),
                    bq: self.attn_bias.then(|| bias(self.n_head * self.head_dim)),
                    bk: self.attn_bias.then(|| bias(self.n_head_kv * self.head_dim)),
                    bv: self.attn_bias.then(|| bias(self.n_head_kv * self.head_dim)),
                    q_norm: self.qk_norm.then(&head_norm),
                    k_norm: self.qk_norm.then(&head_norm),
                    n_head: self.n_head,
                    n_head_kv: self.n_head_kv,
                    head_dim: self.head_dim,
                },
                ffn_norm: norm(),
                mlp: Mlp {
                    gate: dense(self.d_ff, self.d_model),
                    up: dense(self.d_ff, self.d_model),
                    down: dense(self.d_model, self.d_ff),
                },
            })
            .collect();
        let token_embd = EmbeddingConfig::new(self.vocab_size, self.d_model).init(device);
        let output = if self.tied_embeddings {
            QLinear::Dense(Param::from_tensor(token_embd.weight.val()))
        } else {
            dense(self.vocab_size, self.d_model)
        };
        self.assemble(token_embd, blocks, norm(), output, self.rope_angles())
    }

    /// Plain RoPE angles for this config (θ base, rotated dims, no scaling): what a model made
    /// from scratch uses. Loaded models take theirs from the GGUF metadata.
    pub fn rope_angles(&self) -> RopeAngles {
        RopeAngles {
            n_dims: self.rope_dim(),
            freq_base: self.rope_theta,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            corr_dims: [0.0, 0.0],
            freq_factors: None,
        }
    }

    /// Put loaded or initialized parts together.
    pub fn assemble<B: ToyBackend>(
        &self,
        token_embd: Embedding<B>,
        blocks: Vec<Block<B>>,
        output_norm: RmsNorm<B>,
        output: QLinear<B>,
        rope: RopeAngles,
    ) -> Transformer<B> {
        Transformer {
            token_embd,
            blocks,
            output_norm,
            output,
            rope,
            rope_interleaved: self.rope_interleaved,
            context_length: self.context_length,
        }
    }
}

/// The whole model.
#[derive(Module, Debug)]
pub struct Transformer<B: Backend> {
    pub token_embd: Embedding<B>,
    pub blocks: Vec<Block<B>>,
    pub output_norm: RmsNorm<B>,
    pub output: QLinear<B>,
    /// How RoPE angles are computed (host-side, as llama.cpp does; not a parameter).
    #[module(skip)]
    pub rope: RopeAngles,
    pub rope_interleaved: bool,
    pub context_length: usize,
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attn_norm: RmsNorm<B>,
    pub attn: Attention<B>,
    pub ffn_norm: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub wq: QLinear<B>,
    pub wk: QLinear<B>,
    pub wv: QLinear<B>,
    pub wo: QLinear<B>,
    /// Q/K/V biases (qwen2).
    pub bq: Option<Param<Tensor<B, 1>>>,
    pub bk: Option<Param<Tensor<B, 1>>>,
    pub bv: Option<Param<Tensor<B, 1>>>,
    /// Per-head query/key RMSNorm before RoPE (qwen3).
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub gate: QLinear<B>,
    pub up: QLinear<B>,
    pub down: QLinear<B>,
}

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

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Append this step's keys and values for `layer`; returns everything held for it.
    fn append(
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

/// Context for one forward pass: where the new tokens sit and their RoPE tables.
struct Step<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    past: usize,
}

impl<B: ToyBackend> Transformer<B> {
    pub fn n_layer(&self) -> usize {
        self.blocks.len()
    }

    /// The device the model's weights live on.
    pub fn device(&self) -> B::Device {
        self.output_norm.gamma.device()
    }

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
        let [_, t] = tokens.dims();
        let device = tokens.device();
        let past = cache.len;
        let (cos, sin) = self.rope.cos_sin(past as i64..(past + t) as i64);
        let half = cos.len() / t;
        let step = Step {
            cos: Tensor::from_data(TensorData::new(cos, [t, half]), &device),
            sin: Tensor::from_data(TensorData::new(sin, [t, half]), &device),
            past,
        };
        let mut x = self.token_embd.forward(tokens);
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(x, i, cache, &step, self);
        }
        cache.len += t;
        rms_norm(&self.output_norm, x)
    }

    /// Logits `[batch, t, vocab]` for every new position.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.output.forward(self.forward_hidden(tokens, cache))
    }

    /// Logits `[batch, vocab]` of the last new position only (what generation needs).
    pub fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        let h = self.forward_hidden(tokens, cache);
        let [b, t, d] = h.dims();
        self.output.forward(h.narrow(1, t - 1, 1).reshape([b, d]))
    }
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
        cache: &mut KvCache<B>,
        step: &Step<B>,
        model: &Transformer<B>,
    ) -> Tensor<B, 3> {
        let h = x.clone()
            + self
                .attn
                .forward(rms_norm(&self.attn_norm, x), layer, cache, step, model);
        h.clone() + self.mlp.forward(rms_norm(&self.ffn_norm, h))
    }
}

impl<B: ToyBackend> Attention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        layer: usize,
        cache: &mut KvCache<B>,
        step: &Step<B>,
        model: &Transformer<B>,
    ) -> Tensor<B, 3> {
        let [b, t, _] = x.dims();
        // Project (+ bias), split into heads (+ per-head norm), heads before tokens.
        let heads = |w: &QLinear<B>,
                     bias: &Option<Param<Tensor<B, 1>>>,
                     norm: &Option<RmsNorm<B>>,
                     n: usize| {
            let mut y = w.forward(x.clone());
            if let Some(bias) = bias {
                y = y + bias.val().unsqueeze::<3>();
            }
            let mut y = y.reshape([b, t, n, self.head_dim]);
            if let Some(norm) = norm {
                y = rms_norm(norm, y);
            }
            y.swap_dims(1, 2)
        };
        let q = heads(&self.wq, &self.bq, &self.q_norm, self.n_head);
        let k = heads(&self.wk, &self.bk, &self.k_norm, self.n_head_kv);
        let v = heads(&self.wv, &self.bv, &None, self.n_head_kv);
        let q = self.rope(q, step, model);
        let k = self.rope(k, step, model);
        let (k, v) = cache.append(layer, k, v);
        let options = AttentionOptions {
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            q_offset: step.past,
            window: None,
            softcap: None,
        };
        let out = <B as ToyBackend>::attention(
            q.into_primitive().tensor(),
            k.into_primitive().tensor(),
            v.into_primitive().tensor(),
            options,
        );
        let out: Tensor<B, 4> = Tensor::from_primitive(TensorPrimitive::Float(out));
        self.wo.forward(
            out.swap_dims(1, 2)
                .reshape([b, t, self.n_head * self.head_dim]),
        )
    }

    fn rope(&self, x: Tensor<B, 4>, step: &Step<B>, model: &Transformer<B>) -> Tensor<B, 4> {
        let layout = if model.rope_interleaved {
            RopeLayout::Interleaved
        } else {
            RopeLayout::Neox
        };
        Tensor::from_primitive(TensorPrimitive::Float(B::rope(
            x.into_primitive().tensor(),
            step.cos.clone().into_primitive().tensor(),
            step.sin.clone().into_primitive().tensor(),
            layout,
        )))
    }
}

impl<B: ToyBackend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = self.gate.forward(x.clone()).into_primitive().tensor();
        let up = self.up.forward(x).into_primitive().tensor();
        self.down
            .forward(Tensor::from_primitive(TensorPrimitive::Float(B::swiglu(
                gate, up,
            ))))
    }
}
