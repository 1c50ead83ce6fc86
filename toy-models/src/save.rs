//! Write a [`Transformer`] as a standard llama GGUF, or a [`Gpt2`] as a `gpt2` one: what `toy
//! train` checkpoints are, and what [`load`](crate::load::load), `toy infer` and llama.cpp read
//! back.
//!
//! The file has `general.architecture = llama`, every `llama.*` key llama.cpp needs to build the
//! model, the tokenizer metadata of the caller's choosing (copied from the tokenizer's own GGUF),
//! and F32 tensors with llama.cpp's names and layouts: a PyTorch `[out, in]` weight is a GGUF
//! tensor with dims `[in, out]` and the same row-major bytes. Weights are written as they are:
//! the model computes RoPE on interleaved pairs, which is the layout GGUF `llama` files use (the
//! HF→GGUF converter permutes Q/K into it), so no permutation is needed.

use std::path::Path;

use burn::module::Param;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use toy_core::gguf::{GgmlType, GgufError, GgufWriter, Value};
use toy_kernels::ToyBackend;

use crate::embedding::TokenEmbedding;
use crate::gpt2::{Gpt2, Gpt2Config, LayerNorm, Linear};
use crate::llama::{Ffn, LlamaConfig, Transformer};
use crate::qlinear::{PackedMatrix, QLinear};
use toy_kernels::packed::{HostPackedView, gguf_row};
use toy_kernels::reference::host_words;

#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("tensor {name} has shape {found:?}, but the config says {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("metadata key {0:?} is written by the model saver; do not pass it as extra metadata")]
    ReservedKey(String),
    #[error(
        "this model has {0}, which a GGUF `llama` file cannot express; saving other architectures is not supported yet"
    )]
    Architecture(&'static str),
    #[error("cannot read tensor {name} back from the device: {reason}")]
    Readback { name: String, reason: String },
}

