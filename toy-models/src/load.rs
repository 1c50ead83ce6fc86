//! Build a [`Transformer`] from a GGUF file.

use burn::module::Param;
use burn::nn::{Embedding, RmsNorm, RmsNormConfig};
use burn::tensor::{Tensor, TensorData};
use toy_core::config::{ConfigError, FfnKind, ModelConfig, NormKind, QkNorm};
use toy_core::gguf::{GgufError, GgufFile, TensorInfo, tensor_to_f32};
use toy_core::rope::RopeAngles;
use toy_kernels::ToyBackend;
use toy_kernels::packed::{PACKED_TYPES, PackError, pack};

use crate::embedding::TokenEmbedding;
use crate::llama::{Attention, Block, Ffn, LlamaConfig, LongRope, Mlp, Moe, Transformer};
use crate::qlinear::{PackedMatrix, QLinear};

/// Why a GGUF file could not be loaded as a model.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file's metadata does not describe a supported model.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Reading the GGUF file failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A tensor the model needs is not in the file; its name.
    #[error("tensor {0:?} is missing from the GGUF file")]
    MissingTensor(String),
    /// The file holds a model outside the llama family (GPT-2, say); its architecture.
    #[error(
        "{0} is not a llama-family architecture and this runs llama-family models only ({0} runs in `toy infer`; in Rust, load it with toy_models::load_model)"
    )]
    NotLlama(String),
    /// A tensor's blocks could not be packed for the device.
    #[error("tensor {name:?}: {source}")]
    Pack {
        /// The tensor.
        name: String,
        /// Why it could not be packed.
        source: PackError,
    },
    /// A tensor's shape is not the one the config implies.
    #[error("tensor {name:?} has shape {found:?} (ggml order), expected {expected:?}")]
    ShapeMismatch {
        /// The tensor's name.
        name: String,
        /// The expected ggml dims.
        expected: Vec<u64>,
        /// The ggml dims in the file.
        found: Vec<u64>,
    },
}

