//! ViT: the Vision Transformer of Dosovitskiy et al., as timm's `VisionTransformer` computes it
//! with a class token and no register tokens (`vit_tiny_patch16_224` and friends).
//!
//! An image `[b, channels, h, w]` is cut into `patch × patch` squares, each projected to
//! `d_model` by one strided convolution (burn's `Conv2d`); a learned class token goes in front,
//! learned position embeddings are added (resampled when the image size is not the one the
//! model was built for), then pre-norm blocks — LayerNorm, multi-head attention in which every
//! token sees every other (toy's attention op with no causal limit), LayerNorm, a GELU MLP — and
//! a final LayerNorm. The class token's row goes through the classifier head.
//!
//! The linear layers and LayerNorms are GPT-2's (`crate::gpt2::{Linear, LayerNorm}`): the same
//! ops the language models run. [`timm`] reads and writes timm's `state_dict` as safetensors,
//! [`gguf`] toy's own checkpoints (`general.architecture = "vit"`).
//!
//! Reading order: the config and its presets, the model's parts bottom-up, the forward pass.

pub mod gguf;
mod resample;
pub mod timm;

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::PaddingConfig2d;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use toy_kernels::{AttentionOptions, ToyBackend};

use crate::gpt2::{LayerNorm, Linear};
use crate::qlinear::{QLinear, cross_entropy};

/// The shape of a ViT. Every field is what timm's `VisionTransformer` takes under the same
/// meaning; [`VitConfig::timm_names`] lists the tensors it has.
#[derive(Config, Debug, PartialEq)]
pub struct VitConfig {
    /// Side of the square images the position embeddings were learned for (pixels).
    pub image_size: usize,
    /// Side of a square patch (pixels); `image_size` must be a multiple.
    pub patch_size: usize,
    /// Width of the residual stream (timm's `embed_dim`).
    pub d_model: usize,
    /// Number of transformer blocks (timm's `depth`).
    pub n_layer: usize,
    /// Attention heads; `d_model` must be a multiple.
    pub n_head: usize,
    /// Hidden width of the MLP (`mlp_ratio × d_model`: 4 × in timm's presets).
    pub d_ff: usize,
    /// Classes of the classifier head.
    pub n_classes: usize,
    /// Channels of the input images.
    #[config(default = 3)]
    pub in_channels: usize,
    /// LayerNorm epsilon (timm's ViTs use `1e-6`).
    #[config(default = 1e-6)]
    pub norm_eps: f64,
}

impl VitConfig {
    /// timm's `vit_tiny_patch16_224`: 224×224 images in 16×16 patches, width 192, 12 blocks of
    /// 3 heads, MLP 768, 1000 classes (ImageNet-1k).
    pub fn timm_vit_tiny_patch16_224() -> Self {
        VitConfig::new(224, 16, 192, 12, 3, 768, 1000)
    }

    /// toy's `vit-tiny`: a ViT for 32×32 images (4×4 patches: 64 tokens and the class token),
    /// small enough to train from scratch on two CPU cores in minutes.
    pub fn vit_tiny(n_classes: usize) -> Self {
        VitConfig::new(32, 4, 96, 4, 3, 384, n_classes)
    }

