//! LoRA adapters: `y = W·x + (alpha/r) · B·A·dropout(x)` on a model's projections, with
//! `A: [r, in]` and `B: [out, r]` (PEFT's shapes). The llama family takes them on q, k, v, o,
//! gate, up and down, or — where the file stores them fused, as phi3 does — on the fused
//! `qkv` and `gate_up` matrices; GPT-2 on `qkv` (`c_attn`), o, up and down. A fused adapter is
//! one `A` and one `B` over the whole fused output, as llama.cpp and PEFT see that matrix; the
//! model, which keeps the parts apart, adds each part its rows of `B·A·x`.
//!
//! A block carries its adapters in its `lora` field ([`LoraBlock`]); without them (`None`, what
//! loading and `init` give) the model runs exactly the code it runs without this module. The
//! base weights are not touched: training freezes them (see `toy_train`), so only `A` and `B`
//! get gradients.
//!
//! The model computes in the GGUF `llama` orientation, where the HF→GGUF converter permuted the
//! rows of Q and K for interleaved RoPE; `B` of q and k therefore has its rows in that order too
//! (which is what a GGUF LoRA adapter holds). [`permute_rows_to_hf`] gives the HF order that a
//! PEFT file needs.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use toy_core::rng::SplitMix64;
use toy_kernels::ToyBackend;

use crate::qlinear::{QLinear, dense_linear};

/// A projection an adapter can sit on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// The query projection.
    Q,
    /// The key projection.
    K,
    /// The value projection.
    V,
    /// The attention output projection.
    O,
    /// The MLP gate projection.
    Gate,
    /// The MLP up projection.
    Up,
    /// The MLP down projection.
    Down,
    /// Q, K and V stored as one matrix (phi3's `attn_qkv`, GPT-2's `c_attn`).
    Qkv,
    /// Gate and up stored as one matrix (phi3's `ffn_up`).
    GateUp,
}

impl Target {
    /// Every target, separate and fused, in declaration order.
    pub const ALL: [Target; 9] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
        Target::Qkv,
        Target::GateUp,
    ];

    /// The targets of a model that stores every projection apart (llama, qwen2, gemma, ...).
    pub const SEPARATE: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The short name used on the command line (`q`, `gate`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q",
            Target::K => "k",
            Target::V => "v",
            Target::O => "o",
            Target::Gate => "gate",
            Target::Up => "up",
            Target::Down => "down",
            Target::Qkv => "qkv",
            Target::GateUp => "gate_up",
        }
    }

    /// The target of a short name (`Target::name`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The Hugging Face module path inside a llama-family decoder layer (`self_attn.q_proj`,
    /// `mlp.up_proj`; phi3's fused `self_attn.qkv_proj`, `mlp.gate_up_proj`).
    pub fn hf_module(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
            Target::Qkv => "self_attn.qkv_proj",
            Target::GateUp => "mlp.gate_up_proj",
        }
    }

    /// The module path inside a GPT-2 block (`transformer.h.N.`), `None` for a target GPT-2
    /// does not have. Its `c_attn`, `c_fc` and `c_proj` are `Conv1D`s (PEFT: `fan_in_fan_out`),
    /// but `lora_A`/`lora_B` have the same `[r, in]`/`[out, r]` shapes as on a `Linear`.
    pub fn gpt2_module(self) -> Option<&'static str> {
        match self {
            Target::Qkv => Some("attn.c_attn"),
            Target::O => Some("attn.c_proj"),
            Target::Up => Some("mlp.c_fc"),
            Target::Down => Some("mlp.c_proj"),
            _ => None,
        }
    }

    /// The GGUF tensor name stem inside `blk.N.` (`attn_q`, `ffn_up`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
            Target::Qkv => "attn_qkv",
            // phi3 names its fused gate+up matrix as others name up.
            Target::GateUp => "ffn_up",
        }
    }
}

