//! Seeded initialization of a from-scratch model.
//!
//! `LlamaConfig::init` draws from burn's process-wide RNG (`B::seed`), which every thread of the
//! process shares: two runs in one process (a server, a test harness) would interleave their
//! draws and lose reproducibility. So the recipe redraws every matrix from its own generator,
//! seeded by the run's seed and the parameter's position in the model: N(0, 1) for the token
//! embedding (burn's `Embedding` default: each token starts as a unit-scale vector in the
//! residual stream), N(0, 1/fan_in) for every other matrix (fan_in = its input width), ones for
//! the RMSNorm gains (as `init` leaves them). A GPT-2 gets the same: N(0, 1) for its token and
//! position embeddings, N(0, 1/fan_in) for its matrices, LayerNorms at weight 1 and bias 0, and
//! zero biases (as [`Gpt2Config::init`] leaves them).

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::{Gpt2, Gpt2Config, LlamaConfig, Transformer};

use toy_core::rng::SplitMix64;

/// A model of shape `config` with weights drawn from `seed` (see the module docs).
pub fn init_model<B: ToyBackend>(
    config: &LlamaConfig,
    seed: u64,
    device: &B::Device,
) -> Transformer<B> {
    let mut model = config.init::<B>(device).map(&mut SeededInit {
        seed,
        index: 0,
        device: device.clone(),
    });
    // `init` makes a dense table; the embeddings are input vectors: unit scale.
    if let Some(embd) = model.token_embd.dense_mut() {
        let (id, weight, mapper) = embd.weight.clone().consume();
        let weight = draw(&weight, 1.0, seed, 0, device);
        embd.weight = Param::from_mapped_value(id, weight, mapper);
    }
    model
}

/// A GPT-2 of shape `config` with weights drawn from `seed` (see the module docs).
pub fn init_gpt2<B: ToyBackend>(config: &Gpt2Config, seed: u64, device: &B::Device) -> Gpt2<B> {
    let model = config.init::<B>(device).map(&mut SeededInit {
        seed,
        index: 0,
        device: device.clone(),
    });
    // The embeddings are tables of input vectors: unit scale, like the llama's, from streams
    // the matrices do not use (those count up from 1).
    let unit = |embedding: burn::nn::Embedding<B>, stream: u64| {
        let (id, weight, mapper) = embedding.weight.consume();
        let weight = draw(&weight, 1.0, seed, stream, device);
        burn::nn::Embedding {
            weight: Param::from_mapped_value(id, weight, mapper),
        }
    };
    Gpt2 {
        token_embd: unit(model.token_embd, 0),
        pos_embd: unit(model.pos_embd, u64::MAX),
        ..model
    }
}

/// A tensor shaped and tracked like `like`, drawn from N(0, std²) with stream `stream` of `seed`.
fn draw<B: Backend, const D: usize>(
    like: &Tensor<B, D>,
    std: f64,
    seed: u64,
    stream: u64,
    device: &B::Device,
) -> Tensor<B, D> {
    let shape = like.shape();
    let mut rng = SplitMix64::new(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let values = normals(&mut rng, shape.num_elements(), std);
    let fresh = Tensor::<B, D>::from_data(TensorData::new(values, shape), device);
    if like.is_require_grad() {
        fresh.require_grad()
    } else {
        fresh
    }
}

struct SeededInit<B: Backend> {
    seed: u64,
    index: u64,
    device: B::Device,
}

impl<B: Backend> ModuleMapper<B> for SeededInit<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        self.index += 1;
        if D < 2 {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let fan_in = tensor.dims()[D - 1];
        let std = (1.0 / fan_in as f64).sqrt();
        let fresh = draw(&tensor, std, self.seed, self.index, &self.device);
        Param::from_mapped_value(id, fresh, mapper)
    }
}

/// `n` draws from N(0, std²) by the Box–Muller transform (in f64, rounded to f32).
pub(crate) fn normals(rng: &mut SplitMix64, n: usize, std: f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // Uniforms in (0, 1]: 53 random bits, never 0 (ln(0) is -inf).
        let u1 = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let theta = 2.0 * std::f64::consts::PI * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_have_the_right_moments() {
        let v = normals(&mut SplitMix64::new(5), 100_000, 0.5);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "{}", var.sqrt());
    }

    #[test]
    fn same_seed_same_weights_whatever_the_global_rng() {
        use burn::backend::Flex;
        let config = LlamaConfig::new(1, 16, 2, 1, 8, 24, 11, 16).with_tied_embeddings(false);
        let device = Default::default();
        Flex::seed(&device, 1);
        let a = init_model::<Flex>(&config, 9, &device);
        Flex::seed(&device, 2);
        let b = init_model::<Flex>(&config, 9, &device);
        let c = init_model::<Flex>(&config, 10, &device);
        let w = |m: &Transformer<Flex>| m.token_embd.weight().into_data();
        assert_eq!(w(&a), w(&b));
        assert_ne!(w(&a), w(&c));
    }
}