/// The GGUF writer holding `model`: `llama.*` metadata from `config`, then `extra` metadata in
/// the given order (typically every `tokenizer.*` key of the tokenizer's GGUF, plus
/// `general.name`), then the tensors.
///
/// `extra` may not set `general.architecture` or `llama.*` keys: those describe the tensors and
/// come from `config` only.
pub fn to_gguf<B: ToyBackend>(
    model: &Transformer<B>,
    config: &LlamaConfig,
    extra: &[(String, Value)],
) -> Result<GgufWriter<'static>, SaveError> {
    // The llama architecture in llama.cpp: interleaved RoPE, no attention biases, no Q/K norms.
    // Writing such a model as `llama` would load without error and compute something else.
    if config.attn_bias {
        return Err(SaveError::Architecture("attention biases (qwen2)"));
    }
    if config.qk_norm {
        return Err(SaveError::Architecture("per-head Q/K norms (qwen3)"));
    }
    if config.qk_norm_full {
        return Err(SaveError::Architecture(
            "whole-projection Q/K norms (olmoe)",
        ));
    }
    if config.n_expert > 0 {
        return Err(SaveError::Architecture("a mixture-of-experts MLP (olmoe)"));
    }
    if config.residual_scale.is_some() || config.logit_scale.is_some() || config.kq_scale.is_some()
    {
        return Err(SaveError::Architecture(
            "granite's residual, logit or attention scales",
        ));
    }
    if config.rope_theta_swa.is_some() || !config.no_rope_layers.is_empty() {
        return Err(SaveError::Architecture(
            "per-layer RoPE (gemma3's sliding-window base, smollm3's layers without RoPE)",
        ));
    }
    if config.embed_scale.is_some() || config.post_norms || config.gelu {
        return Err(SaveError::Architecture(
            "an embedding scale, post-norms or a GELU gate (gemma, granite)",
        ));
    }
    if config.attn_softcap.is_some() || config.final_softcap.is_some() {
        return Err(SaveError::Architecture("logit soft-caps (gemma2)"));
    }
    if config.query_scale.is_some() {
        return Err(SaveError::Architecture(
            "a query pre-attention scale (gemma2)",
        ));
    }
    if config.sliding_window.is_some() {
        return Err(SaveError::Architecture("sliding-window attention"));
    }
    if !config.rope_interleaved {
        return Err(SaveError::Architecture("half-split (neox) RoPE"));
    }
    let mut w = begin("llama", extra)?;
    let c = config;
    let u32_of = |v: usize| Value::U32(v as u32);
    w.set("llama.vocab_size", u32_of(c.vocab_size))?;
    w.set("llama.context_length", u32_of(c.context_length))?;
    w.set("llama.embedding_length", u32_of(c.d_model))?;
    w.set("llama.block_count", u32_of(c.n_layer))?;
    w.set("llama.feed_forward_length", u32_of(c.d_ff))?;
    w.set("llama.rope.dimension_count", u32_of(rope_dim(c)))?;
    w.set("llama.attention.head_count", u32_of(c.n_head))?;
    w.set("llama.attention.head_count_kv", u32_of(c.n_head_kv))?;
    if c.head_dim * c.n_head != c.d_model {
        // Only needed when it differs from embedding_length / head_count (the default).
        w.set("llama.attention.key_length", u32_of(c.head_dim))?;
        w.set("llama.attention.value_length", u32_of(c.head_dim))?;
    }
    w.set(
        "llama.attention.layer_norm_rms_epsilon",
        Value::F32(c.rms_eps as f32),
    )?;
    w.set("llama.rope.freq_base", Value::F32(c.rope_theta))?;
    end_metadata(&mut w, extra)?;

    let (d, qdim, kvdim) = (c.d_model, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    add_embedding(&mut w, &model.token_embd, &[c.vocab_size, d])?;
    add(&mut w, "output_norm.weight", &model.output_norm.gamma, &[d])?;
    if !c.tied_embeddings {
        add_linear(&mut w, "output.weight", &model.output, &[c.vocab_size, d])?;
    }
    for (i, b) in model.blocks.iter().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let Ffn::Dense(mlp) = &b.ffn else {
            return Err(SaveError::Architecture("a mixture-of-experts MLP (olmoe)"));
        };
        add(&mut w, &name("attn_norm"), &b.attn_norm.gamma, &[d])?;
        add_linear(&mut w, &name("attn_q"), &b.attn.wq, &[qdim, d])?;
        add_linear(&mut w, &name("attn_k"), &b.attn.wk, &[kvdim, d])?;
        add_linear(&mut w, &name("attn_v"), &b.attn.wv, &[kvdim, d])?;
        add_linear(&mut w, &name("attn_output"), &b.attn.wo, &[d, qdim])?;
        add(&mut w, &name("ffn_norm"), &b.ffn_norm.gamma, &[d])?;
        add_linear(&mut w, &name("ffn_gate"), &mlp.gate, &[c.d_ff, d])?;
        add_linear(&mut w, &name("ffn_up"), &mlp.up, &[c.d_ff, d])?;
        add_linear(&mut w, &name("ffn_down"), &mlp.down, &[d, c.d_ff])?;
    }
    Ok(w)
}

/// Write `model` to `path` atomically (a temporary file in the same directory, flushed, then
/// renamed): a reader, or a run killed mid-write, never sees a partial file. Returns the bytes
/// written. See [`to_gguf`] for `extra`.
pub fn save<B: ToyBackend>(
    model: &Transformer<B>,
    config: &LlamaConfig,
    extra: &[(String, Value)],
    path: impl AsRef<Path>,
) -> Result<u64, SaveError> {
    Ok(to_gguf(model, config, extra)?.write_atomic(path)?)
}