/// One adapter: `delta(x) = scale · (dropout(x) · Aᵀ) · Bᵀ`.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    /// `[r, in]`.
    pub a: Param<Tensor<B, 2>>,
    /// `[out, r]`, zero at the start of training (so the adapted model starts as the base).
    pub b: Param<Tensor<B, 2>>,
    /// `alpha / r`.
    #[module(skip)]
    pub scale: f32,
    /// Probability of zeroing an input element during training (under autodiff only).
    #[module(skip)]
    pub dropout: f32,
    /// Seed of the current dropout mask: the trainer sets it before each micro-batch
    /// ([`set_dropout_seed`]), so a run's masks are a function of its seed and step.
    #[module(skip)]
    pub dropout_seed: u64,
}

impl<B: ToyBackend> Lora<B> {
    /// The adapter's contribution for `x[.., in]`: `[.., out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let k = dims[D - 1];
        let mut x2: Tensor<B, 2> = x.reshape([-1, k as i32]);
        let device = x2.device();
        if self.dropout > 0.0 && B::ad_enabled(&device) {
            let n = x2.dims()[0] * k;
            let keep = 1.0 / (1.0 - self.dropout);
            let mut rng = SplitMix64::new(self.dropout_seed);
            let mask: Vec<f32> = (0..n)
                .map(|_| {
                    let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                    if u < self.dropout { 0.0 } else { keep }
                })
                .collect();
            let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, x2.dims()), &device);
            x2 = x2 * mask;
        }
        let y = dense_linear(dense_linear(x2, self.a.val()), self.b.val()).mul_scalar(self.scale);
        let mut out = dims;
        out[D - 1] = y.dims()[1];
        y.reshape(out)
    }

    /// `scale · B·A` `[out, in]`: what merging adds to the base weight.
    pub fn delta_weight(&self) -> Tensor<B, 2> {
        self.b.val().matmul(self.a.val()).mul_scalar(self.scale)
    }
}

/// `w·x`, plus the adapter's contribution when there is one. Without an adapter this is exactly
/// `w.forward(x)`.
pub fn project<B: ToyBackend, const D: usize>(
    w: &QLinear<B>,
    lora: Option<&Lora<B>>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    project_with(w, lora, None, x)
}

/// `y`, a projection's base product for `x`, plus the adapter `lora`'s contribution, then plus
/// `delta` (a fused adapter's rows for this part): the one place these sums are made, in this
/// order.
fn with_adapter<B: ToyBackend, const D: usize>(
    y: Tensor<B, D>,
    lora: Option<&Lora<B>>,
    delta: Option<Tensor<B, D>>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    let y = match lora {
        Some(l) => y + l.forward(x),
        None => y,
    };
    match delta {
        Some(d) => y + d,
        None => y,
    }
}

/// The adapters of one block (any subset of the seven projections).
#[derive(Module, Debug)]
pub struct BlockLora<B: Backend> {
    /// Adapter on the query projection.
    pub q: Option<Lora<B>>,
    /// Adapter on the key projection.
    pub k: Option<Lora<B>>,
    /// Adapter on the value projection.
    pub v: Option<Lora<B>>,
    /// Adapter on the attention output projection.
    pub o: Option<Lora<B>>,
    /// Adapter on the MLP gate projection.
    pub gate: Option<Lora<B>>,
    /// Adapter on the MLP up projection.
    pub up: Option<Lora<B>>,
    /// Adapter on the MLP down projection.
    pub down: Option<Lora<B>>,
    /// Adapter on the fused Q|K|V matrix.
    pub qkv: Option<Lora<B>>,
    /// Adapter on the fused gate|up matrix.
    pub gate_up: Option<Lora<B>>,
}

impl<B: Backend> BlockLora<B> {
    /// No adapter on any projection.
    pub fn empty() -> Self {
        BlockLora {
            q: None,
            k: None,
            v: None,
            o: None,
            gate: None,
            up: None,
            down: None,
            qkv: None,
            gate_up: None,
        }
    }

    /// The adapter on `t`, if there is one.
    pub fn get(&self, t: Target) -> Option<&Lora<B>> {
        match t {
            Target::Q => self.q.as_ref(),
            Target::K => self.k.as_ref(),
            Target::V => self.v.as_ref(),
            Target::O => self.o.as_ref(),
            Target::Gate => self.gate.as_ref(),
            Target::Up => self.up.as_ref(),
            Target::Down => self.down.as_ref(),
            Target::Qkv => self.qkv.as_ref(),
            Target::GateUp => self.gate_up.as_ref(),
        }
    }

