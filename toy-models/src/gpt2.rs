//! GPT-2: learned absolute position embeddings, pre-LayerNorm blocks (weight and bias) of
//! multi-head attention with one fused QKV projection (with bias) and an output projection (with
//! bias), a GELU MLP with biases, a final LayerNorm and the output head tied to the token
//! embedding. Not a llama variant (no RoPE, no RMSNorm, no gate), so it is its own module; it
//! shares [`QLinear`], the KV cache and the backend's attention op with the llama family.
//!
//! The GGUF layout is llama.cpp's `gpt2`: `position_embd.weight`, `blk.N.attn_qkv.{weight,bias}`
//! (Q, K, V stacked along the output), `attn_output`, `ffn_up`, `ffn_down` with biases, and the
//! `attn_norm`/`ffn_norm`/`output_norm` LayerNorms.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData};
use toy_core::config::ModelConfig;
use toy_core::gguf::GgufFile;
use toy_kernels::{AttentionOptions, AttentionPart, ToyBackend};

use crate::cache::{self, KvCache, Segment};
use crate::llama::gelu_ggml;
use crate::load::{LoadError, dense_tensor, linear, tensor};
use crate::lora::{Adaptable, BlockLora, Lora, LoraBlock, LoraError, Target, project};
use crate::qlinear::QLinear;

/// The shape of a GPT-2 model (its GGUF `gpt2.*` keys).
#[derive(Config, Debug)]
pub struct Gpt2Config {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Attention heads (`d_model` must be a multiple).
    pub n_head: usize,
    /// Hidden width of the GELU MLP (4 × `d_model` in OpenAI's GPT-2).
    pub d_ff: usize,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Positions with a learned embedding: the longest context.
    pub context_length: usize,
    /// LayerNorm epsilon.
    #[config(default = 1e-5)]
    pub norm_eps: f64,
}

impl Gpt2Config {
    /// The shape of a loaded `gpt2` GGUF.
    pub fn from_model_config(c: &ModelConfig) -> Self {
        Gpt2Config::new(
            c.n_layer,
            c.d_model,
            c.n_head,
            c.d_ff,
            c.vocab_size,
            c.context_length,
        )
        .with_norm_eps(c.rms_eps as f64)
    }

    /// A randomly initialized model, for training from scratch and tests: matrices and
    /// embeddings N(0, 1/fan_in) from burn's RNG (the output head untied, with its own weights),
    /// LayerNorms at weight 1 and bias 0, biases 0.
    pub fn init<B: ToyBackend>(&self, device: &B::Device) -> Gpt2<B> {
        let normal = |shape: [usize; 2]| {
            let std = (1.0 / shape[1] as f64).sqrt();
            Param::from_tensor(Tensor::random(
                shape,
                Distribution::Normal(0.0, std),
                device,
            ))
        };
        let zeros = |n: usize| Param::from_tensor(Tensor::zeros([n], device));
        let layer_norm = || LayerNorm {
            weight: Param::from_tensor(Tensor::ones([self.d_model], device)),
            bias: zeros(self.d_model),
            eps: self.norm_eps,
        };
        let linear = |out: usize, inp: usize| Linear {
            weight: QLinear::Dense(normal([out, inp])),
            bias: zeros(out),
        };
        let d = self.d_model;
        Gpt2 {
            token_embd: Embedding {
                weight: normal([self.vocab_size, d]),
            },
            pos_embd: Embedding {
                weight: normal([self.context_length, d]),
            },
            blocks: (0..self.n_layer)
                .map(|_| Gpt2Block {
                    attn_norm: layer_norm(),
                    qkv: linear(3 * d, d),
                    wo: linear(d, d),
                    ffn_norm: layer_norm(),
                    up: linear(self.d_ff, d),
                    down: linear(d, self.d_ff),
                    n_head: self.n_head,
                    lora: None,
                })
                .collect(),
            output_norm: layer_norm(),
            output: QLinear::Dense(normal([self.vocab_size, d])),
            context_length: self.context_length,
        }
    }
}

