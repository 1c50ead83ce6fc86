//! timm's ViT weights as safetensors: what `safetensors.torch.save_file(model.state_dict(), …)`
//! writes for a timm `VisionTransformer` with a class token (`vit_tiny_patch16_224` and its
//! kind), read into a [`Vit`] and written back under the same names.
//!
//! The shape comes from the tensors themselves (width from `cls_token`, patch and channels from
//! `patch_embed.proj.weight`, the grid from `pos_embed`, depth from the `blocks.N` indices, the
//! classes from `head.weight`) except the number of heads, which a `state_dict` does not hold:
//! it is read from the metadata key `vit.n_head` (toy writes it) or else taken as timm's presets
//! have it, 64-wide heads. Anything else in the file (register tokens, layer scale, `fc_norm`,
//! q/k norms) is a ViT variant toy does not run and is refused by name.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use burn::tensor::backend::Backend;
use safetensors::{Dtype, SafeTensors};
use toy_kernels::ToyBackend;

use super::{Vit, VitConfig};
use crate::host_tensors::safetensors_f32;

/// Metadata key holding the number of attention heads.
pub const N_HEAD_KEY: &str = "vit.n_head";
/// Metadata key holding the class labels, a JSON array of strings (optional).
pub const LABELS_KEY: &str = "vit.labels";

/// Why a ViT weight file could not be read or written. Every message is one line that names
/// the file.
#[derive(Debug, thiserror::Error)]
pub enum VitFileError {
    /// Reading or writing the file failed.
    #[error("{file}: {source}")]
    Io {
        /// The file's path.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file could not be parsed as safetensors or GGUF (or the GGUF written).
    #[error("{file}: not a safetensors file: {message}")]
    Format {
        /// The file.
        file: String,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor the model needs is not in the file.
    #[error("{file}: not a timm ViT: no tensor `{name}`")]
    Missing {
        /// The file.
        file: String,
        /// The tensor it lacks.
        name: String,
    },
    /// A tensor's shape is not the one the model needs.
    #[error("{file}: tensor `{name}` has shape {got:?}, expected {want:?}")]
    Shape {
        /// The file's path.
        file: String,
        /// The tensor's name in the file.
        name: String,
        /// The shape in the file.
        got: Vec<usize>,
        /// The shape expected (zeros where only its rank is known).
        want: Vec<usize>,
    },
    /// A tensor's element type is not a float type toy reads.
    #[error("{file}: tensor `{name}` is {dtype}; toy reads F32, F16 and BF16")]
    Dtype {
        /// The file's path.
        file: String,
        /// The tensor's name in the file.
        name: String,
        /// The tensor's element type.
        dtype: String,
    },
    /// A tensor of a ViT variant toy does not run (register tokens, layer scale, q/k norms).
    #[error(
        "{file}: tensor `{name}` belongs to a ViT variant toy does not run (it runs timm's class-token ViTs without register tokens, layer scale or q/k norms)"
    )]
    Unexpected {
        /// The file.
        file: String,
        /// The tensor toy does not know.
        name: String,
    },
    /// The file's shape or metadata is missing, invalid or inconsistent (keys, heads, labels),
    /// or the model could not be serialized.
    #[error("{file}: {message}")]
    Config {
        /// The configuration file.
        file: String,
        /// What is wrong with it.
        message: String,
    },
}

/// A ViT read from a file: its shape, its weights and, when the file names them, its labels.
pub struct LoadedVit<B: Backend> {
    /// The model's shape.
    pub config: VitConfig,
    /// The model with its weights.
    pub model: Vit<B>,
    /// Class labels, one per class, when the file has them.
    pub labels: Option<Vec<String>>,
}

/// Read a timm ViT safetensors file.
pub fn load_safetensors<B: ToyBackend>(
    path: &Path,
    device: &B::Device,
) -> Result<LoadedVit<B>, VitFileError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| VitFileError::Io {
        file: file.clone(),
        source,
    })?;
    read_safetensors(&bytes, &file, device)
}

