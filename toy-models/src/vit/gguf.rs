//! ViT checkpoints as GGUF: `general.architecture = "vit"`, the shape under `vit.*` keys, the
//! class labels under `vit.class_labels`, and the tensors under llama.cpp-style names (GPT-2's
//! where the part is the same), all F32. docs/models.md lists the keys and names.
//!
//! | timm | GGUF |
//! | --- | --- |
//! | `cls_token` | `cls_embd` |
//! | `pos_embed` | `position_embd.weight` |
//! | `patch_embed.proj.{weight,bias}` | `patch_embd.{weight,bias}` |
//! | `blocks.N.norm1` / `norm2` | `blk.N.attn_norm` / `blk.N.ffn_norm` |
//! | `blocks.N.attn.qkv` / `attn.proj` | `blk.N.attn_qkv` / `blk.N.attn_output` |
//! | `blocks.N.mlp.fc1` / `mlp.fc2` | `blk.N.ffn_up` / `blk.N.ffn_down` |
//! | `norm` / `head` | `output_norm` / `output` |

use std::path::Path;

use toy_core::gguf::{GgufFile, GgufWriter, Value, ValueType, tensor_to_f32};
use toy_kernels::ToyBackend;

use super::timm::{LoadedVit, VitFileError};
use super::{Vit, VitConfig};

/// The architecture name of a ViT GGUF.
pub const ARCH: &str = "vit";

/// The GGUF name of the tensor timm calls `timm`.
pub fn gguf_name(timm: &str) -> String {
    let (stem, part) = match timm.rsplit_once('.') {
        Some((stem, part @ ("weight" | "bias"))) => (stem, Some(part)),
        _ => (timm, None),
    };
    let stem = match stem {
        "cls_token" => "cls_embd".to_string(),
        "pos_embed" => return "position_embd.weight".to_string(),
        "patch_embed.proj" => "patch_embd".to_string(),
        "norm" => "output_norm".to_string(),
        "head" => "output".to_string(),
        other => match other
            .strip_prefix("blocks.")
            .and_then(|rest| rest.split_once('.'))
        {
            Some((i, layer)) => {
                let layer = match layer {
                    "norm1" => "attn_norm",
                    "norm2" => "ffn_norm",
                    "attn.qkv" => "attn_qkv",
                    "attn.proj" => "attn_output",
                    "mlp.fc1" => "ffn_up",
                    "mlp.fc2" => "ffn_down",
                    other => other,
                };
                format!("blk.{i}.{layer}")
            }
            None => other.to_string(),
        },
    };
    match part {
        Some(part) => format!("{stem}.{part}"),
        None => stem,
    }
}

fn key(name: &str) -> String {
    format!("{ARCH}.{name}")
}

impl<B: ToyBackend> Vit<B> {
    /// The model as a GGUF writer (every tensor F32, dims in ggml's order: reversed).
    pub fn to_gguf(
        &self,
        config: &VitConfig,
        labels: Option<&[String]>,
    ) -> Result<GgufWriter<'static>, toy_core::gguf::GgufError> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String(ARCH.into()))?;
        w.set("general.file_type", Value::U32(0))?;
        let u32_key = |v: usize| Value::U32(v as u32);
        w.set(key("image_size"), u32_key(config.image_size))?;
        w.set(key("patch_size"), u32_key(config.patch_size))?;
        w.set(key("num_channels"), u32_key(config.in_channels))?;
        w.set(key("embedding_length"), u32_key(config.d_model))?;
        w.set(key("block_count"), u32_key(config.n_layer))?;
        w.set(key("attention.head_count"), u32_key(config.n_head))?;
        w.set(key("feed_forward_length"), u32_key(config.d_ff))?;
        w.set(key("class_count"), u32_key(config.n_classes))?;
        w.set(
            key("attention.layer_norm_epsilon"),
            Value::F32(config.norm_eps as f32),
        )?;
        if let Some(labels) = labels {
            let values = labels.iter().map(|l| Value::String(l.clone())).collect();
            w.set(key("class_labels"), Value::Array(ValueType::String, values))?;
        }
        for (name, shape, values) in self.timm_tensors() {
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.add_tensor(
                gguf_name(&name),
                &dims,
                toy_core::gguf::GgmlType::F32,
                bytes,
            )?;
        }
        Ok(w)
    }

    /// Write [`to_gguf`](Self::to_gguf) to `path` atomically; returns the bytes written.
    pub fn save_gguf(
        &self,
        config: &VitConfig,
        labels: Option<&[String]>,
        path: &Path,
    ) -> Result<u64, VitFileError> {
        let file = path.display().to_string();
        let gguf = |e: toy_core::gguf::GgufError| VitFileError::Format {
            file: file.clone(),
            message: e.to_string(),
        };
        self.to_gguf(config, labels)
            .map_err(gguf)?
            .write_atomic(path)
            .map_err(gguf)
    }
}

