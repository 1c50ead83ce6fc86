//! LoRA adapter files: Hugging Face PEFT (`adapter_config.json` + `adapter_model.safetensors`)
//! and GGUF LoRA adapters (what llama.cpp's `convert_lora_to_gguf.py` writes and `--lora`
//! loads), and folding an adapter into a base GGUF (`toy merge`).
//!
//! Both formats hold `A: [r, in]` and `B: [out, r]` per adapted projection, F32:
//! - PEFT: `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` `[r, in]` and
//!   `…lora_B.weight` `[out, r]`, in the HF orientation: the rows of q's and k's `B` are in HF's
//!   half-split order, the inverse of the permutation the HF→GGUF converter applies to Q/K.
//!   phi3's fused projections are `self_attn.qkv_proj` and `mlp.gate_up_proj`; GPT-2's modules
//!   are `base_model.model.transformer.h.N.{attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj}`
//!   (`Conv1D`s: `fan_in_fan_out` in the config, the same `A`/`B` shapes).
//! - GGUF: `general.architecture` = the base's, `general.type = adapter`, `adapter.type = lora`,
//!   `adapter.lora.alpha`; tensors `blk.N.attn_q.weight.lora_a` with ggml dims `[in, r]` and
//!   `…lora_b` with dims `[r, out]` (the same row-major bytes as PEFT's `[r, in]` and
//!   `[out, r]`), in the GGUF orientation (Q/K rows permuted for interleaved RoPE, as the base's
//!   `attn_q`/`attn_k`; see [`QkLayout`]). llama.cpp adds `(alpha / r) · B·(A·x)` to the
//!   projection (`llm_graph_context::build_lora_mm`). A fused matrix has one adapter under its
//!   own name (`attn_qkv`; phi3's gate+up is `ffn_up`, which names `up` elsewhere: reading a
//!   GGUF adapter takes the base's config to tell them apart).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::backend::Backend;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use toy_core::gguf::{GgmlType, GgufFile, GgufWriter, Value, convert, tensor_to_f32};
use toy_models::host_tensors::safetensors_f32;
use toy_models::lora::{Adaptable, Target, permute_rows_to_gguf, permute_rows_to_hf};

use crate::TrainError;
use crate::checkpoint::write_atomic;

/// One adapted projection, on the host: `a` `[r, in]` and `b` `[out, r]` row-major, GGUF
/// orientation.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterTensor {
    /// Index of the block.
    pub layer: usize,
    /// The adapted projection.
    pub target: Target,
    /// Rank `r` of this pair.
    pub rank: usize,
    /// Input width of the projection.
    pub inp: usize,
    /// Output width of the projection.
    pub out: usize,
    /// `A`, `r × inp` row-major.
    pub a: Vec<f32>,
    /// `B`, `out × r` row-major.
    pub b: Vec<f32>,
}

/// A whole adapter on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    /// Scale numerator: each pair adds `(alpha / r)·B·A` to its projection.
    pub alpha: f32,
    /// The rank (the largest, where modules differ: each tensor holds its own).
    pub rank: usize,
    /// Dropout probability on the adapters' input in training (0 when read from a file).
    pub dropout: f32,
    /// Every adapted projection.
    pub tensors: Vec<AdapterTensor>,
}

/// A pair of adapter tensors being read: `A`, `B`, and `[rank, in, out]`.
type HalfRead = (Option<Vec<f32>>, Option<Vec<f32>>, [usize; 3]);

/// How the base's Q/K rows relate to Hugging Face's: its head counts, and whether the HF→GGUF
/// converter permuted them (it does for the architectures whose RoPE rotates interleaved pairs:
/// llama, granite, smollm3; half-split "neox" ones — qwen2/3, gemma2/3, phi3 — keep HF's rows).
#[derive(Debug, Clone, Copy)]
pub struct QkLayout {
    /// Query heads of the base.
    pub n_head: usize,
    /// Key/value heads of the base.
    pub n_head_kv: usize,
    /// Whether the converter permuted the Q/K rows (interleaved RoPE).
    pub permuted: bool,
}

impl QkLayout {
    /// The layout of a base of config `config`.
    pub fn of(config: &toy_core::config::ModelConfig) -> Self {
        QkLayout {
            n_head: config.n_head,
            n_head_kv: config.n_head_kv,
            permuted: config.rope_layout == toy_core::config::RopeLayout::Interleaved,
        }
    }
}

