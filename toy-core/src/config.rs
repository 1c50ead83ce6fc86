//! The model configuration, read from GGUF metadata (`<arch>.*` keys).

use crate::gguf::{GgufError, GgufFile};

/// Architectures whose GGUF files toy can load.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

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
    /// Per-head RMSNorm of queries and keys before RoPE (qwen3).
    pub qk_norm: bool,
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
        let rms_eps = file
            .get_f64(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5) as f32;
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
            qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
            architecture: arch,
        })
    }

    /// One line about RoPE for `toy describe`.
    pub fn describe_rope(&self) -> String {
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