/// The whole GPT-2 model.
#[derive(Module, Debug)]
pub struct Gpt2<B: Backend> {
    /// The token embedding table, `[vocab_size, d_model]`.
    pub token_embd: Embedding<B>,
    /// `[context_length, d_model]`: one learned vector per position.
    pub pos_embd: Embedding<B>,
    /// The transformer blocks, first to last.
    pub blocks: Vec<Gpt2Block<B>>,
    /// The final LayerNorm, applied before the output head.
    pub output_norm: LayerNorm<B>,
    /// The output head, `[vocab_size, d_model]` (read from the token embedding when the GGUF
    /// has no `output.weight`).
    pub output: QLinear<B>,
    /// Longest context (prompt + generated tokens), the positions `pos_embd` covers.
    pub context_length: usize,
}

/// One pre-LayerNorm GPT-2 block: attention, then the GELU MLP, each added to the residual
/// stream.
#[derive(Module, Debug)]
pub struct Gpt2Block<B: Backend> {
    /// LayerNorm before attention.
    pub attn_norm: LayerNorm<B>,
    /// `[3 * d_model, d_model]`: Q, K and V stacked.
    pub qkv: Linear<B>,
    /// Attention output projection, `[d_model, d_model]`.
    pub wo: Linear<B>,
    /// LayerNorm before the MLP.
    pub ffn_norm: LayerNorm<B>,
    /// MLP up projection, `[d_ff, d_model]`.
    pub up: Linear<B>,
    /// MLP down projection, `[d_model, d_ff]`.
    pub down: Linear<B>,
    /// Attention heads.
    pub n_head: usize,
    /// LoRA adapters on `qkv`, `wo`, `up`, `down` (`None`: the plain model).
    pub lora: Option<BlockLora<B>>,
}

/// A linear layer with bias.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    /// The weight, `[out, in]`.
    pub weight: QLinear<B>,
    /// The bias, `[out]`, added after the matmul.
    pub bias: Param<Tensor<B, 1>>,
}

/// LayerNorm over the last dim: `(x - mean) / sqrt(var + eps) * weight + bias`, in ggml's order
/// (`ggml_norm`, then `ggml_mul` by the weight, then `ggml_add` of the bias).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    /// Scale per feature, `[d]`.
    pub weight: Param<Tensor<B, 1>>,
    /// Shift per feature, `[d]`.
    pub bias: Param<Tensor<B, 1>>,
    /// Added to the variance before the square root.
    pub eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    /// `x` normalized over its last dimension, then scaled and shifted.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mean = x.clone().mean_dim(D - 1);
        let centered = x - mean;
        let var = centered.clone().square().mean_dim(D - 1);
        let scale = var.add_scalar(self.eps).sqrt().recip();
        centered * scale * self.weight.val().unsqueeze() + self.bias.val().unsqueeze()
    }
}

impl<B: ToyBackend> Linear<B> {
    /// `x[.., in] -> [.., out]`, bias added.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        self.forward_adapted(None, x)
    }

    /// `forward` plus an adapter's contribution (llama.cpp adds it before the bias).
    fn forward_adapted<const D: usize>(
        &self,
        lora: Option<&Lora<B>>,
        x: Tensor<B, D>,
    ) -> Tensor<B, D> {
        project(&self.weight, lora, x) + self.bias.val().unsqueeze()
    }
}

impl<B: Backend> LoraBlock<B> for Gpt2Block<B> {
    fn adapted(&self, t: Target) -> Result<Vec<&QLinear<B>>, LoraError> {
        Ok(vec![match t {
            Target::Qkv => &self.qkv.weight,
            Target::O => &self.wo.weight,
            Target::Up => &self.up.weight,
            Target::Down => &self.down.weight,
            _ => return Err(no_matrix(t)),
        }])
    }

    fn adapted_mut(&mut self, t: Target) -> Result<Vec<&mut QLinear<B>>, LoraError> {
        Ok(vec![match t {
            Target::Qkv => &mut self.qkv.weight,
            Target::O => &mut self.wo.weight,
            Target::Up => &mut self.up.weight,
            Target::Down => &mut self.down.weight,
            _ => return Err(no_matrix(t)),
        }])
    }