fn host<B: Backend>(t: burn::tensor::Tensor<B, 2>) -> Result<Vec<f32>, TrainError> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| TrainError::Backend(format!("cannot read an adapter back: {e:?}")))
}

impl Adapter {
    /// The adapters `model` carries (its blocks' `lora`).
    pub fn from_model<B: Backend>(
        model: &impl Adaptable<B>,
        alpha: f32,
        dropout: f32,
    ) -> Result<Self, TrainError> {
        let mut tensors = Vec::new();
        let mut rank = 0;
        for (layer, block) in model.lora_blocks().into_iter().enumerate() {
            let Some(lora) = block.lora() else { continue };
            for target in Target::ALL {
                let Some(l) = lora.get(target) else { continue };
                let [r, inp] = l.a.dims();
                let [out, _] = l.b.dims();
                rank = r;
                tensors.push(AdapterTensor {
                    layer,
                    target,
                    rank: r,
                    inp,
                    out,
                    a: host(l.a.val())?,
                    b: host(l.b.val())?,
                });
            }
        }
        Ok(Adapter {
            alpha,
            rank,
            dropout,
            tensors,
        })
    }

    fn targets(&self) -> Vec<Target> {
        let mut t: Vec<Target> = self.tensors.iter().map(|t| t.target).collect();
        t.sort();
        t.dedup();
        t
    }

    /// `B` in the HF orientation (q/k rows un-permuted where the converter permuted them).
    fn b_hf(&self, t: &AdapterTensor, layout: QkLayout) -> Vec<f32> {
        match t.target {
            Target::Q if layout.permuted => permute_rows_to_hf(&t.b, layout.n_head, t.rank),
            Target::K if layout.permuted => permute_rows_to_hf(&t.b, layout.n_head_kv, t.rank),
            _ => t.b.clone(),
        }
    }