    /// Patches along each side at the configured image size.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Whether the numbers fit together; the error says which do not.
    pub fn check(&self) -> Result<(), String> {
        let positive = [
            ("image_size", self.image_size),
            ("patch_size", self.patch_size),
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_ff", self.d_ff),
            ("n_classes", self.n_classes),
            ("in_channels", self.in_channels),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("vit: {name} must be positive"));
        }
        if self.image_size % self.patch_size != 0 {
            return Err(format!(
                "vit: image_size {} is not a multiple of patch_size {}",
                self.image_size, self.patch_size
            ));
        }
        if self.d_model % self.n_head != 0 {
            return Err(format!(
                "vit: d_model {} is not a multiple of n_head {}",
                self.d_model, self.n_head
            ));
        }
        Ok(())
    }

    /// A randomly initialized model (burn's RNG; seed it with `B::seed`), as timm initializes
    /// a ViT for training: linear weights, the class token and the position embeddings
    /// N(0, 0.02²), the patch embedding as PyTorch's convolution (U(±1/√fan_in)), linear biases
    /// 0, LayerNorms at weight 1 and bias 0.
    pub fn init<B: ToyBackend>(&self, device: &B::Device) -> Vit<B> {
        let random = |_: &str, shape: &[usize], init: Init| {
            Ok::<_, std::convert::Infallible>(init.draw::<B>(shape.iter().product(), device))
        };
        match self.build(device, random) {
            Ok(vit) => vit,
            Err(never) => match never {},
        }
    }

    /// timm's name and shape of every tensor of this model, in `state_dict` order.
    pub fn timm_names(&self) -> Vec<(String, Vec<usize>)> {
        let mut names = Vec::new();
        // A walk of `build` on the host that records what it asks for.
        let record = |name: &str, shape: &[usize], _: Init| {
            names.push((name.to_string(), shape.to_vec()));
            Ok::<_, std::convert::Infallible>(vec![0.0f32; shape.iter().product()])
        };
        let _ = self.build::<burn::backend::NdArray, _>(&Default::default(), record);
        names
    }

    /// Build the model from a weight source: `source(timm_name, shape, init)` returns that
    /// tensor's values, row-major (`shape.iter().product()` of them: the source checks). Random init
    /// and loading both go through here, so each tensor is named in one place.
    pub fn build<B: ToyBackend, E>(
        &self,
        device: &B::Device,
        source: impl FnMut(&str, &[usize], Init) -> Result<Vec<f32>, E>,
    ) -> Result<Vit<B>, E> {
        let mut w = Source { source, device };
        let d = self.d_model;
        let tokens = self.grid() * self.grid() + 1;
        let cls_token = w
            .tensor("cls_token", &[1, 1, d], Init::Normal)?
            .reshape([1, 1, d]);
        let pos_embed = w
            .tensor("pos_embed", &[1, tokens, d], Init::Normal)?
            .reshape([1, tokens, d]);

        // The patch embedding: a convolution with kernel = stride = patch.
        let p = self.patch_size;
        let mut patch_embed = Conv2dConfig::new([self.in_channels, d], [p, p])
            .with_stride([p, p])
            .with_padding(PaddingConfig2d::Valid)
            .init::<B>(device);
        let conv_shape = [d, self.in_channels, p, p];
        let fan_in = Init::Uniform {
            fan_in: self.in_channels * p * p,
        };
        patch_embed.weight = Param::from_tensor(
            w.tensor("patch_embed.proj.weight", &conv_shape, fan_in)?
                .reshape(conv_shape),
        );
        let bias = w.tensor("patch_embed.proj.bias", &[d], fan_in)?;
        patch_embed.bias = Some(Param::from_tensor(bias));
        let mut blocks = Vec::with_capacity(self.n_layer);
        for i in 0..self.n_layer {
            let at = format!("blocks.{i}");
            blocks.push(VitBlock {
                norm1: w.layer_norm(&format!("{at}.norm1"), d, self.norm_eps)?,
                qkv: w.linear(&format!("{at}.attn.qkv"), 3 * d, d)?,
                proj: w.linear(&format!("{at}.attn.proj"), d, d)?,
                norm2: w.layer_norm(&format!("{at}.norm2"), d, self.norm_eps)?,
                fc1: w.linear(&format!("{at}.mlp.fc1"), self.d_ff, d)?,
                fc2: w.linear(&format!("{at}.mlp.fc2"), d, self.d_ff)?,
                n_head: self.n_head,
            });
        }
        Ok(Vit {
            patch_embed,
            cls_token: Param::from_tensor(cls_token),
            pos_embed: Param::from_tensor(pos_embed),
            blocks,
            norm: w.layer_norm("norm", d, self.norm_eps)?,
            head: w.linear("head", self.n_classes, d)?,
            patch_size: p,
        })
    }
}

/// How [`VitConfig::init`] fills a tensor that [`VitConfig::build`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// N(0, 0.02²): timm's linear weights, class token and position embeddings.
    Normal,
    /// U(−1/√fan_in, 1/√fan_in): PyTorch's default for a convolution's weight and bias
    /// (`kaiming_uniform_(a=√5)`), which timm keeps for the patch embedding. N(0, 0.02²) there
    /// makes the patches 7× fainter than the position embeddings of a 4×4×3 patch, and a
    /// vit-tiny learns the digits half as fast.
    Uniform {
        /// Inputs feeding each output: channels × patch × patch for the patch embedding.
        fan_in: usize,
    },
    /// All 0: linear biases and LayerNorm biases.
    Zeros,
    /// All 1: LayerNorm weights.
    Ones,
}