    fn lora(&self) -> Option<&BlockLora<B>> {
        self.lora.as_ref()
    }

    fn lora_mut(&mut self) -> &mut Option<BlockLora<B>> {
        &mut self.lora
    }
}

fn no_matrix(t: Target) -> LoraError {
    LoraError::NoMatrix {
        family: "gpt2",
        target: t.name(),
        targets: "qkv, o, up, down",
    }
}

impl<B: Backend> Adaptable<B> for Gpt2<B> {
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
        self.output_norm.weight.device()
    }
}

impl<B: ToyBackend> Gpt2<B> {
    /// Number of transformer blocks.
    pub fn n_layer(&self) -> usize {
        self.blocks.len()
    }

    /// The device the model's weights are on.
    pub fn device(&self) -> B::Device {
        self.output_norm.weight.device()
    }

    /// An empty KV cache for one sequence of this model.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.blocks.len())
    }

    /// Final hidden states `[batch, t, d_model]` of `tokens` after the cached ones.
    pub fn forward_hidden(
        &self,
        tokens: Tensor<B, 2, Int>,
        cache: &mut KvCache<B>,
    ) -> Tensor<B, 3> {
        let t = tokens.dims()[1];
        self.forward_segments(tokens, &mut cache::segments(vec![cache], &[t]))
    }

    /// Several sequences in one pass (see [`crate::cache`]): `tokens[1, T]` holds each
    /// segment's new tokens one after another; with one segment any batch size.
    pub fn forward_segments(
        &self,
        tokens: Tensor<B, 2, Int>,
        segments: &mut [Segment<'_, B>],
    ) -> Tensor<B, 3> {
        let [b, t] = tokens.dims();
        let positions: Vec<i64> = segments
            .iter()
            .flat_map(|s| (s.past..s.past + s.len).map(|p| p as i64))
            .collect();
        let positions =
            Tensor::<B, 2, Int>::from_data(TensorData::new(positions, [1, t]), &tokens.device())
                .expand([b, t]);
        let mut x = self.token_embd.forward(tokens) + self.pos_embd.forward(positions);
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(x, i, segments);
        }
        cache::advance(segments);
        self.output_norm.forward(x)
    }

    /// Logits `[batch, t, vocab]` for every new position.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 3> {
        self.output.forward(self.forward_hidden(tokens, cache))
    }

    /// Mean next-token cross-entropy of `tokens[b, t]` (from an empty cache) against
    /// `targets[b, t]` ([`QLinear::cross_entropy`]).
    pub fn loss(&self, tokens: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        let h = self.forward_hidden(tokens, &mut self.new_cache());
        self.output.cross_entropy(h, targets)
    }

    /// Logits `[batch, vocab]` of the last new position.
    pub fn forward_last(&self, tokens: Tensor<B, 2, Int>, cache: &mut KvCache<B>) -> Tensor<B, 2> {
        let h = self.forward_hidden(tokens, cache);
        let [b, t, d] = h.dims();
        self.output.forward(h.narrow(1, t - 1, 1).reshape([b, d]))
    }
}

impl<B: ToyBackend> Gpt2Block<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        layer: usize,
        segments: &mut [Segment<'_, B>],
    ) -> Tensor<B, 3> {
        let [b, _, d] = x.dims();
        let head_dim = d / self.n_head;
        let adapter = |t: Target| self.lora.as_ref().and_then(|l| l.get(t));
        let qkv = self
            .qkv
            .forward_adapted(adapter(Target::Qkv), self.attn_norm.forward(x.clone()));
        let n_segments = segments.len();
        let mut parts = Vec::with_capacity(n_segments);
        for segment in segments.iter_mut() {
            let qkv = cache::rows(&qkv, segment, n_segments);
            let t = segment.len;
            let heads = |i: usize| {
                qkv.clone()
                    .narrow(2, i * d, d)
                    .reshape([b, t, self.n_head, head_dim])
                    .swap_dims(1, 2)
            };
            let (k, v) = segment.cache.append(layer, heads(1), heads(2));
            let options = AttentionOptions {
                scale: 1.0 / (head_dim as f32).sqrt(),
                q_offset: segment.past,
                window: None,
                softcap: None,
            };
            parts.push(AttentionPart {
                q: heads(0).into_primitive().tensor(),
                k: k.into_primitive().tensor(),
                v: v.into_primitive().tensor(),
                options,
            });
        }
        let h = self
            .wo
            .forward_adapted(adapter(Target::O), cache::attend(parts))
            + x;
        let up = self
            .up
            .forward_adapted(adapter(Target::Up), self.ffn_norm.forward(h.clone()));
        let f = self
            .down
            .forward_adapted(adapter(Target::Down), gelu_ggml(up));
        f + h
    }
}