    /// The GGUF LoRA adapter file of this adapter for a base of architecture `arch` (llama.cpp
    /// refuses an adapter whose `general.architecture` is not its model's).
    pub fn to_gguf(&self, name: &str, arch: &str) -> Result<GgufWriter<'static>, TrainError> {
        let mut w = GgufWriter::new();
        let set = |w: &mut GgufWriter<'static>, k: &str, v: Value| {
            w.set(k, v)
                .map_err(|e| TrainError::Config(format!("adapter metadata {k}: {e}")))
        };
        set(&mut w, "general.architecture", Value::String(arch.into()))?;
        set(&mut w, "general.type", Value::String("adapter".into()))?;
        set(&mut w, "general.name", Value::String(name.into()))?;
        set(&mut w, "adapter.type", Value::String("lora".into()))?;
        set(&mut w, "adapter.lora.alpha", Value::F32(self.alpha))?;
        for t in &self.tensors {
            let stem = format!("blk.{}.{}.weight", t.layer, t.target.gguf_name());
            let add = |w: &mut GgufWriter<'static>, suffix: &str, dims: [u64; 2], v: &[f32]| {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.add_tensor(format!("{stem}.{suffix}"), &dims, GgmlType::F32, bytes)
                    .map_err(|e| TrainError::Config(format!("adapter tensor {stem}: {e}")))
            };
            add(&mut w, "lora_a", [t.inp as u64, t.rank as u64], &t.a)?;
            add(&mut w, "lora_b", [t.rank as u64, t.out as u64], &t.b)?;
        }
        Ok(w)
    }

    /// PEFT's `adapter_config.json` for a base of architecture `arch`.
    pub fn peft_config(&self, base_name: &str, arch: &str) -> serde_json::Value {
        let gpt2 = arch == "gpt2";
        let modules: Vec<String> = self
            .targets()
            .iter()
            .map(|&t| match t.gpt2_module() {
                // GPT-2's attention and MLP both have a `c_proj`: the path tells them apart.
                Some(m) if gpt2 => m.to_string(),
                _ => t.hf_module().rsplit('.').next().unwrap_or("").to_string(),
            })
            .collect();
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_name,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": modules,
            "bias": "none",
            "fan_in_fan_out": gpt2,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "use_rslora": false,
            "use_dora": false,
            "revision": null,
        })
    }

    /// PEFT's `adapter_model.safetensors` (F32, HF orientation, `{"format": "pt"}` metadata
    /// as torch writes).
    pub fn peft_safetensors(&self, layout: QkLayout, arch: &str) -> Result<Vec<u8>, TrainError> {
        let mut entries: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        for t in &self.tensors {
            let stem = peft_stem(arch, t.layer, t.target)?;
            entries.push((
                format!("{stem}.lora_A.weight"),
                vec![t.rank, t.inp],
                bytes(&t.a),
            ));
            entries.push((
                format!("{stem}.lora_B.weight"),
                vec![t.out, t.rank],
                bytes(&self.b_hf(t, layout)),
            ));
        }
        let views = entries
            .iter()
            .map(|(name, shape, data)| {
                Ok((name, TensorView::new(Dtype::F32, shape.clone(), data)?))
            })
            .collect::<Result<Vec<_>, SafeTensorError>>()
            .map_err(safetensors_error)?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(views, Some(metadata)).map_err(safetensors_error)
    }

    /// Write `adapter_config.json`, `adapter_model.safetensors` and `adapter.gguf` (for a base
    /// of architecture `arch`) into `dir`, each atomically. Returns the bytes written.
    pub fn write_all(
        &self,
        dir: &Path,
        layout: QkLayout,
        arch: &str,
        base_name: &str,
        name: &str,
    ) -> Result<u64, TrainError> {
        let config = serde_json::to_vec_pretty(&self.peft_config(base_name, arch))
            .expect("adapter config serializes");
        write_atomic(&dir.join("adapter_config.json"), &config)?;
        let st = self.peft_safetensors(layout, arch)?;
        write_atomic(&dir.join("adapter_model.safetensors"), &st)?;
        let gguf = self
            .to_gguf(name, arch)?
            .write_atomic(dir.join("adapter.gguf"))
            .map_err(|e| TrainError::Config(format!("cannot write adapter.gguf: {e}")))?;
        Ok(config.len() as u64 + st.len() as u64 + gguf)
    }

    /// Read a GGUF LoRA adapter for a base of config `base` (whose `ffn_up` may be phi3's
    /// fused gate+up).
    pub fn read_gguf(
        file: &GgufFile,
        base: &toy_core::config::ModelConfig,
    ) -> Result<Self, TrainError> {
        let bad = |what: String| TrainError::Config(what);
        if file.get_str("general.type").ok().flatten() != Some("adapter")
            || file.get_str("adapter.type").ok().flatten() != Some("lora")
        {
            return Err(bad(
                "not a GGUF LoRA adapter (general.type = adapter, adapter.type = lora)".into(),
            ));
        }
        let alpha = file
            .get_f64("adapter.lora.alpha")
            .ok()
            .flatten()
            .ok_or_else(|| bad("the adapter has no adapter.lora.alpha".into()))?
            as f32;
        // (layer, target) -> (A, B, [rank, in, out]) as the tensors come.
        let mut pairs: BTreeMap<(usize, Target), HalfRead> = BTreeMap::new();
        for info in &file.tensors {
            let name = &info.name;
            let (stem, is_a) = if let Some(s) = name.strip_suffix(".weight.lora_a") {
                (s, true)
            } else if let Some(s) = name.strip_suffix(".weight.lora_b") {
                (s, false)
            } else {
                continue;
            };
            let parsed = stem.strip_prefix("blk.").and_then(|rest| {
                let (n, t) = rest.split_once('.')?;
                let target = match Target::ALL.into_iter().find(|x| x.gguf_name() == t)? {
                    Target::Up if base.fused_gate_up => Target::GateUp,
                    target => target,
                };
                Some((n.parse::<usize>().ok()?, target))
            });
            let Some(key) = parsed else {
                return Err(bad(format!(
                    "adapter tensor {name}: only blk.N.{{attn_q,attn_k,attn_v,attn_qkv,attn_output,ffn_gate,ffn_up,ffn_down}} are supported"
                )));
            };
            if info.dims.len() != 2 {
                return Err(bad(format!("adapter tensor {name} is not a matrix")));
            }
            let values = tensor_to_f32(file, info)
                .map_err(|e| bad(format!("adapter tensor {name}: {e}")))?;
            let entry = pairs.entry(key).or_insert((None, None, [0; 3]));
            let (d0, d1) = (info.dims[0] as usize, info.dims[1] as usize);
            if is_a {
                entry.0 = Some(values);
                entry.2[0] = d1; // rank
                entry.2[1] = d0; // in
            } else {
                entry.1 = Some(values);
                entry.2[2] = d1; // out
                if entry.2[0] != 0 && entry.2[0] != d0 {
                    return Err(bad(format!(
                        "adapter tensor {name}: rank differs from lora_a"
                    )));
                }
            }
        }
        let mut tensors = Vec::new();
        let mut rank = 0;
        for ((layer, target), (a, b, [r, inp, out])) in pairs {
            let (Some(a), Some(b)) = (a, b) else {
                return Err(bad(format!(
                    "adapter blk.{layer}.{} lacks lora_a or lora_b",
                    target.gguf_name()
                )));
            };
            if b.len() != out * r {
                return Err(bad(format!(
                    "adapter blk.{layer}.{}: lora_b does not match lora_a's rank",
                    target.gguf_name()
                )));
            }
            rank = rank.max(r);
            tensors.push(AdapterTensor {
                layer,
                target,
                rank: r,
                inp,
                out,
                a,
                b,
            });
        }
        if tensors.is_empty() {
            return Err(bad("the adapter holds no lora_a/lora_b tensors".into()));
        }
        Ok(Adapter {
            alpha,
            rank,
            dropout: 0.0,
            tensors,
        })
    }

    /// Read a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
    /// bringing q/k rows into the GGUF orientation of a base of `layout`.
    pub fn read_peft(dir: &Path, layout: QkLayout) -> Result<Self, TrainError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|source| TrainError::Io {
                what: format!("cannot read {}", p.display()),
                source,
            })
        };
        let config: serde_json::Value = serde_json::from_slice(&read("adapter_config.json")?)
            .map_err(|e| TrainError::Config(format!("adapter_config.json: {e}")))?;
        if config["peft_type"] != "LORA" {
            return Err(TrainError::Config(
                "adapter_config.json: only peft_type LORA is supported".into(),
            ));
        }
        if config["use_rslora"] == true || config["use_dora"] == true {
            return Err(TrainError::Config(
                "adapter_config.json: rsLoRA and DoRA adapters are not supported".into(),
            ));
        }
        let alpha = config["lora_alpha"]
            .as_f64()
            .ok_or_else(|| TrainError::Config("adapter_config.json: no lora_alpha".into()))?
            as f32;
        // Per-module ranks (`rank_pattern`) are read from the tensors' shapes; a per-module alpha
        // would need a scale per module that neither toy's nor llama.cpp's GGUF adapter holds.
        if config["alpha_pattern"]
            .as_object()
            .is_some_and(|m| !m.is_empty())
        {
            return Err(TrainError::Config(
                "adapter_config.json: per-module lora_alpha (alpha_pattern) is not supported"
                    .into(),
            ));
        }
        let tensors = read_safetensors(&read("adapter_model.safetensors")?)?;
        let bad = |msg: String| TrainError::Config(format!("adapter_model.safetensors: {msg}"));
        let matrix = |name: &str, shape: &[usize]| match *shape {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(bad(format!("{name} has shape {shape:?}, not a matrix"))),
        };
        let mut out = Vec::new();
        let mut rank = 0;
        for (name, (shape, a)) in &tensors {
            let Some(stem) = name.strip_suffix(".lora_A.weight") else {
                continue;
            };
            let llama = |rest: &str| {
                let (n, module) = rest.split_once('.')?;
                let target = Target::ALL.into_iter().find(|t| t.hf_module() == module)?;
                Some((n.parse::<usize>().ok()?, target))
            };
            let gpt2 = |rest: &str| {
                let (n, module) = rest.split_once('.')?;
                let target = Target::ALL
                    .into_iter()
                    .find(|t| t.gpt2_module() == Some(module))?;
                Some((n.parse::<usize>().ok()?, target))
            };
            let parsed = stem
                .strip_prefix("base_model.model.model.layers.")
                .and_then(llama)
                .or_else(|| {
                    stem.strip_prefix("base_model.model.transformer.h.")
                        .and_then(gpt2)
                })
                .ok_or_else(|| TrainError::Config(format!("unsupported PEFT tensor {name}")))?;
            let (bshape, b) = tensors
                .get(&format!("{stem}.lora_B.weight"))
                .ok_or_else(|| {
                    TrainError::Config(format!("PEFT adapter lacks {stem}.lora_B.weight"))
                })?;
            let (r, inp) = matrix(name, shape)?;
            let (o, b_rank) = matrix(&format!("{stem}.lora_B.weight"), bshape)?;
            if r == 0 || b_rank != r {
                return Err(bad(format!(
                    "{stem}: lora_A has rank {r}, lora_B {b_rank} (they must agree, and not be 0)"
                )));
            }
            let heads = match parsed.1 {
                Target::Q if layout.permuted => Some(layout.n_head),
                Target::K if layout.permuted => Some(layout.n_head_kv),
                _ => None,
            };
            let b = match heads {
                Some(n_head) if n_head == 0 || o % (2 * n_head) != 0 => {
                    return Err(bad(format!(
                        "{stem}.lora_B.weight has {o} rows, not whole heads of the base's {n_head}: wrong base model?"
                    )));
                }
                Some(n_head) => permute_rows_to_gguf(b, n_head, r),
                None => b.clone(),
            };
            rank = rank.max(r);
            out.push(AdapterTensor {
                layer: parsed.0,
                target: parsed.1,
                rank: r,
                inp,
                out: o,
                a: a.clone(),
                b,
            });
        }
        out.sort_by_key(|t| (t.layer, t.target));
        Ok(Adapter {
            alpha,
            rank,
            dropout: 0.0,
            tensors: out,
        })
    }
}