    /// The slot of `t`'s adapter, to set or change it.
    pub fn slot(&mut self, t: Target) -> &mut Option<Lora<B>> {
        match t {
            Target::Q => &mut self.q,
            Target::K => &mut self.k,
            Target::V => &mut self.v,
            Target::O => &mut self.o,
            Target::Gate => &mut self.gate,
            Target::Up => &mut self.up,
            Target::Down => &mut self.down,
            Target::Qkv => &mut self.qkv,
            Target::GateUp => &mut self.gate_up,
        }
    }
}

/// Every block's adapters, apart from the model: what a LoRA checkpoint records.
#[derive(Module, Debug)]
pub struct LoraAdapters<B: Backend> {
    /// One entry per block of the model, in order.
    pub blocks: Vec<BlockLora<B>>,
}

/// The shape of a set of adapters.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank `r` of each adapter.
    pub rank: usize,
    /// Scaling numerator: adapters scale their output by `alpha / rank`.
    pub alpha: f32,
    /// Dropout probability on each adapter's input during training.
    pub dropout: f32,
    /// The projections that get an adapter.
    pub targets: Vec<Target>,
}

/// Why a model cannot take the adapters asked for.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// An MLP target on a mixture-of-experts model (not supported).
    #[error(
        "LoRA on the MLP of a mixture-of-experts model is not supported: target the attention (q,k,v,o)"
    )]
    Moe,
    /// The spec's rank is 0.
    #[error("LoRA rank must be positive")]
    ZeroRank,
    /// The adapters' block count differs from the model's.
    #[error("the adapters have {found} blocks, the model {expected}")]
    Blocks {
        /// The model's block count.
        expected: usize,
        /// The adapters' block count.
        found: usize,
    },
    /// The model family has no matrix for the target.
    #[error("{family} has no {target} matrix to adapt: its LoRA targets are {targets}")]
    NoMatrix {
        /// The model family (`gpt2`).
        family: &'static str,
        /// The target's short name.
        target: &'static str,
        /// The targets the family does have, comma-separated.
        targets: &'static str,
    },
}

/// A block whose projections can carry adapters (the llama family's and GPT-2's).
pub trait LoraBlock<B: Backend> {
    /// The matrices an adapter on `t` adds to, in the order of their rows in the adapter's
    /// output: one, or the parts of a fused matrix (Q, K, V; gate, up).
    fn adapted(&self, t: Target) -> Result<Vec<&QLinear<B>>, LoraError>;
    /// The same, to replace them (merging).
    fn adapted_mut(&mut self, t: Target) -> Result<Vec<&mut QLinear<B>>, LoraError>;
    /// The block's adapters, if it has any.
    fn lora(&self) -> Option<&BlockLora<B>>;
    /// The block's adapter slot, to install or take them.
    fn lora_mut(&mut self) -> &mut Option<BlockLora<B>>;
}

/// A model made of [`LoraBlock`]s.
pub trait Adaptable<B: Backend> {
    /// The model's blocks, first to last.
    fn lora_blocks(&self) -> Vec<&dyn LoraBlock<B>>;
    /// The model's blocks, first to last, to change their adapters.
    fn lora_blocks_mut(&mut self) -> Vec<&mut dyn LoraBlock<B>>;
    /// The device new adapters are created on (the model's).
    fn lora_device(&self) -> B::Device;
}

/// `[out, in]` of what an adapter on `t` adapts in `block` (a fused target's parts stacked).
pub fn target_dims<B: Backend>(
    block: &dyn LoraBlock<B>,
    t: Target,
) -> Result<[usize; 2], LoraError> {
    let parts = block.adapted(t)?;
    let inp = parts.first().ok_or(LoraError::Moe)?.dims()[1];
    Ok([parts.iter().map(|w| w.dims()[0]).sum(), inp])
}

