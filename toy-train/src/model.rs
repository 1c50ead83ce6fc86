//! The model a run trains, whatever its architecture: a [`Model`] (llama family or GPT-2) and,
//! for a warm start whose width differs from the donor's, the projection of the donor's token
//! embeddings. One training loop ([`crate::trainer`]) drives every case through [`Trainee`].

use std::path::Path;

use burn::module::{Module, Param, ParamId};
use burn::nn::Embedding;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use toy_core::gguf::{GgufFile, Value};
use toy_kernels::ToyBackend;
use toy_models::{CausalLm, Gpt2Config, LlamaConfig, Model, Transformer};

use crate::TrainError;
use crate::init::{init_gpt2, init_model, normals};
use toy_core::rng::SplitMix64;

/// The architecture and shape of the model being trained.
#[derive(Debug, Clone)]
pub enum ModelSpec {
    /// A llama-family model.
    Llama(LlamaConfig),
    /// A GPT-2.
    Gpt2(Gpt2Config),
}

impl ModelSpec {
    /// A model with every weight drawn from `seed` ([`crate::init`]).
    pub fn init<B: ToyBackend>(&self, seed: u64, device: &B::Device) -> Model<B> {
        match self {
            ModelSpec::Llama(c) => Model::Llama(init_model(c, seed, device)),
            ModelSpec::Gpt2(c) => Model::Gpt2(init_gpt2(c, seed, device)),
        }
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelSpec::Llama(c) => c.vocab_size,
            ModelSpec::Gpt2(c) => c.vocab_size,
        }
    }

    /// Width of the residual stream.
    pub fn d_model(&self) -> usize {
        match self {
            ModelSpec::Llama(c) => c.d_model,
            ModelSpec::Gpt2(c) => c.d_model,
        }
    }

    /// Write `model` as a standard GGUF of its architecture (atomically); `extra` is the
    /// metadata besides the model's own keys (name, tokenizer).
    pub fn save<B: ToyBackend>(
        &self,
        model: &Model<B>,
        extra: &[(String, Value)],
        path: &Path,
    ) -> Result<u64, TrainError> {
        Ok(match (self, model) {
            (ModelSpec::Llama(c), Model::Llama(m)) => toy_models::save(m, c, extra, path)?,
            (ModelSpec::Gpt2(c), Model::Gpt2(m)) => toy_models::save_gpt2(m, c, extra, path)?,
            _ => {
                return Err(TrainError::Config(
                    "the model does not have the architecture of its config".into(),
                ));
            }
        })
    }
}

/// The token embedding table of `model`, when it is dense (trainable).
pub fn token_embd<B: Backend>(model: &Model<B>) -> Option<&Embedding<B>> {
    match model {
        Model::Llama(m) => m.token_embd.dense(),
        Model::Gpt2(m) => Some(&m.token_embd),
    }
}

/// The token embedding table of `model`, dense (a packed table is widened to f32 first, as a
/// trained table must be).
fn token_embd_mut<B: ToyBackend>(model: &mut Model<B>) -> &mut Embedding<B> {
    match model {
        Model::Llama(m) => {
            if m.token_embd.dense().is_none() {
                m.token_embd = m.token_embd.dequantized();
            }
            m.token_embd.dense_mut().expect("made dense above")
        }
        Model::Gpt2(m) => &mut m.token_embd,
    }
}

/// What the optimizer updates: the model, and for a warm start across widths the projection
/// `P [d_donor, d_model]` whose product with the (frozen) donor embeddings is the model's token
/// embedding table. The donor table itself is not a parameter and not part of the checkpoint
/// records: it is read from the donor GGUF ([`DonorEmbedding`]).
#[derive(Module, Debug)]
pub struct Trainee<B: Backend> {
    /// The model (with a projection, its token embedding table is recomputed as `donor · P`).
    pub model: Model<B>,
    /// The projection `P` of a warm start across widths; `None` otherwise.
    pub embd_proj: Option<Param<Tensor<B, 2>>>,
}