/// The writer of a GPT-2 model as llama.cpp's `gpt2` architecture: `gpt2.*` metadata from
/// `config`, then `extra` (as in [`to_gguf`]), then F32 tensors with llama.cpp's names
/// (`position_embd`, fused `attn_qkv` with Q, K, V stacked along the output, LayerNorm and
/// linear biases). The output head is written as `output.weight` (llama.cpp's gpt2 loader takes
/// it when present and falls back to `token_embd` otherwise), so a model whose head was trained
/// apart from its embedding keeps it.
pub fn to_gguf_gpt2<B: ToyBackend>(
    model: &Gpt2<B>,
    config: &Gpt2Config,
    extra: &[(String, Value)],
) -> Result<GgufWriter<'static>, SaveError> {
    let mut w = begin("gpt2", extra)?;
    let c = config;
    let u32_of = |v: usize| Value::U32(v as u32);
    w.set("gpt2.context_length", u32_of(c.context_length))?;
    w.set("gpt2.embedding_length", u32_of(c.d_model))?;
    w.set("gpt2.feed_forward_length", u32_of(c.d_ff))?;
    w.set("gpt2.block_count", u32_of(c.n_layer))?;
    w.set("gpt2.attention.head_count", u32_of(c.n_head))?;
    w.set(
        "gpt2.attention.layer_norm_epsilon",
        Value::F32(c.norm_eps as f32),
    )?;
    end_metadata(&mut w, extra)?;

    let d = c.d_model;
    let layer_norm = |w: &mut GgufWriter<'static>, name: &str, n: &LayerNorm<B>| {
        add(w, &format!("{name}.weight"), &n.weight, &[d])?;
        add(w, &format!("{name}.bias"), &n.bias, &[d])
    };
    let linear = |w: &mut GgufWriter<'static>, name: &str, l: &Linear<B>, shape: [usize; 2]| {
        add_linear(w, &format!("{name}.weight"), &l.weight, &shape)?;
        add(w, &format!("{name}.bias"), &l.bias, &[shape[0]])
    };
    add(
        &mut w,
        "token_embd.weight",
        &model.token_embd.weight,
        &[c.vocab_size, d],
    )?;
    add(
        &mut w,
        "position_embd.weight",
        &model.pos_embd.weight,
        &[c.context_length, d],
    )?;
    layer_norm(&mut w, "output_norm", &model.output_norm)?;
    add_linear(&mut w, "output.weight", &model.output, &[c.vocab_size, d])?;
    if model.blocks.len() != c.n_layer {
        return Err(SaveError::Shape {
            name: "blk".into(),
            expected: vec![c.n_layer],
            found: vec![model.blocks.len()],
        });
    }
    for (i, b) in model.blocks.iter().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}");
        layer_norm(&mut w, &name("attn_norm"), &b.attn_norm)?;
        linear(&mut w, &name("attn_qkv"), &b.qkv, [3 * d, d])?;
        linear(&mut w, &name("attn_output"), &b.wo, [d, d])?;
        layer_norm(&mut w, &name("ffn_norm"), &b.ffn_norm)?;
        linear(&mut w, &name("ffn_up"), &b.up, [c.d_ff, d])?;
        linear(&mut w, &name("ffn_down"), &b.down, [d, c.d_ff])?;
    }
    Ok(w)
}

/// Write a GPT-2 model to `path` atomically (see [`save`] and [`to_gguf_gpt2`]).
pub fn save_gpt2<B: ToyBackend>(
    model: &Gpt2<B>,
    config: &Gpt2Config,
    extra: &[(String, Value)],
    path: impl AsRef<Path>,
) -> Result<u64, SaveError> {
    Ok(to_gguf_gpt2(model, config, extra)?.write_atomic(path)?)
}

/// A writer with `general.architecture = arch`, the `general.*` keys of `extra` (before the
/// architecture keys, as gguf-py orders them) and `general.file_type` = ALL_F32. `extra` may not
/// set the architecture or any `arch.*` key: those describe the tensors.
fn begin(arch: &str, extra: &[(String, Value)]) -> Result<GgufWriter<'static>, SaveError> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String(arch.into()))?;
    let own = format!("{arch}.");
    for (key, value) in extra {
        if key == "general.architecture" || key.starts_with(&own) {
            return Err(SaveError::ReservedKey(key.clone()));
        }
        if key.starts_with("general.") {
            w.set(key.clone(), value.clone())?;
        }
    }
    // llama.cpp's ALL_F32 file type: every weight is F32.
    w.set("general.file_type", Value::U32(0))?;
    Ok(w)
}