/// `w·x` plus `delta` (a fused adapter's rows for this part), or plus the adapter `lora`'s
/// contribution. Without either this is exactly `w.forward(x)`.
pub fn project_with<B: ToyBackend, const D: usize>(
    w: &QLinear<B>,
    lora: Option<&Lora<B>>,
    delta: Option<Tensor<B, D>>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    with_adapter(w.forward(x.clone()), lora, delta, x)
}

/// [`project_with`] for several projections of the same `x` (a block's Q, K and V, or its gate
/// and up): their base products computed together ([`QLinear::forward_each`]), each plus its
/// own `delta` or adapter.
pub fn project_each<B: ToyBackend, const D: usize, const N: usize>(
    ws: [&QLinear<B>; N],
    loras: [Option<&Lora<B>>; N],
    deltas: [Option<Tensor<B, D>>; N],
    x: Tensor<B, D>,
) -> [Tensor<B, D>; N] {
    let mut parts = loras.into_iter().zip(deltas);
    QLinear::forward_each(ws, x.clone()).map(|y| {
        let (lora, delta) = parts.next().expect("one adapter slot per projection");
        with_adapter(y, lora, delta, x.clone())
    })
}

/// A fused adapter's contribution for `x`, cut into its `N` parts' rows (`outs`): `None` for
/// each part when there is no adapter.
pub fn fused_deltas<B: ToyBackend, const D: usize, const N: usize>(
    lora: Option<&Lora<B>>,
    x: &Tensor<B, D>,
    outs: [usize; N],
) -> [Option<Tensor<B, D>>; N] {
    let Some(l) = lora else {
        return std::array::from_fn(|_| None);
    };
    let delta = l.forward(x.clone());
    let mut start = 0;
    outs.map(|n| {
        let part = delta.clone().narrow(D - 1, start, n);
        start += n;
        Some(part)
    })
}

/// Fresh adapters for `model`: `A` from `draw_a(layer, target, [r, in])` (row-major values),
/// `B` zero.
pub fn new_adapters<B: Backend, M: Adaptable<B>>(
    model: &M,
    spec: &LoraSpec,
    mut draw_a: impl FnMut(usize, Target, [usize; 2]) -> Vec<f32>,
) -> Result<LoraAdapters<B>, LoraError> {
    if spec.rank == 0 {
        return Err(LoraError::ZeroRank);
    }
    let device = model.lora_device();
    let scale = spec.alpha / spec.rank as f32;
    let mut blocks = Vec::new();
    for (layer, model_block) in model.lora_blocks().iter().enumerate() {
        let mut block = BlockLora::empty();
        for &t in &spec.targets {
            let [out, inp] = target_dims(*model_block, t)?;
            let a = draw_a(layer, t, [spec.rank, inp]);
            *block.slot(t) = Some(Lora {
                a: Param::from_tensor(Tensor::from_data(
                    TensorData::new(a, [spec.rank, inp]),
                    &device,
                )),
                b: Param::from_tensor(Tensor::zeros([out, spec.rank], &device)),
                scale,
                dropout: spec.dropout,
                dropout_seed: 0,
            });
        }
        blocks.push(block);
    }
    Ok(LoraAdapters { blocks })
}

/// Put `adapters` into `model` (replacing any it had).
pub fn install<B: Backend, M: Adaptable<B>>(
    mut model: M,
    adapters: LoraAdapters<B>,
) -> Result<M, LoraError> {
    let expected = model.lora_blocks().len();
    if adapters.blocks.len() != expected {
        return Err(LoraError::Blocks {
            expected,
            found: adapters.blocks.len(),
        });
    }
    for (block, lora) in model.lora_blocks_mut().into_iter().zip(adapters.blocks) {
        *block.lora_mut() = Some(lora);
    }
    Ok(model)
}

/// A copy of the adapters of `model` (blocks without adapters give empty ones).
pub fn adapters<B: Backend, M: Adaptable<B>>(model: &M) -> LoraAdapters<B> {
    LoraAdapters {
        blocks: model
            .lora_blocks()
            .iter()
            .map(|b| b.lora().cloned().unwrap_or_else(BlockLora::empty))
            .collect(),
    }
}

