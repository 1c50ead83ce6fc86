//! The model configuration, read from GGUF metadata (`<arch>.*` keys).

use crate::gguf::{GgufError, GgufFile};

/// Architectures whose GGUF files toy can load.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite", "olmoe", "gpt2",
];

/// Why a GGUF file's metadata does not give a model toy can run.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `general.architecture` is not one of `SUPPORTED_ARCHITECTURES`.
    #[error("unsupported architecture {0:?}: toy runs {supported}", supported = SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture(String),
    /// A GGUF error, such as a required key that is missing or of the wrong type.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// Metadata that is present but inconsistent or out of range; the message says which.
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
    /// No scaling.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Divisor of the positions (`rope.scaling.factor`).
        factor: f32,
    },
    /// YaRN: slow-rotating dims interpolated by `factor`, fast ones kept, a magnitude correction.
    Yarn {
        /// Context extension factor: interpolated dims' frequencies are divided by it.
        factor: f32,
        /// Context length before the extension (default `context_length`).
        original_context: usize,
        /// Turns over the original context above which a dim is kept as is (default 32).
        beta_fast: f32,
        /// Turns over the original context below which a dim is fully interpolated (default 1).
        beta_slow: f32,
        /// Extra factor on the magnitude correction (`attn_factor`, default 1).
        attn_factor: f32,
    },
}

/// How queries and keys are normalized before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// No query/key normalization.
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
        /// Number of experts per block.
        n_expert: usize,
        /// Number of experts each token is routed to.
        n_expert_used: usize,
        /// Renormalize the chosen experts' softmax weights to sum to 1 (olmoe: no).
        norm_weights: bool,
    },
}

/// Everything the transformer needs to know about its shape, read from metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `general.architecture`, one of `SUPPORTED_ARCHITECTURES`.
    pub architecture: String,
    /// `general.name`, if the file sets it.
    pub name: Option<String>,
    /// Number of transformer blocks (`block_count`).
    pub n_layer: usize,
    /// Width of the residual stream (`embedding_length`).
    pub d_model: usize,
    /// Number of query heads.
    pub n_head: usize,
    /// Number of key/value heads, a divisor of `n_head` (fewer with grouped-query attention).
    pub n_head_kv: usize,
    /// Width of each attention head (`attention.key_length`, default `d_model / n_head`).
    pub head_dim: usize,
    /// Hidden width of the feed-forward network (of each expert, for a mixture of experts).
    pub d_ff: usize,
    /// Number of tokens (`vocab_size`, default the rows of `token_embd.weight`).
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Epsilon of the normalization layers (default 1e-5).
    pub rms_eps: f32,
    /// RoPE frequency base θ (`rope.freq_base`, default 10 000).
    pub rope_theta: f32,
    /// Number of dimensions of each head that RoPE rotates (usually `head_dim`).
    pub rope_dim: usize,
    /// How RoPE pairs the dims of a head.
    pub rope_layout: RopeLayout,
    /// RoPE frequency scaling for contexts beyond the trained one.
    pub rope_scaling: RopeScaling,
    /// The output projection reuses `token_embd.weight` (no `output.weight` tensor).
    pub tied_embeddings: bool,
    /// Q/K/V projections have biases (qwen2).
    pub attn_bias: bool,
    /// Query/key normalization before RoPE (qwen3: per head, olmoe: whole projection).
    pub qk_norm: QkNorm,
    /// RMSNorm or LayerNorm (`rms_eps` is the epsilon of either).
    pub norm: NormKind,
    /// The feed-forward network of each block.
    pub ffn: FfnKind,
    /// Token embeddings are multiplied by this (gemma: `sqrtf(d_model)`, granite: its
    /// `embedding_scale`).
    pub embed_scale: Option<f32>,
    /// Each sublayer's output is multiplied by this before its residual add (granite).
    pub residual_scale: Option<f32>,
    /// Logits are multiplied by `1 / logit_scale` (granite).
    pub logit_scale: Option<f32>,
    /// An RMSNorm after each sublayer, before its residual add (gemma2).
    pub post_norms: bool,
    /// Queries are multiplied by this before attention, which then uses scale 1 (gemma2's
    /// `query_pre_attn_scalar`, gemma3, phi3); `None`: scores are scaled by `kq_scale`.
    pub query_scale: Option<f32>,
    /// The softmax scale of the scores when queries are not scaled (granite's
    /// `attention.scale`); `None`: `1/sqrt(head_dim)`.
    pub kq_scale: Option<f32>,
    /// Attention logits soft-capped as `cap * tanh(s / cap)` before the softmax (gemma2).
    pub attn_softcap: Option<f32>,
    /// Output logits soft-capped the same way (gemma2).
    pub final_softcap: Option<f32>,
    /// Sliding-window attention: each query sees only the last `window` positions, on the
    /// layers `swa_layers` marks.
    pub sliding_window: Option<usize>,
    /// One flag per layer: does it use the sliding window? (empty when there is none)
    pub swa_layers: Vec<bool>,
    /// RoPE base of the sliding-window layers, which also take no frequency scaling (gemma3:
    /// `rope.freq_base_swa`, default 10 000); `None`: every layer uses `rope_theta`.
    pub rope_theta_swa: Option<f32>,
    /// One flag per layer: does it skip RoPE? (smollm3: every 4th layer; empty: none does)
    pub no_rope_layers: Vec<bool>,
    /// cos/sin are multiplied by this (`rope.scaling.attn_factor`; YaRN folds it into its own
    /// magnitude).
    pub rope_attn_factor: f32,
    /// LongRoPE (phi3): `rope_factors_long/short.weight` divide the frequencies; the long ones
    /// when the context run exceeds this original context.
    pub long_rope_context: Option<usize>,
    /// Fused `attn_qkv` projection (phi3) instead of `attn_q/k/v`.
    pub fused_qkv: bool,
    /// Fused gate+up `ffn_up` (rows `[0, d_ff)` gate, then up; phi3) instead of `ffn_gate`.
    pub fused_gate_up: bool,
    /// Learned absolute position embeddings (`position_embd.weight`) instead of RoPE (gpt2).
    pub learned_positions: bool,
}