/// Load a `gpt2` GGUF onto `device`. `progress(done, total)` is called after each block.
pub fn load_gpt2<B: ToyBackend>(
    file: &GgufFile,
    config: &ModelConfig,
    device: &B::Device,
    mut progress: impl FnMut(usize, usize),
) -> Result<Gpt2<B>, LoadError> {
    let c = config;
    let d = c.d_model;
    if c.n_head_kv != c.n_head || c.head_dim * c.n_head != d {
        return Err(LoadError::Config(toy_core::config::ConfigError::Invalid(
            format!(
                "gpt2 needs head_count_kv = head_count and head_dim × head_count = embedding_length \
             (got {} kv heads of {} for {} heads, width {d})",
                c.n_head_kv, c.head_dim, c.n_head
            ),
        )));
    }
    let total = c.n_layer + 2;
    let vector = |name: &str, n: usize| -> Result<Param<Tensor<B, 1>>, LoadError> {
        Ok(Param::from_tensor(dense_tensor(
            file,
            tensor(file, name, &[n])?,
            device,
        )?))
    };
    let layer_norm = |name: &str| -> Result<LayerNorm<B>, LoadError> {
        Ok(LayerNorm {
            weight: vector(&format!("{name}.weight"), d)?,
            bias: vector(&format!("{name}.bias"), d)?,
            eps: c.rms_eps as f64,
        })
    };
    let lin = |name: &str, inp: usize, out: usize| -> Result<Linear<B>, LoadError> {
        Ok(Linear {
            weight: linear(file, &format!("{name}.weight"), inp, out, device)?,
            bias: vector(&format!("{name}.bias"), out)?,
        })
    };
    let embedding = |name: &str, rows: usize| -> Result<Embedding<B>, LoadError> {
        Ok(Embedding {
            weight: Param::from_tensor(dense_tensor(
                file,
                tensor(file, name, &[d, rows])?,
                device,
            )?),
        })
    };
    let token_embd = embedding("token_embd.weight", c.vocab_size)?;
    let pos_embd = embedding("position_embd.weight", c.context_length)?;
    let output = match file.tensor("output.weight") {
        Some(_) => linear(file, "output.weight", d, c.vocab_size, device)?,
        None => linear(file, "token_embd.weight", d, c.vocab_size, device)?,
    };
    progress(1, total);
    let mut blocks = Vec::with_capacity(c.n_layer);
    for i in 0..c.n_layer {
        let p = |t: &str| format!("blk.{i}.{t}");
        blocks.push(Gpt2Block {
            attn_norm: layer_norm(&p("attn_norm"))?,
            qkv: lin(&p("attn_qkv"), d, 3 * d)?,
            wo: lin(&p("attn_output"), d, d)?,
            ffn_norm: layer_norm(&p("ffn_norm"))?,
            up: lin(&p("ffn_up"), d, c.d_ff)?,
            down: lin(&p("ffn_down"), c.d_ff, d)?,
            n_head: c.n_head,
            lora: None,
        });
        // As the llama loader does after each layer (`load.rs`): the file's pages read so far
        // are copied out, so they need not stay resident beside the model.
        file.release_pages();
        progress(i + 2, total);
    }
    let output_norm = layer_norm("output_norm")?;
    progress(total, total);
    Ok(Gpt2 {
        token_embd,
        pos_embd,
        blocks,
        output_norm,
        output,
        context_length: c.context_length,
    })
}
