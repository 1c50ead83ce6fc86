//! The configuration of the llama-family model: its shape and the fields that make each family
//! (`LlamaConfig`), how a GGUF's `ModelConfig` maps onto it, and a freshly initialized model.

use burn::config::Config;
use burn::nn::{EmbeddingConfig, RmsNormConfig};
use burn::tensor::Distribution;

use super::*;

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
    /// The output head multiplies by the token embedding (one table, trained through both uses
    /// and saved once); `false` gives the head its own matrix (`output.weight`).
    #[config(default = true)]
    pub tied_embeddings: bool,
    /// Q/K/V projections have biases (qwen2).
    #[config(default = false)]
    pub attn_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3).
    #[config(default = false)]
    pub qk_norm: bool,
    /// RMSNorm of the whole Q and K projections before RoPE, weights of the projection's width
    /// (olmoe). Exclusive with `qk_norm`.
    #[config(default = false)]
    pub qk_norm_full: bool,
    /// Multiply token embeddings by this (gemma: `sqrtf(d_model)`; granite).
    #[config(default = "None")]
    pub embed_scale: Option<f32>,
    /// Multiply each sublayer's output by this before its residual add (granite).
    #[config(default = "None")]
    pub residual_scale: Option<f32>,
    /// Multiply the logits by `1 / logit_scale` (granite).
    #[config(default = "None")]
    pub logit_scale: Option<f32>,
    /// An RMSNorm after each sublayer, before its residual add (gemma2).
    #[config(default = false)]
    pub post_norms: bool,
    /// GELU-tanh gate (gemma2) instead of SiLU.
    #[config(default = false)]
    pub gelu: bool,
    /// Multiply queries by this and attend with scale 1 (gemma2); `None`: scale `1/sqrt(head_dim)`.
    #[config(default = "None")]
    pub query_scale: Option<f32>,
    /// The attention's score scale when queries are not scaled (granite); `None`: `1/sqrt(head_dim)`.
    #[config(default = "None")]
    pub kq_scale: Option<f32>,
    /// Attention logit soft-cap (gemma2).
    #[config(default = "None")]
    pub attn_softcap: Option<f32>,
    /// Output logit soft-cap (gemma2).
    #[config(default = "None")]
    pub final_softcap: Option<f32>,
    /// Sliding-window size for the layers `swa_layers` marks (all layers if it is empty).
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// Per layer: does it use the sliding window?
    #[config(default = "Vec::new()")]
    pub swa_layers: Vec<bool>,
    /// RoPE base of the sliding-window layers, unscaled (gemma3); `None`: `rope_theta`.
    #[config(default = "None")]
    pub rope_theta_swa: Option<f32>,
    /// Per layer: does it skip RoPE (smollm3)? Empty: no layer does.
    #[config(default = "Vec::new()")]
    pub no_rope_layers: Vec<bool>,
    /// Mixture of experts: number of SwiGLU experts of width `d_ff` (0 = a dense MLP).
    #[config(default = 0)]
    pub n_expert: usize,
    /// Experts each token uses.
    #[config(default = 0)]
    pub n_expert_used: usize,
    /// Renormalize the chosen experts' weights to sum to 1.
    #[config(default = false)]
    pub expert_weights_norm: bool,
}

impl LlamaConfig {
    /// The config of a loaded llama-family GGUF, from its `ModelConfig`.
    pub fn from_model_config(c: &toy_core::config::ModelConfig) -> Self {
        use toy_core::config::{FfnKind, QkNorm};
        let (n_expert, n_expert_used, expert_weights_norm) = match c.ffn {
            FfnKind::Moe {
                n_expert,
                n_expert_used,
                norm_weights,
            } => (n_expert, n_expert_used, norm_weights),
            _ => (0, 0, false),
        };
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
        .with_qk_norm(c.qk_norm == QkNorm::PerHead)
        .with_qk_norm_full(c.qk_norm == QkNorm::Full)
        .with_embed_scale(c.embed_scale)
        .with_residual_scale(c.residual_scale)
        .with_logit_scale(c.logit_scale)
        .with_kq_scale(c.kq_scale)
        .with_rope_theta_swa(c.rope_theta_swa)
        .with_no_rope_layers(c.no_rope_layers.clone())
        .with_post_norms(c.post_norms)
        .with_gelu(c.ffn == FfnKind::GeGlu)
        .with_query_scale(c.query_scale)
        .with_attn_softcap(c.attn_softcap)
        .with_final_softcap(c.final_softcap)
        .with_sliding_window(c.sliding_window)
        .with_swa_layers(c.swa_layers.clone())
        .with_n_expert(n_expert)
        .with_n_expert_used(n_expert_used)
        .with_expert_weights_norm(expert_weights_norm)
    }

    /// The attention window of layer `i`, if it has one.
    pub fn window(&self, i: usize) -> Option<usize> {
        let on = self.swa_layers.is_empty() || self.swa_layers.get(i).copied().unwrap_or(false);
        self.sliding_window.filter(|_| on)
    }