impl Init {
    /// `n` values drawn from burn's RNG on `device` (seed it with `B::seed`).
    pub fn draw<B: Backend>(self, n: usize, device: &B::Device) -> Vec<f32> {
        use burn::tensor::Distribution;
        let random = |distribution| {
            Tensor::<B, 1>::random([n], distribution, device)
                .into_data()
                .into_vec::<f32>()
                .expect("f32 init")
        };
        match self {
            Init::Normal => random(Distribution::Normal(0.0, 0.02)),
            Init::Uniform { fan_in } => {
                let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
                random(Distribution::Uniform(-bound, bound))
            }
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
        }
    }
}

/// Where [`VitConfig::build`] gets its tensors, and the parts it builds from them.
struct Source<'d, B: Backend, F> {
    source: F,
    device: &'d B::Device,
}

impl<B: ToyBackend, E, F: FnMut(&str, &[usize], Init) -> Result<Vec<f32>, E>> Source<'_, B, F> {
    /// The tensor `name` of `shape`, flat (the caller reshapes it).
    fn tensor(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor<B, 1>, E> {
        let values = (self.source)(name, shape, init)?;
        let n = values.len();
        Ok(Tensor::from_data(TensorData::new(values, [n]), self.device))
    }

    /// `name.weight [out, inp]` and `name.bias [out]`.
    fn linear(&mut self, name: &str, out: usize, inp: usize) -> Result<Linear<B>, E> {
        let weight = self.tensor(&format!("{name}.weight"), &[out, inp], Init::Normal)?;
        let bias = self.tensor(&format!("{name}.bias"), &[out], Init::Zeros)?;
        Ok(Linear {
            weight: QLinear::Dense(Param::from_tensor(weight.reshape([out, inp]))),
            bias: Param::from_tensor(bias),
        })
    }

    /// `name.weight [d]` and `name.bias [d]`.
    fn layer_norm(&mut self, name: &str, d: usize, eps: f64) -> Result<LayerNorm<B>, E> {
        Ok(LayerNorm {
            weight: Param::from_tensor(self.tensor(&format!("{name}.weight"), &[d], Init::Ones)?),
            bias: Param::from_tensor(self.tensor(&format!("{name}.bias"), &[d], Init::Zeros)?),
            eps,
        })
    }
}

/// One pre-norm block: `x + attn(norm1(x))`, then `h + mlp(norm2(h))`.
#[derive(Module, Debug)]
pub struct VitBlock<B: Backend> {
    /// LayerNorm before attention.
    pub norm1: LayerNorm<B>,
    /// `[3 · d_model, d_model]`: Q, K and V stacked along the output (timm's `attn.qkv`).
    pub qkv: Linear<B>,
    /// Attention output projection, `[d_model, d_model]` (timm's `attn.proj`).
    pub proj: Linear<B>,
    /// LayerNorm before the MLP.
    pub norm2: LayerNorm<B>,
    /// MLP up projection, `[d_ff, d_model]` (timm's `mlp.fc1`).
    pub fc1: Linear<B>,
    /// MLP down projection, `[d_model, d_ff]` (timm's `mlp.fc2`).
    pub fc2: Linear<B>,
    /// Attention heads.
    pub n_head: usize,
}

/// The whole ViT classifier.
#[derive(Module, Debug)]
pub struct Vit<B: Backend> {
    /// `[d_model, channels, patch, patch]`, stride `patch`.
    pub patch_embed: Conv2d<B>,
    /// `[1, 1, d_model]`.
    pub cls_token: Param<Tensor<B, 3>>,
    /// `[1, 1 + grid², d_model]`: the class token's position first, then the patches row by row.
    pub pos_embed: Param<Tensor<B, 3>>,
    /// The transformer blocks, first to last.
    pub blocks: Vec<VitBlock<B>>,
    /// The final LayerNorm, applied before the head.
    pub norm: LayerNorm<B>,
    /// `[n_classes, d_model]`.
    pub head: Linear<B>,
    /// Side of a square patch (pixels).
    pub patch_size: usize,
}

