//! Write a [`Transformer`] as a standard llama GGUF, or a [`Gpt2`] as a `gpt2` one: what `toy
//! train` checkpoints are, and what [`load`](crate::load::load), `toy infer` and llama.cpp read
//! back. A model fine-tuned from a base of any llama-family architecture is written in the
//! base's architecture instead ([`to_gguf_like_base`]).
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
use toy_core::config::ModelConfig;
use toy_core::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value, tensor_to_f32};
use toy_kernels::ToyBackend;

use crate::embedding::TokenEmbedding;
use crate::gpt2::{Gpt2, Gpt2Config, LayerNorm, Linear};
use crate::llama::{Ffn, LlamaConfig, Transformer};
use crate::qlinear::{PackedMatrix, QLinear};
use toy_kernels::packed::{HostPackedView, gguf_row};
use toy_kernels::reference::host_words;

/// Why a model could not be written as a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// Reading the base file or writing the GGUF failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tensor's shape is not the one the config says.
    #[error("tensor {name} has shape {found:?}, but the config says {expected:?}")]
    Shape {
        /// The tensor's GGUF name (`blk`: the number of blocks).
        name: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape the model holds.
        found: Vec<usize>,
    },
    /// Extra metadata set a key the saver writes itself; the key.
    #[error("metadata key {0:?} is written by the model saver; do not pass it as extra metadata")]
    ReservedKey(String),
    /// The model has a feature a GGUF `llama` file cannot express; the feature.
    #[error(
        "this model has {0}, which a GGUF `llama` file cannot express (a model fine-tuned from a base is saved in the base's architecture)"
    )]
    Architecture(&'static str),
    /// The model holds something the saver does not support; what.
    #[error("cannot save {0}")]
    Unsupported(&'static str),
    /// The base file's metadata does not describe a supported model.
    #[error(transparent)]
    Config(#[from] toy_core::config::ConfigError),
    /// The base has a tensor the fine-tuned model does not hold; its name.
    #[error(
        "the base model has tensor {0}, which the fine-tuned model does not hold: saving would keep a stale copy"
    )]
    Missing(String),
    /// A tensor could not be read back from the device.
    #[error("cannot read tensor {name} back from the device: {reason}")]
    Readback {
        /// The tensor.
        name: String,
        /// Why it could not be read back.
        reason: String,
    },
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

    add_transformer_tensors(&mut w, model, c, false, false)?;
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

/// Base tensors a model computes from but does not train: copied from the base (as F32).
const FIXED_TENSORS: [&str; 3] = [
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
];

/// The writer holding `model`, fine-tuned from `base`, in `base`'s own architecture — what
/// `toy train --recipe full --base` writes for every llama-family base (qwen2, qwen3, gemma2/3,
/// phi3, smollm3, granite, llama): every metadata key of `base` (its architecture's
/// hyperparameters, RoPE scaling, sliding-window pattern, tokenizer) in file order, `extra`'s
/// keys replacing or adding theirs, `general.file_type` = ALL_F32 when every weight is dense;
/// then the model's tensors
/// under the names llama.cpp's loader of that architecture reads (Q/K/V biases, Q/K norms,
/// post-norms; phi3's Q/K/V and gate/up fused again into `attn_qkv` and `ffn_up`), and the
/// base's RoPE factor tensors, which the model uses but does not train.
///
/// An untied head (`config.tied_embeddings = false`) is written as `output.weight`, which every
/// one of these loaders takes when present. Any other base tensor the model does not hold is an
/// error rather than a silently stale copy. A mixture-of-experts model is refused.
pub fn to_gguf_like_base<B: ToyBackend>(
    model: &Transformer<B>,
    config: &LlamaConfig,
    base: &GgufFile,
    extra: &[(String, Value)],
) -> Result<GgufWriter<'static>, SaveError> {
    let arch = base.architecture()?.to_string();
    let base_config = ModelConfig::from_gguf(base)?;
    if config.n_expert > 0 {
        return Err(SaveError::Unsupported(
            "a mixture-of-experts model (olmoe): saving its experts is not supported",
        ));
    }
    let mut w = GgufWriter::from_file(base);
    let own = format!("{arch}.");
    for (key, value) in extra {
        if key == "general.architecture" || key.starts_with(&own) {
            return Err(SaveError::ReservedKey(key.clone()));
        }
        w.set(key.clone(), value.clone())?;
    }
    add_transformer_tensors(
        &mut w,
        model,
        config,
        base_config.fused_qkv,
        base_config.fused_gate_up,
    )?;
    for info in &base.tensors {
        if w.has_tensor(&info.name) {
            continue;
        }
        if !FIXED_TENSORS.contains(&info.name.as_str()) {
            return Err(SaveError::Missing(info.name.clone()));
        }
        let bytes: Vec<u8> = tensor_to_f32(base, info)?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        w.add_tensor(info.name.clone(), &info.dims, GgmlType::F32, bytes)?;
    }
    // ALL_F32 when every tensor is (a full fine-tune); packed weights keep their type and the
    // base's file type with them.
    if w.tensor_types().all(|t| t == GgmlType::F32) {
        w.set("general.file_type", Value::U32(0))?;
    }
    Ok(w)
}