    /// Which of the model's RoPE angle sets layer `i` uses (`Transformer::ropes`): 0, or 1 for
    /// a sliding-window layer with its own base; `None`: the layer has no RoPE.
    pub fn rope_set(&self, i: usize) -> Option<usize> {
        if self.no_rope_layers.get(i).copied().unwrap_or(false) {
            return None;
        }
        Some(usize::from(
            self.rope_theta_swa.is_some() && self.window(i).is_some(),
        ))
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
        let full_norm = |n: usize| {
            RmsNormConfig::new(n)
                .with_epsilon(self.rms_eps)
                .init(device)
        };
        let bias = |n: usize| Param::from_tensor(Tensor::zeros([n], device));
        let (qdim, kvdim) = (self.n_head * self.head_dim, self.n_head_kv * self.head_dim);
        let mlp = || Mlp {
            gate: dense(self.d_ff, self.d_model),
            up: dense(self.d_ff, self.d_model),
            down: dense(self.d_model, self.d_ff),
            gelu: self.gelu,
        };
        let blocks = (0..self.n_layer)
            .map(|i| Block {
                attn_norm: norm(),
                attn: Attention {
                    wq: dense(qdim, self.d_model),
                    wk: dense(kvdim, self.d_model),
                    wv: dense(kvdim, self.d_model),
                    wo: dense(self.d_model, qdim),
                    bq: self.attn_bias.then(|| bias(qdim)),
                    bk: self.attn_bias.then(|| bias(kvdim)),
                    bv: self.attn_bias.then(|| bias(kvdim)),
                    q_norm: match (self.qk_norm, self.qk_norm_full) {
                        (true, _) => Some(head_norm()),
                        (_, true) => Some(full_norm(qdim)),
                        _ => None,
                    },
                    k_norm: match (self.qk_norm, self.qk_norm_full) {
                        (true, _) => Some(head_norm()),
                        (_, true) => Some(full_norm(kvdim)),
                        _ => None,
                    },
                    n_head: self.n_head,
                    n_head_kv: self.n_head_kv,
                    head_dim: self.head_dim,
                    qk_norm_full: self.qk_norm_full,
                    query_scale: self.query_scale,
                    kq_scale: self.kq_scale,
                    softcap: self.attn_softcap,
                    window: self.window(i),
                    rope_set: self.rope_set(i),
                },
                post_attn_norm: self.post_norms.then(norm),
                ffn_norm: norm(),
                ffn: if self.n_expert > 0 {
                    Ffn::Moe(Moe {
                        router: dense(self.n_expert, self.d_model),
                        experts: (0..self.n_expert).map(|_| mlp()).collect(),
                        n_used: self.n_expert_used,
                        norm_weights: self.expert_weights_norm,
                    })
                } else {
                    Ffn::Dense(mlp())
                },
                post_ffn_norm: self.post_norms.then(norm),
                residual_scale: self.residual_scale,
                lora: None,
            })
            .collect();
        let token_embd =
            TokenEmbedding::Dense(EmbeddingConfig::new(self.vocab_size, self.d_model).init(device));
        let output = (!self.tied_embeddings).then(|| dense(self.vocab_size, self.d_model));
        let mut ropes = vec![self.rope_angles()];
        if let Some(theta) = self.rope_theta_swa {
            ropes.push(RopeAngles {
                freq_base: theta,
                ..self.rope_angles()
            });
        }
        self.assemble(token_embd, blocks, norm(), output, ropes, None)
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
        token_embd: TokenEmbedding<B>,
        blocks: Vec<Block<B>>,
        output_norm: RmsNorm<B>,
        output: Option<QLinear<B>>,
        ropes: Vec<RopeAngles>,
        long_rope: Option<LongRope>,
    ) -> Transformer<B> {
        let mut model = Transformer {
            token_embd,
            blocks,
            output_norm,
            output,
            ropes,
            long_rope,
            rope_interleaved: self.rope_interleaved,
            context_length: self.context_length,
            embed_scale: self.embed_scale,
            logit_scale: self.logit_scale,
            final_softcap: self.final_softcap,
        };
        model.set_context(self.context_length);
        model
    }
}

/// LongRoPE's two sets of per-pair frequency divisors (phi3): llama.cpp uses the long ones when
/// the context it runs with, rounded up to a multiple of 256, exceeds the original context —
/// one choice per context, not per position.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    /// Divisors for a context longer than `original_context`.
    pub long: Vec<f32>,
    /// Divisors for a context up to `original_context`.
    pub short: Vec<f32>,
    /// The context the model was trained with before LongRoPE extension.
    pub original_context: usize,
}

impl LongRope {
    /// The factors for a context of `n_ctx` tokens.
    pub fn factors(&self, n_ctx: usize) -> &[f32] {
        if n_ctx.div_ceil(256) * 256 > self.original_context {
            &self.long
        } else {
            &self.short
        }
    }
}