/// Set the dropout seed of every adapter from `seed` (each adapter its own stream).
pub fn set_dropout_seed<B: Backend, M: Adaptable<B>>(model: &mut M, seed: u64) {
    for (layer, block) in model.lora_blocks_mut().into_iter().enumerate() {
        if let Some(lora) = block.lora_mut() {
            for t in Target::ALL {
                if let Some(l) = lora.slot(t) {
                    let stream =
                        ((layer as u64) << 8 | t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    l.dropout_seed = SplitMix64::new(seed ^ stream).next_u64();
                }
            }
        }
    }
}

/// Whether any adapter of `model` uses dropout.
pub fn has_dropout<B: Backend, M: Adaptable<B>>(model: &M) -> bool {
    model.lora_blocks().iter().any(|b| {
        b.lora().is_some_and(|l| {
            Target::ALL
                .iter()
                .any(|&t| l.get(t).is_some_and(|a| a.dropout > 0.0))
        })
    })
}

/// Move every adapter's dropout seed to its `k`-th next stream (micro-batch `k` of a step).
pub fn advance_dropout<B: Backend, M: Adaptable<B>>(model: &mut M, k: u64) {
    for block in model.lora_blocks_mut() {
        if let Some(lora) = block.lora_mut() {
            for t in Target::ALL {
                if let Some(l) = lora.slot(t) {
                    let s = l.dropout_seed ^ k.wrapping_mul(0xA24B_AED4_963E_E407);
                    l.dropout_seed = SplitMix64::new(s).next_u64();
                }
            }
        }
    }
}

/// Fold every adapter into its base weight (`W + scale·B·A`, a fused adapter's rows to each
/// part) and drop the adapters. The base projections must be float (`QLinear::Dense`);
/// quantized ones are left as they are and reported as an error by the caller's saver.
pub fn merge<B: ToyBackend, M: Adaptable<B>>(mut model: M) -> M {
    for block in model.lora_blocks_mut() {
        let Some(lora) = block.lora_mut().take() else {
            continue;
        };
        for t in Target::ALL {
            let Some(l) = lora.get(t) else { continue };
            let Ok(parts) = block.adapted_mut(t) else {
                continue;
            };
            let delta = l.delta_weight();
            let mut start = 0;
            for w in parts {
                let out = w.dims()[0];
                if let QLinear::Dense(p) = w {
                    let part = delta.clone().narrow(0, start, out);
                    *w = QLinear::Dense(Param::from_tensor(p.val() + part));
                }
                start += out;
            }
        }
    }
    model
}

/// Rows of a `[n_head·head_dim, cols]` matrix from the GGUF `llama` order (interleaved RoPE
/// pairs) back to the HF order (half-split): the inverse of the HF→GGUF converter's `permute`.
/// `gguf[h, j, i] = hf[h, i, j]` for `i ∈ {0, 1}`, `j < head_dim/2`.
pub fn permute_rows_to_hf(values: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    permute_rows(values, n_head, cols, true)
}

/// The HF→GGUF converter's row permutation of Q/K (and of their LoRA `B`).
pub fn permute_rows_to_gguf(values: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    permute_rows(values, n_head, cols, false)
}

fn permute_rows(values: &[f32], n_head: usize, cols: usize, to_hf: bool) -> Vec<f32> {
    let rows = values.len() / cols;
    let half = rows / n_head / 2;
    let mut out = vec![0.0; values.len()];
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..half {
                let hf = h * 2 * half + i * half + j;
                let gguf = h * 2 * half + j * 2 + i;
                let (src, dst) = if to_hf { (gguf, hf) } else { (hf, gguf) };
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_permutations_are_inverse_and_match_the_converter() {
        // 2 heads of width 4, 1 column: HF rows [h0: a0 a1 b0 b1, h1: ...] → GGUF [a0 b0 a1 b1].
        let hf: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let gguf = permute_rows_to_gguf(&hf, 2, 1);
        assert_eq!(gguf, vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(permute_rows_to_hf(&gguf, 2, 1), hf);
    }
}