impl ModelConfig {
    /// Read the configuration from a file's `<arch>.*` metadata and the presence and shapes of its
    /// tensors, refusing unsupported architectures and inconsistent values.
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
            "gemma2" | "gemma3" => FfnKind::GeGlu,
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
        let gemma3 = arch == "gemma3";
        // gemma2 has default caps; gemma3 only a final cap, when the file sets a nonzero one.
        let softcap = |k: &str, default: f32| -> Result<Option<f32>, ConfigError> {
            let cap = match file.get_f64(&key(k))? {
                _ if !(gemma2 || gemma3 && k == "final_logit_softcapping") => return Ok(None),
                Some(v) if gemma3 && v == 0.0 => return Ok(None),
                None if gemma3 => return Ok(None),
                v => v.map_or(default, |v| v as f32),
            };
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
        // gemma3 without the key has no window at all (llama.cpp: every layer global); phi3's
        // window is ignored by llama.cpp ("Phi SWA is currently disabled"), and so here.
        let sliding_window = match (opt_usize("attention.sliding_window")?, arch.as_str()) {
            (None, "gemma2") => Some(4096),
            (Some(0), _) => None,
            (Some(w), "gemma2" | "gemma3" | "llama") => Some(w),
            _ => None,
        };
        let swa_layers = match sliding_window {
            None => Vec::new(),
            // ggml's pattern of period n (gemma2: 2, gemma3: 6), sliding-window layers first;
            // or an explicit flag per layer.
            Some(_) if gemma2 || gemma3 => {
                swa_pattern(file, &key, n_layer, if gemma3 { 6 } else { 2 })?
            }
            Some(_) => vec![true; n_layer],
        };
        let rope_theta_swa = match (sliding_window, gemma3) {
            (Some(_), true) => Some(
                file.get_f64(&key("rope.freq_base_swa"))?
                    .map_or(10_000.0, |v| v as f32),
            ),
            _ => None,
        };
        // smollm3: llama.cpp hard-codes a RoPE-less layer every 4 (no metadata key); granite
        // files with `rope.scaling.finetuned = false` have none at all.
        let no_rope_layers = match arch.as_str() {
            "smollm3" => (0..n_layer).map(|il| (il + 1) % 4 == 0).collect(),
            "granite" if file.get_bool(&key("rope.scaling.finetuned"))? == Some(false) => {
                vec![true; n_layer]
            }
            _ => Vec::new(),
        };
        let long_rope_context = match (arch.as_str(), file.tensor("rope_factors_long.weight")) {
            ("phi3", Some(_)) => Some(
                file.get_u64(&key("rope.scaling.original_context_length"))?
                    .map_or(context_length, |v| v as usize),
            ),
            _ => None,
        };
        let fused_qkv = file.tensor("blk.0.attn_qkv.weight").is_some();
        let fused_gate_up = file.tensor("blk.0.ffn_gate.weight").is_none()
            && file
                .tensor("blk.0.ffn_up.weight")
                .is_some_and(|t| t.dims.get(1) == Some(&(2 * d_ff as u64)));
        // llama.cpp's f_attention_scale for gemma2/3: 1/sqrt(head_dim), except the 27B models
        // (46 layers for gemma2, 62 for gemma3), which use 1/sqrt(d_model / n_head); phi3 scales
        // its queries by 1/sqrt(head_dim) too (then the scores by 1).
        let query_scale = match arch.as_str() {
            "gemma2" | "gemma3" => {
                let big = n_layer == if gemma2 { 46 } else { 62 };
                let d = if big { d_model / n_head } else { head_dim };
                Some(1.0 / (d as f32).sqrt())
            }
            "phi3" => Some(1.0 / (head_dim as f32).sqrt()),
            _ => None,
        };
        let granite = arch == "granite";
        let positive = |k: &str| -> Result<Option<f32>, ConfigError> {
            match file.get_f64(&key(k))? {
                None => Ok(None),
                Some(0.0) => Ok(None),
                Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v as f32)),
                Some(v) => Err(ConfigError::Invalid(format!(
                    "{} = {v} must be positive",
                    key(k)
                ))),
            }
        };
        let (embed_scale, residual_scale, logit_scale, kq_scale) = if granite {
            let logit = positive("logit_scale")?
                .ok_or_else(|| GgufError::MissingKey(key("logit_scale")))?;
            (
                positive("embedding_scale")?,
                positive("residual_scale")?,
                Some(logit),
                positive("attention.scale")?,
            )
        } else {
            (
                (gemma2 || gemma3).then(|| (d_model as f32).sqrt()),
                None,
                None,
                None,
            )
        };
        let rope_attn_factor = file
            .get_f64(&key("rope.scaling.attn_factor"))?
            .map_or(1.0, |v| v as f32);
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
            // GGUF `llama`-layout weights (llama, smollm3, granite: llama.cpp's NORM rope type)
            // are permuted for interleaved pairs; the others keep HF's layout.
            rope_layout: if matches!(arch.as_str(), "llama" | "smollm3" | "granite") {
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
            embed_scale,
            residual_scale,
            logit_scale,
            post_norms: gemma2 || gemma3,
            query_scale,
            kq_scale,
            attn_softcap: softcap("attn_logit_softcapping", 50.0)?,
            final_softcap: softcap("final_logit_softcapping", 30.0)?,
            sliding_window,
            swa_layers,
            rope_theta_swa,
            no_rope_layers,
            rope_attn_factor,
            long_rope_context,
            fused_qkv,
            fused_gate_up,
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
        if let Some(s) = self.embed_scale {
            if s == (self.d_model as f32).sqrt() {
                out.push(format!("embeddings × √{}", self.d_model));
            } else {
                out.push(format!("embeddings × {s}"));
            }
        }
        if let Some(s) = self.residual_scale {
            out.push(format!("sublayer outputs × {s} before each residual add"));
        }
        if let Some(s) = self.logit_scale {
            out.push(format!("logits ÷ {s}"));
        }
        if let Some(s) = self.kq_scale {
            out.push(format!("attention scale {s}"));
        }
        if self.fused_qkv {
            out.push("fused QKV projection".to_string());
        }
        if self.fused_gate_up {
            out.push("fused gate+up projection".to_string());
        }
        if let Some(theta) = self.rope_theta_swa {
            out.push(format!("RoPE θ={theta} on the sliding-window layers"));
        }
        if !self.no_rope_layers.is_empty() {
            let n = self.no_rope_layers.iter().filter(|&&s| s).count();
            out.push(format!("no RoPE on {n} of {} layers", self.n_layer));
        }
        if let Some(orig) = self.long_rope_context {
            out.push(format!(
                "LongRoPE (long factors past {orig} tokens of context, cos/sin × {})",
                self.rope_attn_factor
            ));
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
    // llama.cpp's default scaling type is "linear" (a factor without a type applies).
    let kind = file.get_str(&key("type"))?.unwrap_or("linear");
    // Older files give the linear factor as `rope.scale_linear`.
    let factor = match file.get_f64(&key("factor"))? {
        Some(f) => f as f32,
        None => file
            .get_f64(&format!("{arch}.rope.scale_linear"))?
            .map_or(1.0, |v| v as f32),
    };
    match kind {
        "none" => Ok(RopeScaling::None),
        "linear" | "longrope" if factor == 1.0 => Ok(RopeScaling::None),
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

/// Which layers use the sliding window: `attention.sliding_window_pattern` as a flag per layer,
/// or as a period `n` (default `default_period`) of ggml's `set_swa_pattern`: layer `il` is
/// windowed iff `il % n < n - 1` (period 0: every layer).
fn swa_pattern(
    file: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_layer: usize,
    default_period: usize,
) -> Result<Vec<bool>, ConfigError> {
    let k = key("attention.sliding_window_pattern");
    if let Some(flags) = file.get(&k).and_then(|v| v.as_array()) {
        let flags: Option<Vec<bool>> = flags.iter().map(|v| v.as_bool()).collect();
        return match flags {
            Some(f) if f.len() == n_layer => Ok(f),
            _ => Err(ConfigError::Invalid(format!(
                "{k} must be one bool per layer ({n_layer})"
            ))),
        };
    }
    let period = file.get_u64(&k)?.map_or(default_period, |v| v as usize);
    Ok((0..n_layer)
        .map(|il| period == 0 || il % period < period - 1)
        .collect())
}
