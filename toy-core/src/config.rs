//! The model configuration, read from GGUF metadata (`<arch>.*` keys).

use crate::gguf::{GgufError, GgufFile};

/// Architectures whose GGUF files toy can load.
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["llama", "qwen2", "qwen3", "gemma2", "olmoe", "gpt2"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("unsupported architecture {0:?}: toy runs {supported}", supported = SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture(String),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("invalid model metadata: {0}")]
    Invalid(String),
}

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i+1)`: ggml's "normal" mode, used by GGUF `llama` files (whose converter
    /// permutes the Q/K weights into this layout).
    Interleaved,
    /// Pairs `(i, i + d/2)`: ggml's "neox" mode (qwen2, gemma2, …).
    Neox,
}

/// RoPE frequency scaling, as `<arch>.rope.scaling.*` describes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN: slow-rotating dims interpolated by `factor`, fast ones kept, a magnitude correction.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        attn_factor: f32,
    },
}

/// How queries and keys are normalized before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// RMSNorm of each head (weights of `head_dim`): qwen3.
    PerHead,
    /// RMSNorm of the whole projection (weights of `n_head * head_dim`), before splitting into
    /// heads: olmoe.
    Full,
}

/// The normalization layers of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// RMSNorm without bias (every llama-family architecture).
    Rms,
    /// LayerNorm with weight and bias (gpt2).
    Layer,
}

/// The feed-forward network of each block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnKind {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu_tanh(gate(x)) * up(x))` (gemma2).
    GeGlu,
    /// `down(gelu_tanh(up(x) + b) ) + b` (gpt2).
    Gelu,
    /// A router picks `n_expert_used` of `n_expert` SwiGLU experts per token (olmoe).
    Moe {
        n_expert: usize,
        n_expert_used: usize,
        /// Renormalize the chosen experts' softmax weights to sum to 1 (olmoe: no).
        norm_weights: bool,
    },
}