/// Load the model in `file` onto `device`. `progress(done, total)` is called after each tensor.
pub fn load<B: ToyBackend>(
    file: &GgufFile,
    device: &B::Device,
    mut progress: impl FnMut(usize, usize),
) -> Result<(ModelConfig, Transformer<B>), LoadError> {
    let config = ModelConfig::from_gguf(file)?;
    if config.norm != NormKind::Rms || config.learned_positions {
        return Err(LoadError::NotLlama(config.architecture));
    }
    let c = &config;
    let total = 3 + 9 * c.n_layer;
    // Shared by the per-tensor closures below (hence the cells).
    let progress = std::cell::RefCell::new(&mut progress);
    let done = std::cell::Cell::new(0);
    let tick = || {
        done.set(done.get() + 1);
        (progress.borrow_mut())(done.get(), total);
    };

    let (qdim, kvdim) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    let token_embd = embedding(file, c.d_model, c.vocab_size, device)?;
    // A tied head has no matrix of its own: it multiplies by `token_embd` (`Transformer::head`).
    let output = (!c.tied_embeddings)
        .then(|| linear(file, "output.weight", c.d_model, c.vocab_size, device))
        .transpose()?;
    tick();
    let output_norm = norm(file, "output_norm.weight", c.d_model, c, device)?;
    tick();

    let llama = LlamaConfig::from_model_config(c);
    let mut blocks = Vec::with_capacity(c.n_layer);
    for i in 0..c.n_layer {
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let lin = |t: &str, inp: usize, out: usize| {
            let l = linear(file, &name(t), inp, out, device);
            tick();
            l
        };
        // phi3 stores Q|K|V as one `attn_qkv` matrix: its rows are split here, still packed.
        let [wq, wk, wv] = match c.fused_qkv {
            true => {
                let [q, k, v] = split_linear(
                    file,
                    &name("attn_qkv"),
                    c.d_model,
                    [qdim, kvdim, kvdim],
                    device,
                )?;
                tick();
                tick();
                tick();
                [q, k, v]
            }
            false => [
                lin("attn_q", c.d_model, qdim)?,
                lin("attn_k", c.d_model, kvdim)?,
                lin("attn_v", c.d_model, kvdim)?,
            ],
        };
        let attn = Attention {
            wq,
            wk,
            wv,
            wo: lin("attn_output", qdim, c.d_model)?,
            bq: bias(
                file,
                &format!("blk.{i}.attn_q.bias"),
                qdim,
                c.attn_bias,
                device,
            )?,
            bk: bias(
                file,
                &format!("blk.{i}.attn_k.bias"),
                kvdim,
                c.attn_bias,
                device,
            )?,
            bv: bias(
                file,
                &format!("blk.{i}.attn_v.bias"),
                kvdim,
                c.attn_bias,
                device,
            )?,
            q_norm: match c.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead => Some(norm(file, &name("attn_q_norm"), c.head_dim, c, device)?),
                QkNorm::Full => Some(norm(file, &name("attn_q_norm"), qdim, c, device)?),
            },
            k_norm: match c.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead => Some(norm(file, &name("attn_k_norm"), c.head_dim, c, device)?),
                QkNorm::Full => Some(norm(file, &name("attn_k_norm"), kvdim, c, device)?),
            },
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            qk_norm_full: c.qk_norm == QkNorm::Full,
            query_scale: c.query_scale,
            kq_scale: c.kq_scale,
            softcap: c.attn_softcap,
            window: llama.window(i),
            rope_set: llama.rope_set(i),
        };
        let gelu = c.ffn == FfnKind::GeGlu;
        let ffn = match c.ffn {
            FfnKind::SwiGlu | FfnKind::GeGlu => {
                // phi3's `ffn_up` holds the gate's rows, then the up projection's.
                let [gate, up] = match c.fused_gate_up {
                    true => {
                        let parts = split_linear(
                            file,
                            &name("ffn_up"),
                            c.d_model,
                            [c.d_ff, c.d_ff],
                            device,
                        )?;
                        tick();
                        tick();
                        parts
                    }
                    false => [
                        lin("ffn_gate", c.d_model, c.d_ff)?,
                        lin("ffn_up", c.d_model, c.d_ff)?,
                    ],
                };
                Ffn::Dense(Mlp {
                    gate,
                    up,
                    down: lin("ffn_down", c.d_ff, c.d_model)?,
                    gelu,
                })
            }
            FfnKind::Moe {
                n_expert,
                n_expert_used,
                norm_weights,
            } => {
                let router = lin("ffn_gate_inp", c.d_model, n_expert)?;
                let exps = |t: &str, inp: usize, out: usize| {
                    experts(file, &name(t), inp, out, n_expert, device)
                };
                let gates = exps("ffn_gate_exps", c.d_model, c.d_ff)?;
                let ups = exps("ffn_up_exps", c.d_model, c.d_ff)?;
                let downs = exps("ffn_down_exps", c.d_ff, c.d_model)?;
                tick();
                let experts = gates
                    .into_iter()
                    .zip(ups)
                    .zip(downs)
                    .map(|((gate, up), down)| Mlp {
                        gate,
                        up,
                        down,
                        gelu: false,
                    })
                    .collect();
                Ffn::Moe(Moe {
                    router,
                    experts,
                    n_used: n_expert_used,
                    norm_weights,
                })
            }
            FfnKind::Gelu => return Err(LoadError::NotLlama(c.architecture.clone())),
        };
        let attn_norm = norm(file, &name("attn_norm"), c.d_model, c, device)?;
        tick();
        let ffn_norm = norm(file, &name("ffn_norm"), c.d_model, c, device)?;
        tick();
        let post = |t: &str| {
            c.post_norms
                .then(|| norm(file, &name(t), c.d_model, c, device))
                .transpose()
        };
        blocks.push(Block {
            attn_norm,
            attn,
            post_attn_norm: post("post_attention_norm")?,
            ffn_norm,
            ffn,
            post_ffn_norm: post("post_ffw_norm")?,
            residual_scale: c.residual_scale,
            lora: None,
        });
        // Each tensor's pages were released as it was copied, but the kernel's fault-around
        // maps neighbouring pages with each read, tensors' edges share pages, and reading the
        // small norms maps theirs: released here too, the file never sits in memory beside
        // the model (measured: 45 MB of file pages resident at once while loading SmolLM2
        // Q6_K without this).
        file.release_pages();
    }
    // Llama 3.x stores per-pair frequency divisors as a tensor.
    let freq_factors = match file.tensor("rope_freqs.weight") {
        Some(_) => Some(tensor_to_f32(
            file,
            tensor(file, "rope_freqs.weight", &[c.rope_dim / 2])?,
        )?),
        None => None,
    };
    let factors = |t: &str| -> Result<Vec<f32>, LoadError> {
        Ok(tensor_to_f32(file, tensor(file, t, &[c.rope_dim / 2])?)?)
    };
    let long_rope = match c.long_rope_context {
        Some(original_context) => Some(LongRope {
            long: factors("rope_factors_long.weight")?,
            short: factors("rope_factors_short.weight")?,
            original_context,
        }),
        None => None,
    };
    let mut ropes = vec![RopeAngles::new(c, freq_factors)];
    ropes.extend(RopeAngles::sliding_window_layers(c));
    let model = llama.assemble(token_embd, blocks, output_norm, output, ropes, long_rope);
    tick();
    // Every weight now lives in its own buffer: the file's pages need not stay resident.
    file.release_pages();
    Ok((config, model))
}