/// [`load_safetensors`] of bytes already read; `file` names them in errors.
pub fn read_safetensors<B: ToyBackend>(
    bytes: &[u8],
    file: &str,
    device: &B::Device,
) -> Result<LoadedVit<B>, VitFileError> {
    let format = |message: String| VitFileError::Format {
        file: file.to_string(),
        message,
    };
    let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(|e| format(e.to_string()))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| format(e.to_string()))?;
    let meta: HashMap<String, String> = metadata.metadata().clone().unwrap_or_default();
    let config = config_of(&st, &meta, file)?;

    let mut unread: BTreeSet<String> = st.names().into_iter().map(str::to_string).collect();
    let model = config.build::<B, _>(device, |name, shape, _| {
        unread.remove(name);
        values(&st, file, name, shape)
    })?;
    if let Some(name) = unread.into_iter().next() {
        return Err(VitFileError::Unexpected {
            file: file.to_string(),
            name,
        });
    }
    let labels = match meta.get(LABELS_KEY) {
        None => None,
        Some(json) => Some(
            serde_json::from_str::<Vec<String>>(json)
                .ok()
                .filter(|l| l.len() == config.n_classes)
                .ok_or_else(|| VitFileError::Config {
                    file: file.to_string(),
                    message: format!(
                        "metadata `{LABELS_KEY}` is not a JSON array of {} strings",
                        config.n_classes
                    ),
                })?,
        ),
    };
    Ok(LoadedVit {
        config,
        model,
        labels,
    })
}