/// Everything the transformer needs to know about its shape, read from metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub name: Option<String>,
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub d_ff: usize,
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Number of dimensions of each head that RoPE rotates (usually `head_dim`).
    pub rope_dim: usize,
    pub rope_layout: RopeLayout,
    pub rope_scaling: RopeScaling,
    /// The output projection reuses `token_embd.weight` (no `output.weight` tensor).
    pub tied_embeddings: bool,
    /// Q/K/V projections have biases (qwen2).
    pub attn_bias: bool,
    /// Query/key normalization before RoPE (qwen3: per head, olmoe: whole projection).
    pub qk_norm: QkNorm,
    /// RMSNorm or LayerNorm (`rms_eps` is the epsilon of either).
    pub norm: NormKind,
    pub ffn: FfnKind,
    /// Token embeddings are multiplied by `sqrt(d_model)` (gemma2).
    pub embed_scale: bool,
    /// An RMSNorm after each sublayer, before its residual add (gemma2).
    pub post_norms: bool,
    /// Queries are multiplied by this before attention, which then uses scale 1 (gemma2's
    /// `query_pre_attn_scalar`); `None`: scores are scaled by `1/sqrt(head_dim)`.
    pub query_scale: Option<f32>,
    /// Attention logits soft-capped as `cap * tanh(s / cap)` before the softmax (gemma2).
    pub attn_softcap: Option<f32>,
    /// Output logits soft-capped the same way (gemma2).
    pub final_softcap: Option<f32>,
    /// Sliding-window attention: each query sees only the last `window` positions, on the
    /// layers `swa_layers` marks.
    pub sliding_window: Option<usize>,
    /// One flag per layer: does it use the sliding window? (empty when there is none)
    pub swa_layers: Vec<bool>,
    /// Learned absolute position embeddings (`position_embd.weight`) instead of RoPE (gpt2).
    pub learned_positions: bool,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ConfigError> {
        let arch = file.architecture()?.to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(ConfigError::UnsupportedArchitecture(arch));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let req_usize = |k: &str| -> Result<usize, ConfigError> {
            let v = file
                .get_u64(&key(k))?
                .ok_or_else(|| GgufError::MissingKey(key(k)))?;
            usize::try_from(v)
                .map_err(|_| ConfigError::Invalid(format!("{} = {v} is too large", key(k))))
        };
        let opt_usize = |k: &str| -> Result<Option<usize>, ConfigError> {
            Ok(file.get_u64(&key(k))?.map(|v| v as usize))
        };

        let n_layer = req_usize("block_count")?;
        let d_model = req_usize("embedding_length")?;
        let n_head = req_usize("attention.head_count")?;
        let n_head_kv = opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        let d_ff = req_usize("feed_forward_length")?;
        let context_length = req_usize("context_length")?;
        // Every layer has tensors: a block count beyond the tensor count is corrupt metadata
        // (and must not size any allocation).
        if n_layer == 0 || n_layer > file.tensors.len() {
            return Err(ConfigError::Invalid(format!(
                "block_count {n_layer} does not fit the file's {} tensors",
                file.tensors.len()
            )));
        }
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ConfigError::Invalid(format!(
                "head_count {n_head} must be a positive multiple of head_count_kv {n_head_kv}"
            )));
        }
        let head_dim = match opt_usize("attention.key_length")? {
            Some(d) => d,
            None if d_model % n_head == 0 => d_model / n_head,
            None => {
                return Err(ConfigError::Invalid(format!(
                    "embedding_length {d_model} is not a multiple of head_count {n_head} and no key_length is given"
                )));
            }
        };
        let rope_dim = opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(ConfigError::Invalid(format!(
                "rope.dimension_count {rope_dim} with head_dim {head_dim}"
            )));
        }
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| ConfigError::Invalid("tensor token_embd.weight is missing".into()))?;
        let vocab_size = match opt_usize("vocab_size")? {
            Some(v) => v,
            None => embd.dims.get(1).copied().unwrap_or(0) as usize,
        };
        let norm = if arch == "gpt2" {
            NormKind::Layer
        } else {
            NormKind::Rms
        };
        let eps_key = match norm {
            NormKind::Rms => "attention.layer_norm_rms_epsilon",
            NormKind::Layer => "attention.layer_norm_epsilon",
        };
        let rms_eps = file.get_f64(&key(eps_key))?.unwrap_or(1e-5) as f32;
        let qk_norm = match (
            file.tensor("blk.0.attn_q_norm.weight").is_some(),
            arch.as_str(),
        ) {
            (false, _) => QkNorm::None,
            (true, "olmoe") => QkNorm::Full,
            (true, _) => QkNorm::PerHead,
        };
        let ffn = match arch.as_str() {
            "gemma2" => FfnKind::GeGlu,
            "gpt2" => FfnKind::Gelu,
            "olmoe" => {
                let n_expert = req_usize("expert_count")?;
                let n_expert_used = req_usize("expert_used_count")?;
                if n_expert == 0 || n_expert_used == 0 || n_expert_used > n_expert {
                    return Err(ConfigError::Invalid(format!(
                        "expert_used_count {n_expert_used} must be between 1 and expert_count {n_expert}"
                    )));
                }
                FfnKind::Moe {
                    n_expert,
                    n_expert_used,
                    norm_weights: false,
                }
            }
            _ => FfnKind::SwiGlu,
        };
        let gemma2 = arch == "gemma2";
        let softcap = |k: &str, default: f32| -> Result<Option<f32>, ConfigError> {
            if !gemma2 {
                return Ok(None);
            }
            let cap = file.get_f64(&key(k))?.map_or(default, |v| v as f32);
            if !(cap.is_finite() && cap > 0.0) {
                return Err(ConfigError::Invalid(format!(
                    "{} = {cap} must be positive",
                    key(k)
                )));
            }
            Ok(Some(cap))
        };
        // As llama.cpp: gemma2's own defaults (window 4096, caps 50 and 30) when the keys are
        // absent; a `llama` file's window only when it sets one (Mistral v0.1); no window
        // elsewhere.
        let sliding_window = match (opt_usize("attention.sliding_window")?, arch.as_str()) {
            (None, "gemma2") => Some(4096),
            (Some(0), _) => None,
            (Some(w), "gemma2" | "llama") => Some(w),
            _ => None,
        };
        let swa_layers = match sliding_window {
            None => Vec::new(),
            // gemma2: ggml's pattern of period 2, sliding-window layers first.
            Some(_) if gemma2 => {
                let period = opt_usize("attention.sliding_window_pattern")?.unwrap_or(2);
                (0..n_layer)
                    .map(|il| period == 0 || il % period < period - 1)
                    .collect()
            }
            Some(_) => vec![true; n_layer],
        };
        // llama.cpp's f_attention_scale for gemma2: 1/sqrt(head_dim), except the 27B model
        // (46 layers), which uses 1/sqrt(d_model / n_head).
        let query_scale = gemma2.then(|| {
            let d = if n_layer == 46 {
                d_model / n_head
            } else {
                head_dim
            };
            1.0 / (d as f32).sqrt()
        });
        let rope_theta = file.get_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        let rope_scaling = rope_scaling(file, &arch, context_length)?;

        Ok(ModelConfig {
            name: file.get_str("general.name")?.map(str::to_string),
            n_layer,
            d_model,
            n_head,
            n_head_kv,
            head_dim,
            d_ff,
            vocab_size,
            context_length,
            rms_eps,
            rope_theta,
            rope_dim,
            // GGUF `llama` weights are permuted for interleaved pairs; the others keep HF's layout.
            rope_layout: if arch == "llama" {
                RopeLayout::Interleaved
            } else {
                RopeLayout::Neox
            },
            rope_scaling,
            tied_embeddings: file.tensor("output.weight").is_none(),
            attn_bias: file.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm,
            norm,
            ffn,
            embed_scale: gemma2,
            post_norms: gemma2,
            query_scale,
            attn_softcap: softcap("attn_logit_softcapping", 50.0)?,
            final_softcap: softcap("final_logit_softcapping", 30.0)?,
            sliding_window,
            swa_layers,
            learned_positions: arch == "gpt2",
            architecture: arch,
        })
    }

    /// The settings that set this architecture apart, one short phrase each, for `toy describe`.
    pub fn distinctive(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.learned_positions {
            out.push("learned position embeddings (no RoPE)".to_string());
        }
        if self.norm == NormKind::Layer {
            out.push("LayerNorm with bias".to_string());
        }
        if self.embed_scale {
            out.push(format!("embeddings × √{}", self.d_model));
        }
        if self.post_norms {
            out.push("RMSNorm before and after each sublayer".to_string());
        }
        if self.attn_bias {
            out.push("Q/K/V biases".to_string());
        }
        match self.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => out.push("per-head Q/K RMSNorm".to_string()),
            QkNorm::Full => out.push("Q/K RMSNorm over the whole projection".to_string()),
        }
        if let Some(s) = self.query_scale {
            out.push(format!("queries × {s} (attention scale 1)"));
        }
        if let Some(cap) = self.attn_softcap {
            out.push(format!("attention logit soft-cap {cap}"));
        }
        if let Some(cap) = self.final_softcap {
            out.push(format!("final logit soft-cap {cap}"));
        }
        if let Some(w) = self.sliding_window {
            let n = self.swa_layers.iter().filter(|&&s| s).count();
            out.push(format!(
                "sliding window {w} on {n} of {} layers",
                self.n_layer
            ));
        }
        out
    }

    /// The feed-forward network in words, for `toy describe`.
    pub fn describe_ffn(&self) -> String {
        match self.ffn {
            FfnKind::SwiGlu => format!("{} (SwiGLU)", self.d_ff),
            FfnKind::GeGlu => format!("{} (GELU-tanh gated)", self.d_ff),
            FfnKind::Gelu => format!("{} (GELU-tanh, biases)", self.d_ff),
            FfnKind::Moe {
                n_expert,
                n_expert_used,
                norm_weights,
            } => format!(
                "mixture of experts: top-{n_expert_used} of {n_expert} SwiGLU experts of {}, softmax router{}",
                self.d_ff,
                if norm_weights {
                    ", weights renormalized"
                } else {
                    ", weights not renormalized"
                }
            ),
        }
    }

    /// One line about RoPE for `toy describe`.
    pub fn describe_rope(&self) -> String {
        if self.learned_positions {
            return "none (learned position embeddings)".to_string();
        }
        let scaling = match self.rope_scaling {
            RopeScaling::None => "none".to_string(),
            RopeScaling::Linear { factor } => format!("linear ×{factor}"),
            RopeScaling::Yarn {
                factor,
                original_context,
                ..
            } => {
                format!("yarn ×{factor} (original context {original_context})")
            }
        };
        let layout = match self.rope_layout {
            RopeLayout::Interleaved => "interleaved",
            RopeLayout::Neox => "neox",
        };
        format!(
            "θ={} dims={} {layout}, scaling {scaling}",
            self.rope_theta, self.rope_dim
        )
    }
}

