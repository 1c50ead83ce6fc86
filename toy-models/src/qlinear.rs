//! `QLinear`: a bias-free linear layer whose weight may stay quantized on the device.
//!
//! The model code calls `forward` and never sees the weight format: Q8_0, Q4_0 and Q4_1 weights
//! stay packed (see `toy_kernels::quant`) and go through the backend's quantized matmul — which
//! on the CPU computes them the way llama.cpp does; every other GGUF type is dequantized to f32
//! at load.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use toy_kernels::quant::PackedWeight;
use toy_kernels::{ToyBackend, reference};

/// A quantized weight in the packed layout: `words[n, k / per_word]` (u32), `scales[n, k / 32]`
/// and, for asymmetric formats, `mins[n, k / 32]`.
#[derive(Module, Debug)]
pub struct PackedMatrix<B: Backend> {
    pub words: Param<Tensor<B, 2, Int>>,
    pub scales: Param<Tensor<B, 2>>,
    pub mins: Option<Param<Tensor<B, 2>>>,
}

impl<B: Backend> PackedMatrix<B> {
    pub fn from_host(packed: PackedWeight, device: &B::Device) -> Self {
        let per_row = packed.words.len() / packed.rows;
        let words = Tensor::from_data(
            TensorData::new(packed.words, [packed.rows, per_row]),
            (device, DType::U32),
        );
        let blocks = [packed.rows, packed.cols / 32];
        // Quantized bases are frozen: no gradient, no optimizer state. The scales stay f32
        // whatever the activation type (`--dtype f16`): the kernels read them as f32.
        let frozen = |v: Vec<f32>| {
            Param::from_tensor(Tensor::from_data(
                TensorData::new(v, blocks),
                (device, DType::F32),
            ))
            .set_require_grad(false)
        };
        PackedMatrix {
            words: Param::initialized(ParamId::new(), words),
            scales: frozen(packed.scales),
            mins: packed.mins.map(frozen),
        }
    }
}

impl<B: ToyBackend> PackedMatrix<B> {
    /// `x · dequant(self)ᵀ` through one of the backend's quantized matmuls.
    fn matmul(
        &self,
        x: Tensor<B, 2>,
        op: impl FnOnce(FloatTensor<B>, IntTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    ) -> Tensor<B, 2> {
        let y = op(
            x.into_primitive().tensor(),
            self.words.val().into_primitive(),
            self.scales.val().into_primitive().tensor(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(y))
    }
}

#[derive(Module, Debug)]
pub enum QLinear<B: Backend> {
    /// A float weight `[out, in]` (PyTorch layout).
    Dense(Param<Tensor<B, 2>>),
    Q8_0(PackedMatrix<B>),
    Q4_0(PackedMatrix<B>),
    Q4_1(PackedMatrix<B>),
}

impl<B: Backend> QLinear<B> {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            QLinear::Dense(w) => w.dims(),
            QLinear::Q8_0(p) | QLinear::Q4_0(p) | QLinear::Q4_1(p) => {
                let [out, blocks] = p.scales.dims();
                [out, blocks * 32]
            }
        }
    }

    /// The same layer with an f32 weight (`Dense`): a packed weight is dequantized as llama.cpp
    /// and gguf-py do (`d·q`, `d·q + m`, exact in f32); a dense one is returned as it is.
    pub fn dequantized(&self) -> QLinear<B> {
        let w = match self {
            QLinear::Dense(_) => return self.clone(),
            QLinear::Q8_0(p) => reference::dequant_q8_0(p.words.val(), p.scales.val()),
            QLinear::Q4_0(p) => reference::dequant_q4_0(p.words.val(), p.scales.val()),
            QLinear::Q4_1(p) => {
                let mins = p
                    .mins
                    .as_ref()
                    .expect("PackedMatrix::from_host keeps Q4_1's mins");
                reference::dequant_q4_1(p.words.val(), p.scales.val(), mins.val())
            }
        };
        QLinear::Dense(Param::from_tensor(w.detach()))
    }
}