/// The rest of `extra` (the tokenizer), after the architecture keys.
fn end_metadata(w: &mut GgufWriter<'static>, extra: &[(String, Value)]) -> Result<(), SaveError> {
    for (key, value) in extra {
        if !key.starts_with("general.") {
            w.set(key.clone(), value.clone())?;
        }
    }
    Ok(())
}

fn rope_dim(c: &LlamaConfig) -> usize {
    if c.rope_dim == 0 {
        c.head_dim
    } else {
        c.rope_dim
    }
}

fn add_linear<B: ToyBackend>(
    w: &mut GgufWriter<'static>,
    name: &str,
    linear: &QLinear<B>,
    shape: &[usize; 2],
) -> Result<(), SaveError> {
    match linear {
        QLinear::Dense(p) => add(w, name, p, shape),
        QLinear::Packed(p) => add_packed(w, name, p, shape),
    }
}

/// Add a token embedding table `[vocab, d]` in the form it has.
fn add_embedding<B: ToyBackend>(
    w: &mut GgufWriter<'static>,
    embd: &TokenEmbedding<B>,
    shape: &[usize; 2],
) -> Result<(), SaveError> {
    match embd {
        TokenEmbedding::Dense(e) => add(w, "token_embd.weight", &e.weight, shape),
        TokenEmbedding::Packed(p) => add_packed(w, "token_embd.weight", p, shape),
    }
}

/// Add a packed weight of PyTorch shape `shape` as it is: its GGUF type and blocks, unchanged.
fn add_packed<B: ToyBackend>(
    w: &mut GgufWriter<'static>,
    name: &str,
    p: &PackedMatrix<B>,
    shape: &[usize; 2],
) -> Result<(), SaveError> {
    let found = p.dims().to_vec();
    if found != shape {
        return Err(SaveError::Shape {
            name: name.to_string(),
            expected: shape.to_vec(),
            found,
        });
    }
    let readback = |reason: String| SaveError::Readback {
        name: name.to_string(),
        reason,
    };
    let words = host_words(p.words.val().into_data());
    let f32s = |t: &Option<burn::module::Param<Tensor<B, 2>>>| {
        t.as_ref()
            .map(|t| t.val().into_data().convert::<f32>().into_vec::<f32>())
            .transpose()
            .map_err(|e| readback(format!("{e:?}")))
    };
    let (scales, mins) = (
        f32s(&p.scales)?.unwrap_or_default(),
        f32s(&p.mins)?.unwrap_or_default(),
    );
    let view = HostPackedView {
        ty: p.ty,
        rows: shape[0],
        cols: shape[1],
        words: &words,
        scales: &scales,
        mins: &mins,
    };
    let bytes: Vec<u8> = (0..shape[0]).flat_map(|r| gguf_row(&view, r)).collect();
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    w.add_tensor(name, &dims, p.ty, bytes)?;
    Ok(())
}

/// Add a float tensor of PyTorch shape `shape` as F32 with ggml dims (the shape reversed).
fn add<B: Backend, const D: usize>(
    w: &mut GgufWriter<'static>,
    name: &str,
    param: &Param<Tensor<B, D>>,
    shape: &[usize; D],
) -> Result<(), SaveError> {
    let t = param.val();
    let found = t.dims().to_vec();
    if found != shape {
        return Err(SaveError::Shape {
            name: name.to_string(),
            expected: shape.to_vec(),
            found,
        });
    }
    let values = t
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| SaveError::Readback {
            name: name.to_string(),
            reason: format!("{e:?}"),
        })?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    w.add_tensor(name, &dims, GgmlType::F32, bytes)?;
    Ok(())
}