impl<B: ToyBackend> VitBlock<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [_, t, d] = x.dims();
        let head_dim = d / self.n_head;
        let qkv = self.qkv.forward(self.norm1.forward(x.clone())); // [b, t, 3d]
        // [b, n_head, t, head_dim] for part i (0: Q, 1: K, 2: V).
        let heads = |i: usize| {
            B::split_heads(
                qkv.clone().narrow(2, i * d, d).into_primitive().tensor(),
                self.n_head,
            )
        };
        let options = AttentionOptions::full(1.0 / (head_dim as f32).sqrt(), t);
        let attended = <B as ToyBackend>::attention(heads(0), heads(1), heads(2), options);
        let attended: Tensor<B, 3> =
            Tensor::from_primitive(TensorPrimitive::Float(B::merge_heads(attended))); // [b, t, d]
        let h = x + self.proj.forward(attended);
        let up = gelu(self.fc1.forward(self.norm2.forward(h.clone())));
        h + self.fc2.forward(up)
    }
}

/// GELU with erf, as `torch.nn.GELU()` (timm's) computes it: `x · ½(1 + erf(x / √2))`, in
/// tensor ops. Not burn's `activation::gelu`: its forward is this, but the default
/// `gelu_backward` of burn 0.21 (which NdArray and the cubecl backends use; Flex has its own,
/// exact one) is the derivative of the tanh approximation (`burn-backend`
/// `ActivationOps::gelu_backward`), up to 8.7e-4 off the true derivative. Autodiff
/// differentiates `erf` exactly.
fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone()
        * x.div_scalar(std::f64::consts::SQRT_2)
            .erf()
            .add_scalar(1.0)
            .mul_scalar(0.5)
}

impl<B: ToyBackend> Vit<B> {
    /// The device the model's weights are on.
    pub fn device(&self) -> B::Device {
        self.cls_token.device()
    }

    /// `[n_classes, d_model]` → `n_classes`.
    pub fn n_classes(&self) -> usize {
        self.head.weight.dims()[0]
    }

    /// The patch grid the position embeddings were learned for (patches per side).
    pub fn grid(&self) -> usize {
        let tokens = self.pos_embed.dims()[1] - 1;
        (tokens as f64).sqrt().round() as usize
    }

    /// The position embeddings for a `gh × gw` patch grid `[1, 1 + gh·gw, d]`: the learned
    /// ones, or their patch part resampled as timm resamples it ([`resample`]) when the grid
    /// differs.
    fn positions(&self, gh: usize, gw: usize) -> Tensor<B, 3> {
        let pos = self.pos_embed.val();
        let g = self.grid();
        if gh == g && gw == g {
            return pos;
        }
        let d = pos.dims()[2];
        let cls = pos.clone().narrow(1, 0, 1);
        let grid = pos.narrow(1, 1, g * g).reshape([g, g, d]);
        let resampled = resample::resample(grid, gh, gw).reshape([1, gh * gw, d]);
        Tensor::cat(vec![cls, resampled], 1)
    }

    /// The class token's final hidden state `[b, d_model]` for images `[b, channels, h, w]`
    /// (already normalized; `h` and `w` multiples of the patch size).
    pub fn forward_features(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let patches = self.patch_embed.forward(images); // [b, d, gh, gw]
        let [b, d, gh, gw] = patches.dims();
        let patches = patches.reshape([b, d, gh * gw]).swap_dims(1, 2); // [b, gh·gw, d]
        let cls = self.cls_token.val().expand([b, 1, d]);
        let mut x = Tensor::cat(vec![cls, patches], 1) + self.positions(gh, gw);
        for block in &self.blocks {
            x = block.forward(x);
        }
        let x = self.norm.forward(x);
        x.narrow(1, 0, 1).reshape([b, d])
    }

    /// Class logits `[b, n_classes]`.
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        self.head.forward(self.forward_features(images))
    }

    /// Mean cross-entropy of the logits against class ids `labels[b]`.
    pub fn loss(&self, images: Tensor<B, 4>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
        let logits = self.forward(images);
        let b = logits.dims()[0];
        cross_entropy(logits.unsqueeze_dim(1), labels.reshape([b, 1]))
    }
}