impl<B: ToyBackend> Trainee<B> {
    /// The llama-family model, when that is what is trained.
    pub fn llama(&self) -> Option<&Transformer<B>> {
        match &self.model {
            Model::Llama(m) => Some(m),
            Model::Gpt2(_) => None,
        }
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (`CausalLm::loss`), from an
    /// empty cache. With a projection the token embedding is `donor · P`, computed in the graph,
    /// so `P` gets the gradient.
    pub fn loss(
        &self,
        tokens: Tensor<B, 2, Int>,
        targets: Tensor<B, 2, Int>,
        donor: Option<&Tensor<B, 2>>,
    ) -> Tensor<B, 1> {
        match (&self.embd_proj, donor) {
            (Some(_), Some(donor)) => self.folded(donor).loss(tokens, targets),
            _ => self.model.loss(tokens, targets),
        }
    }

    /// The plain model: with a projection, its token embedding replaced by `donor · P` (the
    /// model `model.gguf` holds).
    pub fn folded(&self, donor: &Tensor<B, 2>) -> Model<B> {
        let mut model = self.model.clone();
        if let Some(p) = &self.embd_proj {
            let embd = token_embd_mut(&mut model);
            // A fresh id: this table is computed, not a parameter the optimizer tracks.
            embd.weight = Param::initialized(ParamId::new(), donor.clone().matmul(p.val()));
        }
        model
    }
}

/// The donor of a warm start: its token embedding table `[vocab, d_donor]`, dequantized to f32.
pub struct DonorEmbedding {
    /// Rows of the table: the donor's vocabulary.
    pub vocab_size: usize,
    /// The donor's embedding width.
    pub width: usize,
    /// Row-major `[vocab_size, width]`.
    pub values: Vec<f32>,
}

impl DonorEmbedding {
    /// Read the `token_embd.weight` table of the donor GGUF at `path`, as f32.
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        let file = GgufFile::open(path).map_err(|e| {
            TrainError::Config(format!("cannot open the donor {}: {e}", path.display()))
        })?;
        let info = file.tensor("token_embd.weight").ok_or_else(|| {
            TrainError::Config(format!(
                "the donor {} has no token_embd.weight tensor",
                path.display()
            ))
        })?;
        let shape = info.shape();
        let [vocab_size, width] = shape[..] else {
            return Err(TrainError::Config(format!(
                "the donor's token_embd.weight has shape {shape:?}, not [vocab, width]"
            )));
        };
        let values = toy_core::gguf::tensor_to_f32(&file, info).map_err(|e| {
            TrainError::Config(format!("cannot read the donor's token_embd.weight: {e}"))
        })?;
        Ok(DonorEmbedding {
            vocab_size,
            width,
            values,
        })
    }

    /// The table as a `vocab_size × width` tensor on `device`.
    pub fn tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        Tensor::from_data(
            TensorData::new(self.values.clone(), [self.vocab_size, self.width]),
            device,
        )
    }

    /// The initial projection `P [width, d_model]`, drawn from `seed`: Gaussian entries scaled
    /// so that the projected rows have the unit scale per coordinate of a from-scratch
    /// embedding (which the N(0, 1/fan_in) matrices after it assume). A random Gaussian map
    /// keeps the inner products between the donor's token vectors up to one common scale
    /// (Johnson–Lindenstrauss), which is the knowledge a warm start means to carry over; taking
    /// the first `d_model` coordinates instead would keep an arbitrary slice of a basis that
    /// training had no reason to order.
    pub fn initial_projection(&self, d_model: usize, seed: u64) -> Vec<f32> {
        let rows = self.values.chunks_exact(self.width);
        let mean_sq_norm = rows
            .map(|r| r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>())
            .sum::<f64>()
            / self.vocab_size.max(1) as f64;
        // E|(xP)_j|² = |x|² σ², so σ = 1/rms|x| gives unit-variance coordinates.
        let std = 1.0 / mean_sq_norm.sqrt().max(1e-12);
        // A stream of the run's seed that no parameter uses.
        let mut rng = SplitMix64::new(seed ^ 0x5EED_0F0D_0A0E_0001);
        normals(&mut rng, self.width * d_model, std)
    }
}

/// The starting trainee of a run: from the seed, and for a warm start with the donor's token
/// embeddings copied in (same width) or projected (another width).
pub fn init_trainee<B: ToyBackend>(
    spec: &ModelSpec,
    seed: u64,
    donor: Option<&DonorEmbedding>,
    device: &B::Device,
) -> Result<Trainee<B>, TrainError> {
    let mut model = spec.init::<B>(seed, device);
    let Some(donor) = donor else {
        return Ok(Trainee {
            model,
            embd_proj: None,
        });
    };
    if donor.vocab_size != spec.vocab_size() {
        return Err(TrainError::Config(format!(
            "the donor has {} token embeddings for a vocabulary of {}",
            donor.vocab_size,
            spec.vocab_size()
        )));
    }
    let d_model = spec.d_model();
    let table = donor.tensor::<B>(device);
    let embd = token_embd_mut(&mut model);
    let (id, old, mapper) = embd.weight.clone().consume();
    let track = |t: Tensor<B, 2>| {
        if old.is_require_grad() {
            t.require_grad()
        } else {
            t
        }
    };
    if donor.width == d_model {
        embd.weight = Param::from_mapped_value(id, track(table), mapper);
        return Ok(Trainee {
            model,
            embd_proj: None,
        });
    }
    let p = Tensor::<B, 2>::from_data(
        TensorData::new(
            donor.initial_projection(d_model, seed),
            [donor.width, d_model],
        ),
        device,
    );
    // The model's own table holds donor · P too, so that it is right wherever it is read; in
    // training the forward recomputes it from P (it gets no gradient of its own).
    let start = table.matmul(p.clone());
    embd.weight = Param::from_mapped_value(id, start.detach(), mapper);
    Ok(Trainee {
        model,
        embd_proj: Some(Param::from_tensor(p)),
    })
}