/// The experts of a 3-D `ffn_*_exps` tensor (ggml dims `[in, out, n_expert]`: expert `e` is
/// the `e`-th `[out, in]` matrix), one `QLinear` each; packed formats stay packed.
fn experts<B: ToyBackend>(
    file: &GgufFile,
    name: &str,
    inp: usize,
    out: usize,
    n_expert: usize,
    device: &B::Device,
) -> Result<Vec<QLinear<B>>, LoadError> {
    let info = tensor(file, name, &[inp, out, n_expert])?;
    let data = file.tensor_data(info);
    let per_expert = data.len() / n_expert;
    if PACKED_TYPES.contains(&info.ggml_type) {
        let experts = (0..n_expert)
            .map(|e| {
                let bytes = &data[e * per_expert..(e + 1) * per_expert];
                packed(info, bytes, out, inp, true, device).map(QLinear::Packed)
            })
            .collect();
        file.release_tensor_pages(info);
        return experts;
    }
    let values = tensor_to_f32(file, info)?;
    Ok(values
        .chunks(out * inp)
        .map(|m| {
            QLinear::Dense(Param::from_tensor(Tensor::from_data(
                TensorData::new(m.to_vec(), [out, inp]),
                device,
            )))
        })
        .collect())
}

/// A weight's GGUF bytes (`rows × cols` values of `info`'s type) packed onto the device.
fn packed<B: ToyBackend>(
    info: &TensorInfo,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    repackable: bool,
    device: &B::Device,
) -> Result<PackedMatrix<B>, LoadError> {
    let host = pack(info.ggml_type, bytes, rows, cols).map_err(|source| LoadError::Pack {
        name: info.name.clone(),
        source,
    })?;
    Ok(PackedMatrix::from_host(host, repackable, device))
}

/// The token embedding table `[vocab, d]`: packed when its type is, else f32.
fn embedding<B: ToyBackend>(
    file: &GgufFile,
    d: usize,
    vocab: usize,
    device: &B::Device,
) -> Result<TokenEmbedding<B>, LoadError> {
    let info = tensor(file, "token_embd.weight", &[d, vocab])?;
    let table = if PACKED_TYPES.contains(&info.ggml_type) {
        TokenEmbedding::Packed(packed(
            info,
            file.tensor_data(info),
            vocab,
            d,
            false,
            device,
        )?)
    } else {
        TokenEmbedding::Dense(Embedding {
            weight: Param::from_tensor(dense_tensor(file, info, device)?),
        })
    };
    file.release_tensor_pages(info);
    Ok(table)
}

