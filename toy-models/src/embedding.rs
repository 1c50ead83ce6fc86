//! `TokenEmbedding`: the token embedding table, dense (trainable) or packed in its GGUF block
//! format (a lookup widens only the rows it reads).

use burn::module::{Module, Param};
use burn::nn::Embedding;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use toy_kernels::ToyBackend;

use crate::qlinear::{PackedMatrix, QLinear};

/// The token embedding table of a model: `[vocab, d]`, dense or in its GGUF block format.
#[derive(Module, Debug)]
pub enum TokenEmbedding<B: Backend> {
    /// An f32 table `[vocab, d]` (burn's `Embedding`).
    Dense(Embedding<B>),
    /// A table kept in its GGUF block format.
    Packed(PackedMatrix<B>),
}

impl<B: Backend> TokenEmbedding<B> {
    /// `[vocab, d]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            TokenEmbedding::Dense(e) => e.weight.dims(),
            TokenEmbedding::Packed(p) => p.dims(),
        }
    }

    /// The dense table, if it is one.
    pub fn dense(&self) -> Option<&Embedding<B>> {
        match self {
            TokenEmbedding::Dense(e) => Some(e),
            TokenEmbedding::Packed(_) => None,
        }
    }

    /// The dense table, if it is one, to change.
    pub fn dense_mut(&mut self) -> Option<&mut Embedding<B>> {
        match self {
            TokenEmbedding::Dense(e) => Some(e),
            TokenEmbedding::Packed(_) => None,
        }
    }
}

impl<B: ToyBackend> TokenEmbedding<B> {
    /// `tokens[b, t]` to `[b, t, d]`.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        match self {
            TokenEmbedding::Dense(e) => e.forward(tokens),
            TokenEmbedding::Packed(p) => {
                let [b, t] = tokens.dims();
                p.rows(tokens.reshape([b * t])).reshape([b, t, p.cols])
            }
        }
    }

    /// The table as an f32 tensor (a packed one dequantized exactly, as llama.cpp does).
    pub fn weight(&self) -> Tensor<B, 2> {
        match self {
            TokenEmbedding::Dense(e) => e.weight.val(),
            TokenEmbedding::Packed(p) => p.dequantized(),
        }
    }

    /// The same table, dense (f32).
    pub fn dequantized(&self) -> TokenEmbedding<B> {
        match self {
            TokenEmbedding::Dense(_) => self.clone(),
            TokenEmbedding::Packed(p) => TokenEmbedding::Dense(Embedding {
                weight: Param::from_tensor(p.dequantized().detach()),
            }),
        }
    }

    /// An output head that multiplies by this table (a tied head). A packed table stays packed
    /// and shared; llama.cpp does not repack it, so neither form changes its arithmetic.
    pub fn tied_head(&self) -> QLinear<B> {
        match self {
            TokenEmbedding::Dense(e) => QLinear::Dense(Param::from_tensor(e.weight.val())),
            TokenEmbedding::Packed(p) => QLinear::Packed(p.clone()),
        }
    }
}
