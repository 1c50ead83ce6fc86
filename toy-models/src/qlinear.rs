//! `QLinear`: a bias-free linear layer whose weight may stay packed on the device.
//!
//! The model code calls `forward` and never sees the weight format: every type of
//! `toy_kernels::packed::PACKED_TYPES` (the K-quants, Q4/Q5/Q8 blocks, IQ4, F16, BF16) stays in
//! its GGUF block format and goes through the backend's packed matmul — which on the CPU
//! computes it the way llama.cpp does. F32 weights (and anything trainable) are `Dense`.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use toy_kernels::ToyBackend;
use toy_kernels::packed::{
    GgmlType, HostPacked, PackedTensor, RowLayout, interleave_rows, interleave_scales,
    row_layout_for,
};

/// A weight `[rows, cols]` in its GGUF block format (layouts: `toy_kernels::packed`).
#[derive(Module, Debug)]
pub struct PackedMatrix<B: Backend> {
    /// `[rows, row_words]` u32 words.
    pub words: Param<Tensor<B, 2, Int>>,
    /// Q8_0 / Q4_0 / Q4_1: f32 block scales `[rows, cols / 32]`.
    pub scales: Option<Param<Tensor<B, 2>>>,
    /// Q4_1: f32 block offsets `[rows, cols / 32]`.
    pub mins: Option<Param<Tensor<B, 2>>>,
    /// The GGUF type of the blocks.
    pub ty: GgmlType,
    /// Values per row.
    pub cols: usize,
    /// See `PackedTensor::repackable`: false for a token embedding table.
    pub repackable: bool,
    /// See `PackedTensor::layout`: how a Q4_K weight's rows lie (interleaved on the CPU).
    pub layout: RowLayout,
}

impl<B: ToyBackend> PackedMatrix<B> {
    /// Upload a packed weight. `repackable`: whether it is a matmul weight llama.cpp would
    /// repack (true) or a token embedding table (false). On a backend with its own layout for
    /// the weights llama.cpp repacks (the CPU: `ToyBackend::row_layout`), such a weight is
    /// interleaved here, once.
    pub fn from_host(packed: HostPacked, repackable: bool, device: &B::Device) -> Self {
        let per_row = packed.words.len() / packed.rows;
        let layout = row_layout_for(
            B::row_layout(),
            packed.ty,
            packed.rows,
            packed.cols,
            repackable,
        );
        let (rows, cols) = (packed.rows, packed.cols);
        let words = interleave_rows(layout, packed.ty, packed.words, rows, cols);
        let scales = packed
            .scales
            .map(|s| interleave_scales(layout, s, rows, cols));
        let words = Tensor::from_data(
            TensorData::new(words, [packed.rows, per_row]),
            (device, DType::U32),
        );
        let blocks = [packed.rows, packed.cols / 32];
        // Packed weights are frozen: no gradient, no optimizer state. The scales stay f32
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
            scales: scales.map(frozen),
            mins: packed.mins.map(frozen),
            ty: packed.ty,
            cols: packed.cols,
            repackable,
            layout,
        }
    }
}

impl<B: Backend> PackedMatrix<B> {
    /// `[rows, cols]`.
    pub fn dims(&self) -> [usize; 2] {
        [self.words.dims()[0], self.cols]
    }

    /// The same weight as a token embedding table (llama.cpp keeps those unrepacked) or as a
    /// matmul weight. (Its layout stays as uploaded: every op reads either.)
    pub fn with_repackable(mut self, repackable: bool) -> Self {
        self.repackable = repackable;
        self
    }
}

impl<B: ToyBackend> PackedMatrix<B> {
    /// The backend's view of the weight.
    pub fn tensor(&self) -> PackedTensor<B> {
        PackedTensor {
            ty: self.ty,
            cols: self.cols,
            words: self.words.val().into_primitive(),
            scales: self
                .scales
                .as_ref()
                .map(|s| s.val().into_primitive().tensor()),
            mins: self
                .mins
                .as_ref()
                .map(|m| m.val().into_primitive().tensor()),
            repackable: self.repackable,
            layout: self.layout,
        }
    }

    /// `x · dequant(self)ᵀ`.
    pub fn matmul(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = B::packed_matmul(x.into_primitive().tensor(), self.tensor());
        Tensor::from_primitive(TensorPrimitive::Float(y))
    }