/// Look up a tensor and check its ggml dims (`[in, out]` for a matrix).
pub(crate) fn tensor<'a>(
    file: &'a GgufFile,
    name: &str,
    dims: &[usize],
) -> Result<&'a TensorInfo, LoadError> {
    let info = file
        .tensor(name)
        .ok_or_else(|| LoadError::MissingTensor(name.to_string()))?;
    let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if info.dims != expected {
        return Err(LoadError::ShapeMismatch {
            name: name.to_string(),
            expected,
            found: info.dims.clone(),
        });
    }
    Ok(info)
}

/// A tensor dequantized to f32, in PyTorch order.
pub(crate) fn dense_tensor<B: ToyBackend, const D: usize>(
    file: &GgufFile,
    info: &TensorInfo,
    device: &B::Device,
) -> Result<Tensor<B, D>, LoadError> {
    let values = tensor_to_f32(file, info)?;
    let shape: [usize; D] = info.shape().try_into().expect("rank checked by the caller");
    Ok(Tensor::from_data(TensorData::new(values, shape), device))
}

/// An RMSNorm of `width` (the model width, or the head width for per-head Q/K norms).
fn norm<B: ToyBackend>(
    file: &GgufFile,
    name: &str,
    width: usize,
    c: &ModelConfig,
    device: &B::Device,
) -> Result<RmsNorm<B>, LoadError> {
    let info = tensor(file, name, &[width])?;
    let mut norm = RmsNormConfig::new(width)
        .with_epsilon(c.rms_eps as f64)
        .init(device);
    norm.gamma = Param::from_tensor(dense_tensor(file, info, device)?);
    Ok(norm)
}

/// A Q/K/V bias `[out]`, present when the architecture has them.
fn bias<B: ToyBackend>(
    file: &GgufFile,
    name: &str,
    out: usize,
    present: bool,
    device: &B::Device,
) -> Result<Option<Param<Tensor<B, 1>>>, LoadError> {
    if !present {
        return Ok(None);
    }
    let info = tensor(file, name, &[out])?;
    Ok(Some(Param::from_tensor(dense_tensor(file, info, device)?)))
}

/// A fused weight `[in, Σ outs]` (ggml order) split by output rows into one `QLinear` per part:
/// a packed weight's rows are whole blocks, so each part stays packed (and computes what the
/// fused matrix's rows compute).
fn split_linear<B: ToyBackend, const N: usize>(
    file: &GgufFile,
    name: &str,
    inp: usize,
    outs: [usize; N],
    device: &B::Device,
) -> Result<[QLinear<B>; N], LoadError> {
    let info = tensor(file, name, &[inp, outs.iter().sum()])?;
    let mut parts = Vec::with_capacity(N);
    let mut first = 0;
    if PACKED_TYPES.contains(&info.ggml_type) {
        let data = file.tensor_data(info);
        // `tensor` checked the dims, and the file's reader the data's length against them.
        let row = data.len() / outs.iter().sum::<usize>();
        for out in outs {
            let bytes = &data[first * row..(first + out) * row];
            parts.push(QLinear::Packed(packed(
                info, bytes, out, inp, true, device,
            )?));
            first += out;
        }
    } else {
        let values = tensor_to_f32(file, info)?;
        for out in outs {
            let m = values[first * inp..(first + out) * inp].to_vec();
            parts.push(QLinear::Dense(Param::from_tensor(Tensor::from_data(
                TensorData::new(m, [out, inp]),
                device,
            ))));
            first += out;
        }
    }
    file.release_tensor_pages(info);
    Ok(parts
        .try_into()
        .unwrap_or_else(|_| unreachable!("one part per size")))
}

/// A weight `[in, out]` (ggml order) as a `QLinear`: packed types stay packed, the rest is f32.
pub(crate) fn linear<B: ToyBackend>(
    file: &GgufFile,
    name: &str,
    inp: usize,
    out: usize,
    device: &B::Device,
) -> Result<QLinear<B>, LoadError> {
    let info = tensor(file, name, &[inp, out])?;
    let weight = if PACKED_TYPES.contains(&info.ggml_type) {
        QLinear::Packed(packed(
            info,
            file.tensor_data(info),
            out,
            inp,
            true,
            device,
        )?)
    } else {
        QLinear::Dense(Param::from_tensor(dense_tensor(file, info, device)?))
    };
    file.release_tensor_pages(info);
    Ok(weight)
}