fn rope_scaling(
    file: &GgufFile,
    arch: &str,
    context_length: usize,
) -> Result<RopeScaling, ConfigError> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let f32_or = |k: &str, default: f32| -> Result<f32, ConfigError> {
        Ok(file.get_f64(&key(k))?.map_or(default, |v| v as f32))
    };
    let kind = file.get_str(&key("type"))?.unwrap_or("none");
    // Older files give the linear factor as `rope.scale_linear`.
    let factor = match file.get_f64(&key("factor"))? {
        Some(f) => f as f32,
        None => file
            .get_f64(&format!("{arch}.rope.scale_linear"))?
            .map_or(1.0, |v| v as f32),
    };
    match kind {
        "none" => Ok(RopeScaling::None),
        "linear" if factor == 1.0 => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "yarn" => Ok(RopeScaling::Yarn {
            factor,
            original_context: file
                .get_u64(&key("original_context_length"))?
                .map_or(context_length, |v| v as usize),
            beta_fast: f32_or("yarn_beta_fast", 32.0)?,
            beta_slow: f32_or("yarn_beta_slow", 1.0)?,
            attn_factor: f32_or("attn_factor", 1.0)?,
        }),
        other => Err(ConfigError::Invalid(format!(
            "RoPE scaling {other:?} is not supported (supported: none, linear, yarn)"
        ))),
    }
}