/// Read a ViT GGUF (what [`Vit::save_gguf`] writes).
pub fn load_gguf<B: ToyBackend>(
    path: &Path,
    device: &B::Device,
) -> Result<LoadedVit<B>, VitFileError> {
    let file = path.display().to_string();
    let gguf = GgufFile::open(path).map_err(|e| VitFileError::Format {
        file: file.clone(),
        message: e.to_string(),
    })?;
    read_gguf(&gguf, &file, device)
}

/// [`load_gguf`] of a file already open; `file` names it in errors.
pub fn read_gguf<B: ToyBackend>(
    gguf: &GgufFile,
    file: &str,
    device: &B::Device,
) -> Result<LoadedVit<B>, VitFileError> {
    let config_error = |message: String| VitFileError::Config {
        file: file.to_string(),
        message,
    };
    let arch = gguf
        .architecture()
        .map_err(|e| config_error(e.to_string()))?;
    if arch != ARCH {
        return Err(config_error(format!(
            "a `{arch}` model, not a ViT (general.architecture must be `{ARCH}`)"
        )));
    }
    let number = |name: &str| -> Result<usize, VitFileError> {
        match gguf.get_u64(&key(name)) {
            Ok(Some(v)) => Ok(v as usize),
            Ok(None) => Err(config_error(format!("no `{}` key", key(name)))),
            Err(e) => Err(config_error(e.to_string())),
        }
    };
    let eps = gguf
        .get_f64(&key("attention.layer_norm_epsilon"))
        .map_err(|e| config_error(e.to_string()))?
        // Stored as F32 (as every GGUF epsilon): back to the f64 whose shortest decimal it is
        // (1e-6, not 9.99999997e-7), so a saved model reads back with its own config.
        .map_or(1e-6, |e| (e as f32).to_string().parse().unwrap_or(e));
    let config = VitConfig::new(
        number("image_size")?,
        number("patch_size")?,
        number("embedding_length")?,
        number("block_count")?,
        number("attention.head_count")?,
        number("feed_forward_length")?,
        number("class_count")?,
    )
    .with_in_channels(number("num_channels")?)
    .with_norm_eps(eps);
    config.check().map_err(config_error)?;
    let labels = match gguf
        .get_array(&key("class_labels"))
        .map_err(|e| config_error(e.to_string()))?
    {
        None => None,
        Some(values) => Some(
            values
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<String>>>()
                .filter(|l| l.len() == config.n_classes)
                .ok_or_else(|| {
                    config_error(format!(
                        "`{}` is not {} strings",
                        key("class_labels"),
                        config.n_classes
                    ))
                })?,
        ),
    };
    let model = config.build::<B, _>(device, |timm, shape, _| {
        let name = gguf_name(timm);
        let info = gguf.tensor(&name).ok_or_else(|| VitFileError::Missing {
            file: file.to_string(),
            name: name.clone(),
        })?;
        let want = shape.to_vec();
        if info.shape() != want {
            return Err(VitFileError::Shape {
                file: file.to_string(),
                name,
                got: info.shape(),
                want,
            });
        }
        tensor_to_f32(gguf, info).map_err(|e| VitFileError::Format {
            file: file.to_string(),
            message: e.to_string(),
        })
    })?;
    Ok(LoadedVit {
        config,
        model,
        labels,
    })
}

/// Read a ViT from a `.gguf` or a timm `.safetensors` file, chosen by the file's first bytes.
pub fn load_vit<B: ToyBackend>(
    path: &Path,
    device: &B::Device,
) -> Result<LoadedVit<B>, VitFileError> {
    let mut magic = [0u8; 4];
    let file = path.display().to_string();
    let read = std::fs::File::open(path).and_then(|mut f| {
        use std::io::Read;
        f.read(&mut magic)
    });
    match read {
        Err(source) => Err(VitFileError::Io { file, source }),
        Ok(4) if &magic == b"GGUF" => load_gguf(path, device),
        Ok(_) => super::timm::load_safetensors(path, device),
    }
}
