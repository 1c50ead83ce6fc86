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
use toy_kernels::ToyBackend;
use toy_kernels::quant::PackedWeight;

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

impl<B: ToyBackend> QLinear<B> {
    /// `x[.., in] -> [.., out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let k = dims[D - 1];
        let x2: Tensor<B, 2> = x.reshape([-1, k as i32]);
        let y = match self {
            QLinear::Dense(w) => x2.matmul(w.val().transpose()),
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
}