/// The PEFT module path of `target` in block `layer` of a base of architecture `arch`.
fn peft_stem(arch: &str, layer: usize, target: Target) -> Result<String, TrainError> {
    if arch == "gpt2" {
        let module = target.gpt2_module().ok_or_else(|| {
            TrainError::Config(format!("gpt2 has no {} projection", target.name()))
        })?;
        return Ok(format!("base_model.model.transformer.h.{layer}.{module}"));
    }
    Ok(format!(
        "base_model.model.model.layers.{layer}.{}",
        target.hf_module()
    ))
}

type HostTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn safetensors_error(e: SafeTensorError) -> TrainError {
    TrainError::Config(format!("adapter_model.safetensors: {e}"))
}

/// The F32/F16/BF16 tensors of a safetensors file, as f32.
fn read_safetensors(bytes: &[u8]) -> Result<HostTensors, TrainError> {
    let file = SafeTensors::deserialize(bytes).map_err(safetensors_error)?;
    let mut out = BTreeMap::new();
    for (name, view) in file.tensors() {
        let values = safetensors_f32(&view).map_err(|other| {
            TrainError::Config(format!(
                "adapter_model.safetensors: {name} is {other:?}; only F32, F16 and BF16 are supported"
            ))
        })?;
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// The base GGUF with every adapted weight replaced by `W + (alpha/r)·B·A` (computed in f32 on
/// the host), its tensors stored as `ty` by [`toy_core::gguf::convert`] (matrices as `ty`, norms
/// F32, as `toy convert` does). Other metadata is copied.
pub fn merge(
    base: &GgufFile,
    adapter: &Adapter,
    ty: GgmlType,
) -> Result<GgufWriter<'static>, TrainError> {
    let mut by_name: BTreeMap<String, &AdapterTensor> = BTreeMap::new();
    for t in &adapter.tensors {
        by_name.insert(
            format!("blk.{}.{}.weight", t.layer, t.target.gguf_name()),
            t,
        );
    }
    let w = convert(base, ty, |info, values| {
        if let Some(t) = by_name.remove(&info.name) {
            if info.dims != [t.inp as u64, t.out as u64] {
                return Err(TrainError::Config(format!(
                    "adapter for {} is [{}, {}] (in, out), the base tensor has dims {:?}: wrong base model?",
                    info.name, t.inp, t.out, info.dims
                )));
            }
            // Each matrix's own rank, as llama.cpp scales (`build_lora_mm`: alpha / b->ne[0]):
            // PEFT's rank_pattern gives modules different ranks.
            let scale = adapter.alpha / t.rank.max(1) as f32;
            add_scaled_product(values, &t.b, &t.a, t.out, t.rank, t.inp, scale);
        }
        Ok(())
    })?;
    if let Some(name) = by_name.keys().next() {
        return Err(TrainError::Config(format!(
            "the adapter has {name}, which the base model lacks: wrong base model?"
        )));
    }
    Ok(w)
}

/// `w[out, inp] += scale · b[out, r] · a[r, inp]` (f32, row-major).
fn add_scaled_product(
    w: &mut [f32],
    b: &[f32],
    a: &[f32],
    out: usize,
    r: usize,
    inp: usize,
    scale: f32,
) {
    for o in 0..out {
        let row = &mut w[o * inp..(o + 1) * inp];
        let mut acc = vec![0f32; inp];
        for k in 0..r {
            let bk = b[o * r + k];
            for (x, &ak) in acc.iter_mut().zip(&a[k * inp..(k + 1) * inp]) {
                *x += bk * ak;
            }
        }
        for (x, d) in row.iter_mut().zip(acc) {
            *x += scale * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_product_adds_b_times_a() {
        let mut w = vec![1.0; 4]; // [2, 2]
        let b = vec![1.0, 2.0]; // [2, 1]
        let a = vec![3.0, 4.0]; // [1, 2]
        add_scaled_product(&mut w, &b, &a, 2, 1, 2, 0.5);
        assert_eq!(w, vec![2.5, 3.0, 4.0, 5.0]);
    }

    /// A PEFT directory of zero-filled F32 tensors `(name, shape)` with `extra` in its config.
    fn peft_dir(
        tag: &str,
        extra: serde_json::Value,
        tensors: &[(&str, &[usize])],
    ) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("toy-peft-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = serde_json::json!({"peft_type": "LORA", "lora_alpha": 16, "r": 2});
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, shape)| vec![0u8; 4 * shape.iter().product::<usize>()])
            .collect();
        let views = tensors.iter().zip(&data).map(|((name, shape), bytes)| {
            (
                *name,
                TensorView::new(Dtype::F32, shape.to_vec(), bytes).unwrap(),
            )
        });
        let file = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), file).unwrap();
        dir
    }

    /// Hostile PEFT adapters (what `toy merge` reads from a user's directory) are one-line
    /// errors, not index panics: a vector where a matrix belongs, ranks that disagree or are 0,
    /// q rows that are not whole heads, a per-module alpha.
    #[test]
    fn malformed_peft_adapters_are_errors_not_panics() {
        const Q: &str = "base_model.model.model.layers.0.self_attn.q_proj";
        const V: &str = "base_model.model.model.layers.0.self_attn.v_proj";
        let layout = QkLayout {
            n_head: 2,
            n_head_kv: 1,
            permuted: true,
        };
        let (qa, qb) = (format!("{Q}.lora_A.weight"), format!("{Q}.lora_B.weight"));
        let (va, vb) = (format!("{V}.lora_A.weight"), format!("{V}.lora_B.weight"));
        let none = serde_json::json!({});
        let cases: [(&str, serde_json::Value, Vec<(&str, &[usize])>, &str); 6] = [
            (
                "vector",
                none.clone(),
                vec![(&qa, &[8]), (&qb, &[8, 2])],
                "not a matrix",
            ),
            (
                "scalar-b",
                none.clone(),
                vec![(&qa, &[2, 8]), (&qb, &[])],
                "not a matrix",
            ),
            (
                "ranks",
                none.clone(),
                vec![(&qa, &[2, 8]), (&qb, &[8, 3])],
                "must agree",
            ),
            (
                "rank0",
                none.clone(),
                vec![(&qa, &[0, 8]), (&qb, &[8, 0])],
                "not be 0",
            ),
            (
                "heads",
                none.clone(),
                vec![(&qa, &[2, 8]), (&qb, &[6, 2])],
                "whole heads",
            ),
            (
                "alpha",
                serde_json::json!({"alpha_pattern": {"q_proj": 8}}),
                vec![(&qa, &[2, 8]), (&qb, &[8, 2])],
                "alpha_pattern",
            ),
        ];
        for (tag, extra, tensors, expect) in cases {
            let dir = peft_dir(tag, extra, &tensors);
            let err = Adapter::read_peft(&dir, layout).unwrap_err().to_string();
            assert!(err.contains(expect), "{tag}: {err}");
            std::fs::remove_dir_all(dir).unwrap();
        }
        // Modules of different ranks (PEFT's rank_pattern) read, each with its own rank.
        let dir = peft_dir(
            "rank-pattern",
            serde_json::json!({"rank_pattern": {"v_proj": 4}}),
            &[
                (&qa, &[2, 8]),
                (&qb, &[8, 2]),
                (&va, &[4, 8]),
                (&vb, &[4, 4]),
            ],
        );
        let adapter = Adapter::read_peft(&dir, layout).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
        let ranks: Vec<usize> = adapter.tensors.iter().map(|t| t.rank).collect();
        assert_eq!((ranks, adapter.rank), (vec![2, 4], 4));
    }
}