/// Add `model`'s tensors under llama.cpp's names: embedding, output norm and head (when untied),
/// then per block the norms, projections (Q/K/V and gate/up fused into one tensor each when
/// `fused_qkv` / `fused_gate_up`, as phi3 stores them), the biases, Q/K norms and post-norms the
/// model has. A mixture-of-experts block is refused.
fn add_transformer_tensors<B: ToyBackend>(
    w: &mut GgufWriter<'static>,
    model: &Transformer<B>,
    c: &LlamaConfig,
    fused_qkv: bool,
    fused_gate_up: bool,
) -> Result<(), SaveError> {
    let (d, qdim, kvdim) = (c.d_model, c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    add_embedding(w, &model.token_embd, &[c.vocab_size, d])?;
    add(w, "output_norm.weight", &model.output_norm.gamma, &[d])?;
    // The head the model computes with: its own matrix, or (a config asking for an untied file
    // from a tied model) a copy of the embedding.
    if !c.tied_embeddings || model.output.is_some() {
        add_linear(w, "output.weight", &model.head(), &[c.vocab_size, d])?;
    }
    for (i, b) in model.blocks.iter().enumerate() {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let Ffn::Dense(mlp) = &b.ffn else {
            return Err(SaveError::Unsupported(
                "a mixture-of-experts model (olmoe): saving its experts is not supported",
            ));
        };
        let a = &b.attn;
        add(w, &name("attn_norm"), &b.attn_norm.gamma, &[d])?;
        if fused_qkv {
            let parts = [(&a.wq, qdim), (&a.wk, kvdim), (&a.wv, kvdim)];
            add_fused(w, &name("attn_qkv"), &parts, d)?;
        } else {
            add_linear(w, &name("attn_q"), &a.wq, &[qdim, d])?;
            add_linear(w, &name("attn_k"), &a.wk, &[kvdim, d])?;
            add_linear(w, &name("attn_v"), &a.wv, &[kvdim, d])?;
        }
        for (t, bias, n) in [("q", &a.bq, qdim), ("k", &a.bk, kvdim), ("v", &a.bv, kvdim)] {
            if let Some(bias) = bias {
                add(w, &format!("blk.{i}.attn_{t}.bias"), bias, &[n])?;
            }
        }
        let norm_width = |n: usize| if c.qk_norm { c.head_dim } else { n };
        if let Some(q) = &a.q_norm {
            add(w, &name("attn_q_norm"), &q.gamma, &[norm_width(qdim)])?;
        }
        if let Some(k) = &a.k_norm {
            add(w, &name("attn_k_norm"), &k.gamma, &[norm_width(kvdim)])?;
        }
        add_linear(w, &name("attn_output"), &a.wo, &[d, qdim])?;
        if let Some(n) = &b.post_attn_norm {
            add(w, &name("post_attention_norm"), &n.gamma, &[d])?;
        }
        add(w, &name("ffn_norm"), &b.ffn_norm.gamma, &[d])?;
        if fused_gate_up {
            let parts = [(&mlp.gate, c.d_ff), (&mlp.up, c.d_ff)];
            add_fused(w, &name("ffn_up"), &parts, d)?;
        } else {
            add_linear(w, &name("ffn_gate"), &mlp.gate, &[c.d_ff, d])?;
            add_linear(w, &name("ffn_up"), &mlp.up, &[c.d_ff, d])?;
        }
        add_linear(w, &name("ffn_down"), &mlp.down, &[d, c.d_ff])?;
        if let Some(n) = &b.post_ffn_norm {
            add(w, &name("post_ffw_norm"), &n.gamma, &[d])?;
        }
    }
    Ok(())
}

/// Write `model` in `base`'s architecture to `path`, atomically (see [`to_gguf_like_base`]).
pub fn save_like_base<B: ToyBackend>(
    model: &Transformer<B>,
    config: &LlamaConfig,
    base: &GgufFile,
    extra: &[(String, Value)],
    path: impl AsRef<Path>,
) -> Result<u64, SaveError> {
    Ok(to_gguf_like_base(model, config, base, extra)?.write_atomic(path)?)
}

/// Add one matrix `[Σ outs, inp]` whose rows are the parts' rows in order (phi3's fused
/// `attn_qkv` and gate+up `ffn_up`, which the loader splits by rows). The parts must share a
/// type: a GGUF tensor has one.
fn add_fused<B: ToyBackend>(
    w: &mut GgufWriter<'static>,
    name: &str,
    parts: &[(&QLinear<B>, usize)],
    inp: usize,
) -> Result<(), SaveError> {
    let mut ty = None;
    let mut bytes = Vec::new();
    for (linear, out) in parts {
        let (t, b) = linear_data(name, linear, &[*out, inp])?;
        if ty.is_some_and(|ty| ty != t) {
            return Err(SaveError::Unsupported(
                "fused matrices whose parts have different types (a GGUF tensor has one)",
            ));
        }
        ty = Some(t);
        bytes.extend(b);
    }
    let rows: usize = parts.iter().map(|(_, out)| out).sum();
    let ty = ty.unwrap_or(GgmlType::F32);
    w.add_tensor(name, &[inp as u64, rows as u64], ty, bytes)?;
    Ok(())
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
    let (ty, bytes) = linear_data(name, linear, shape)?;
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    w.add_tensor(name, &dims, ty, bytes)?;
    Ok(())
}

/// A weight of PyTorch shape `shape` as GGUF rows: its type and bytes (packed weights keep
/// their type and blocks, unchanged; dense ones are F32).
fn linear_data<B: ToyBackend>(
    name: &str,
    linear: &QLinear<B>,
    shape: &[usize; 2],
) -> Result<(GgmlType, Vec<u8>), SaveError> {
    match linear {
        QLinear::Dense(p) => Ok((GgmlType::F32, float_data(name, p, shape)?)),
        QLinear::Packed(p) => Ok((p.ty, packed_data(name, p, shape)?)),
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
        TokenEmbedding::Packed(p) => {
            let bytes = packed_data("token_embd.weight", p, shape)?;
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            w.add_tensor("token_embd.weight", &dims, p.ty, bytes)?;
            Ok(())
        }
    }
}

/// The GGUF rows of a packed weight of PyTorch shape `shape`.
fn packed_data<B: ToyBackend>(
    name: &str,
    p: &PackedMatrix<B>,
    shape: &[usize; 2],
) -> Result<Vec<u8>, SaveError> {
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
        layout: p.layout,
    };
    Ok((0..shape[0]).flat_map(|r| gguf_row(&view, r)).collect())
}

/// Add a float tensor of PyTorch shape `shape` as F32 with ggml dims (the shape reversed).
fn add<B: Backend, const D: usize>(
    w: &mut GgufWriter<'static>,
    name: &str,
    param: &Param<Tensor<B, D>>,
    shape: &[usize; D],
) -> Result<(), SaveError> {
    let bytes = float_data(name, param, shape)?;
    let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
    w.add_tensor(name, &dims, GgmlType::F32, bytes)?;
    Ok(())
}

/// A float tensor of PyTorch shape `shape` as little-endian F32 bytes.
fn float_data<B: Backend, const D: usize>(
    name: &str,
    param: &Param<Tensor<B, D>>,
    shape: &[usize; D],
) -> Result<Vec<u8>, SaveError> {
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
    Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
}