/// The shape of the ViT in `st`, from its tensors' shapes and the metadata.
fn config_of(
    st: &SafeTensors<'_>,
    meta: &HashMap<String, String>,
    file: &str,
) -> Result<VitConfig, VitFileError> {
    let shape = |name: &str| -> Result<Vec<usize>, VitFileError> {
        st.tensor(name)
            .map(|t| t.shape().to_vec())
            .map_err(|_| VitFileError::Missing {
                file: file.to_string(),
                name: name.to_string(),
            })
    };
    let config_error = |message: String| VitFileError::Config {
        file: file.to_string(),
        message,
    };
    let bad_rank = |name: &str, got: Vec<usize>, rank: usize| VitFileError::Shape {
        file: file.to_string(),
        name: name.to_string(),
        want: vec![0; rank],
        got,
    };
    let cls = shape("cls_token")?;
    let [1, 1, d] = cls[..] else {
        return Err(bad_rank("cls_token", cls, 3));
    };
    let conv = shape("patch_embed.proj.weight")?;
    let [_, channels, p, p2] = conv[..] else {
        return Err(bad_rank("patch_embed.proj.weight", conv, 4));
    };
    if p != p2 {
        return Err(config_error(format!(
            "patches of {p}×{p2}: toy runs square patches"
        )));
    }
    let pos = shape("pos_embed")?;
    let [1, tokens, _] = pos[..] else {
        return Err(bad_rank("pos_embed", pos, 3));
    };
    let grid = ((tokens.saturating_sub(1)) as f64).sqrt().round() as usize;
    if tokens < 2 || grid * grid + 1 != tokens {
        return Err(config_error(format!(
            "pos_embed has {tokens} positions, not a class token and a square grid of patches"
        )));
    }
    let n_layer = st
        .names()
        .iter()
        .filter_map(|n| {
            n.strip_prefix("blocks.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max()
        .map_or(0, |last| last + 1);
    let fc1 = shape("blocks.0.mlp.fc1.weight")?;
    let head = shape("head.weight")?;
    let n_head = match meta.get(N_HEAD_KEY) {
        Some(v) => v.parse::<usize>().map_err(|_| {
            config_error(format!("metadata `{N_HEAD_KEY}` = {v:?} is not a number"))
        })?,
        None if d % 64 == 0 => d / 64,
        None => {
            return Err(config_error(format!(
                "no `{N_HEAD_KEY}` metadata and width {d} is not a multiple of timm's 64-wide heads"
            )));
        }
    };
    let config =
        VitConfig::new(grid * p, p, d, n_layer, n_head, fc1[0], head[0]).with_in_channels(channels);
    config.check().map_err(config_error)?;
    Ok(config)
}

/// The values of tensor `name`, which must have `shape`, widened to f32.
fn values(
    st: &SafeTensors<'_>,
    file: &str,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, VitFileError> {
    let t = st.tensor(name).map_err(|_| VitFileError::Missing {
        file: file.to_string(),
        name: name.to_string(),
    })?;
    if t.shape() != shape {
        return Err(VitFileError::Shape {
            file: file.to_string(),
            name: name.to_string(),
            got: t.shape().to_vec(),
            want: shape.to_vec(),
        });
    }
    safetensors_f32(&t).map_err(|dtype| VitFileError::Dtype {
        file: file.to_string(),
        name: name.to_string(),
        dtype: format!("{dtype:?}"),
    })
}

impl<B: ToyBackend> Vit<B> {
    /// Every tensor under its timm name with its shape and f32 values, in `state_dict` order.
    pub fn timm_tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut out = Vec::new();
        let mut push = |name: String, t: burn::tensor::TensorData| {
            let shape = t.shape.to_vec();
            out.push((
                name,
                shape,
                t.convert::<f32>().into_vec::<f32>().expect("f32"),
            ));
        };
        let linear = |push: &mut dyn FnMut(String, burn::tensor::TensorData),
                      name: &str,
                      l: &crate::gpt2::Linear<B>| {
            // A packed weight (never in a ViT toy builds, but a module may carry one) widened.
            if let crate::QLinear::Dense(w) = l.weight.dequantized() {
                push(format!("{name}.weight"), w.val().into_data());
            }
            push(format!("{name}.bias"), l.bias.val().into_data());
        };
        let norm = |push: &mut dyn FnMut(String, burn::tensor::TensorData),
                    name: &str,
                    n: &crate::gpt2::LayerNorm<B>| {
            push(format!("{name}.weight"), n.weight.val().into_data());
            push(format!("{name}.bias"), n.bias.val().into_data());
        };
        push("cls_token".into(), self.cls_token.val().into_data());
        push("pos_embed".into(), self.pos_embed.val().into_data());
        push(
            "patch_embed.proj.weight".into(),
            self.patch_embed.weight.val().into_data(),
        );
        if let Some(bias) = &self.patch_embed.bias {
            push("patch_embed.proj.bias".into(), bias.val().into_data());
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let at = format!("blocks.{i}");
            norm(&mut push, &format!("{at}.norm1"), &b.norm1);
            linear(&mut push, &format!("{at}.attn.qkv"), &b.qkv);
            linear(&mut push, &format!("{at}.attn.proj"), &b.proj);
            norm(&mut push, &format!("{at}.norm2"), &b.norm2);
            linear(&mut push, &format!("{at}.mlp.fc1"), &b.fc1);
            linear(&mut push, &format!("{at}.mlp.fc2"), &b.fc2);
        }
        norm(&mut push, "norm", &self.norm);
        linear(&mut push, "head", &self.head);
        out
    }

    /// The model as timm's `state_dict` in safetensors (F32, `{"format": "pt"}` as torch
    /// writes, plus the heads and, when given, the labels), which
    /// `timm.create_model(…).load_state_dict(safetensors.torch.load_file(…))` reads.
    pub fn to_safetensors(&self, labels: Option<&[String]>) -> Result<Vec<u8>, String> {
        let tensors = self.timm_tensors();
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(name, shape, v)| {
                let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                (name, shape, b)
            })
            .collect();
        let views = bytes
            .iter()
            .map(|(name, shape, data)| {
                safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), data)
                    .map(|view| (name.clone(), view))
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, String>>()?;
        let mut metadata = HashMap::from([
            ("format".to_string(), "pt".to_string()),
            (N_HEAD_KEY.to_string(), self.blocks[0].n_head.to_string()),
        ]);
        if let Some(labels) = labels {
            let json = serde_json::to_string(labels).map_err(|e| e.to_string())?;
            metadata.insert(LABELS_KEY.to_string(), json);
        }
        safetensors::serialize(views, Some(metadata)).map_err(|e| e.to_string())
    }

    /// Write [`to_safetensors`](Self::to_safetensors) to `path`.
    pub fn save_safetensors(
        &self,
        path: &Path,
        labels: Option<&[String]>,
    ) -> Result<(), VitFileError> {
        let file = path.display().to_string();
        let bytes = self
            .to_safetensors(labels)
            .map_err(|message| VitFileError::Config {
                file: file.clone(),
                message,
            })?;
        toy_core::atomic::write_atomic(path, &bytes)
            .map_err(|source| VitFileError::Io { file, source })
    }
}