    /// Rows `ids` dequantized: `[ids.len(), cols]` (an embedding lookup).
    pub fn rows(&self, ids: Tensor<B, 1, Int>) -> Tensor<B, 2> {
        let y = B::packed_rows(self.tensor(), ids.into_primitive());
        Tensor::from_primitive(TensorPrimitive::Float(y))
    }

    /// The whole weight widened to f32, as llama.cpp and gguf-py dequantize it (exact).
    pub fn dequantized(&self) -> Tensor<B, 2> {
        Tensor::from_primitive(TensorPrimitive::Float(B::packed_dequantize(self.tensor())))
    }
}

/// A bias-free linear layer `x · Wᵀ` whose weight is dense (trainable) or packed in its GGUF
/// block format.
#[derive(Module, Debug)]
pub enum QLinear<B: Backend> {
    /// A float weight `[out, in]` (PyTorch layout).
    Dense(Param<Tensor<B, 2>>),
    /// A weight kept in its GGUF block format.
    Packed(PackedMatrix<B>),
}

impl<B: Backend> QLinear<B> {
    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            QLinear::Dense(w) => w.dims(),
            QLinear::Packed(p) => p.dims(),
        }
    }

    /// The GGUF type of a packed weight; `None` for a dense one.
    pub fn packed_type(&self) -> Option<GgmlType> {
        match self {
            QLinear::Dense(_) => None,
            QLinear::Packed(p) => Some(p.ty),
        }
    }
}

impl<B: ToyBackend> QLinear<B> {
    /// The same layer with an f32 weight (`Dense`): a packed weight is dequantized as llama.cpp
    /// and gguf-py do (exact in f32); a dense one is returned as it is.
    pub fn dequantized(&self) -> QLinear<B> {
        match self {
            QLinear::Dense(_) => self.clone(),
            QLinear::Packed(p) => QLinear::Dense(Param::from_tensor(p.dequantized().detach())),
        }
    }
}

impl<B: ToyBackend> QLinear<B> {
    /// `x[.., in] -> [.., out]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let x2 = as_rows(x);
        let y = match self {
            QLinear::Dense(w) => dense_linear(x2, w.val()),
            QLinear::Packed(p) => p.matmul(x2),
        };
        from_rows(y, dims)
    }

    /// [`forward`](Self::forward) of each of `layers` on the same `x` (a block's Q, K and V, or
    /// its gate and up), with the same results. Packed weights go to the backend together
    /// ([`ToyBackend::packed_matmuls`]: on the CPU one parallel region instead of one per layer).
    pub fn forward_each<const D: usize, const N: usize>(
        layers: [&Self; N],
        x: Tensor<B, D>,
    ) -> [Tensor<B, D>; N] {
        let packed: Option<Vec<PackedTensor<B>>> = layers
            .iter()
            .map(|layer| match layer {
                QLinear::Packed(p) => Some(p.tensor()),
                QLinear::Dense(_) => None,
            })
            .collect();
        let Some(weights) = packed else {
            return layers.map(|layer| layer.forward(x.clone()));
        };
        let dims = x.dims();
        let x2 = as_rows(x).into_primitive().tensor();
        let mut ys = B::packed_matmuls(x2, weights).into_iter();
        std::array::from_fn(|_| {
            let y = ys.next().expect("one product per weight");
            from_rows(Tensor::from_primitive(TensorPrimitive::Float(y)), dims)
        })
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

/// `x[.., k]` as the rows `[n, k]` a matmul takes.
fn as_rows<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 2> {
    let k = x.dims()[D - 1];
    x.reshape([-1, k as i32])
}

/// A matmul's output rows `[n, out]` back in the shape `dims` of its input, `out` last.
fn from_rows<B: Backend, const D: usize>(y: Tensor<B, 2>, dims: [usize; D]) -> Tensor<B, D> {
    let mut out = dims;
    out[D - 1] = y.dims()[1];
    y.reshape(out)
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
    use toy_core::gguf::{dequantize_to_vec, quantize};
    use toy_kernels::packed::pack;

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
            let packed = pack(ty, &blocks, n, k).unwrap();
            let layer = QLinear::Packed(PackedMatrix::<Flex>::from_host(packed, true, &device));
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