impl<B: ToyBackend> QLinear<B> {
    /// `x[.., in] -> [.., out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let k = dims[D - 1];
        let x2: Tensor<B, 2> = x.reshape([-1, k as i32]);
        let y = match self {
            QLinear::Dense(w) => dense_linear(x2, w.val()),
            QLinear::Q8_0(p) => p.matmul(x2, B::q8_0_matmul),
            QLinear::Q4_0(p) => p.matmul(x2, B::q4_0_matmul),
            QLinear::Q4_1(p) => {
                let mins = p
                    .mins
                    .as_ref()
                    .expect("PackedMatrix::from_host keeps Q4_1's mins");
                let mins = mins.val().into_primitive().tensor();
                p.matmul(x2, |x, w, s| B::q4_1_matmul(x, w, s, mins))
            }
        };
        let mut out = dims;
        out[D - 1] = y.dims()[1];
        y.reshape(out)
    }

    /// Mean cross-entropy of this layer as an output head: of the logits of `h[b, t, d]`
    /// against `targets[b, t]`. A dense weight goes through
    /// [`ToyBackend::linear_cross_entropy`], which need not hold the `[b·t, vocab]` logits; a
    /// quantized one computes them with its matmul.
    pub fn cross_entropy(&self, h: Tensor<B, 3>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        match self {
            QLinear::Dense(w) => {
                let [b, t, d] = h.dims();
                Tensor::from_primitive(TensorPrimitive::Float(B::linear_cross_entropy(
                    h.reshape([b * t, d]).into_primitive().tensor(),
                    w.val().into_primitive().tensor(),
                    targets.reshape([b * t]).into_primitive(),
                )))
            }
            _ => cross_entropy(self.forward(h), targets),
        }
    }
}

/// Mean next-token cross-entropy (natural log) of `logits[b, t, vocab]` against `targets[b, t]`.
pub fn cross_entropy<B: ToyBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
) -> Tensor<B, 1> {
    let [b, t, vocab] = logits.dims();
    Tensor::from_primitive(TensorPrimitive::Float(B::cross_entropy(
        logits.reshape([b * t, vocab]).into_primitive().tensor(),
        targets.reshape([b * t]).into_primitive(),
    )))
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::f16;
    use toy_core::gguf::{GgmlType, dequantize_to_vec, quantize};
    use toy_kernels::quant::{pack_q4_0, pack_q4_1, pack_q8_0};

    use super::*;

    /// `dequantized` gives gguf-py's (and llama.cpp's) f32 values bit for bit.
    #[test]
    fn dequantized_equals_the_gguf_dequantization() {
        let (n, k) = (6, 96);
        let values: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        // Q4_1 blocks by hand (toy-core quantizes to Q8_0 and Q4_0 only): f16 d and m, nibbles.
        let q4_1: Vec<u8> = (0..n * k / 32)
            .flat_map(|b| {
                let d = f16::from_f32(0.01 + b as f32 * 0.003).to_le_bytes();
                let m = f16::from_f32(-0.4 + b as f32 * 0.05).to_le_bytes();
                let qs = (0..16).map(move |j| ((b * 7 + j * 13) % 256) as u8);
                d.into_iter().chain(m).chain(qs)
            })
            .collect();
        let cases = [
            (GgmlType::Q8_0, quantize(GgmlType::Q8_0, &values).unwrap()),
            (GgmlType::Q4_0, quantize(GgmlType::Q4_0, &values).unwrap()),
            (GgmlType::Q4_1, q4_1),
        ];
        let device = Default::default();
        for (ty, blocks) in cases {
            let packed = |p| PackedMatrix::<Flex>::from_host(p, &device);
            let layer = match ty {
                GgmlType::Q8_0 => QLinear::Q8_0(packed(pack_q8_0(&blocks, n, k))),
                GgmlType::Q4_0 => QLinear::Q4_0(packed(pack_q4_0(&blocks, n, k))),
                _ => QLinear::Q4_1(packed(pack_q4_1(&blocks, n, k))),
            };
            assert_eq!(layer.dims(), [n, k]);
            let QLinear::Dense(w) = layer.dequantized() else {
                panic!("{ty:?}: not dense");
            };
            let got = w.val().into_data().into_vec::<f32>().unwrap();
            let want = dequantize_to_vec(ty, &blocks).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty:?}: dequantized weights differ from gguf's"
            );
        }
    }
}

/// `x[m, k] · w[n, k]ᵀ` through [`ToyBackend::dense_linear`].
pub fn dense_linear<B: ToyBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(B::dense_linear(
        x.into_primitive().tensor(),
        w.into_primitive().tensor(),
    )))
}
