//! AdamW with weight decay on matrices only, and global gradient-norm clipping.
//!
//! burn 0.21's `AdamW` applies one weight decay to every parameter it steps, and has no
//! parameter groups. But its optimizer adaptor only steps the parameters that have a gradient in
//! the `GradientsParams` it is given, so two AdamW instances — one with the configured decay,
//! one with none — each given the gradients of their own parameters, make the two groups that
//! GPT-style training uses: decay on 2-D weights (embeddings, projections, the output head), none
//! on the RMSNorm gains. Each instance keeps the moments of its own parameters. A model may also
//! name matrices that take no decay ([`TrainOptimizer::without_decay`]): a ViT's position
//! embeddings and class token, which timm exempts (its `no_weight_decay()`).
//!
//! Clipping is by the global norm over all gradients (burn's `GradientClipping::Norm` clips each
//! parameter's gradient on its own, which changes the update's direction).
//!
//! The update itself is burn's `AdamW` arithmetic run as one backend op
//! ([`ToyBackend::adamw_step`]), with burn's state records: burn composes the step of about
//! fifteen tensor ops, each allocating a parameter-sized buffer, which made the optimizer a
//! quarter of a CPU training step (`docs/performance.md`). [`FusedAdamW`] is that one change;
//! burn's adaptor still keeps the moments per parameter and saves them.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{
    AdamWState, AdaptiveMomentumState, GradientsParams, LearningRate, Optimizer, SimpleOptimizer,
};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorPrimitive};
use toy_kernels::{AdamWStep, ToyBackend};
use toy_models::Transformer;

use crate::TrainError;
use crate::config::OptimConfig;

/// Replace every gradient `g` of `grads` that belongs to a parameter of `model` by `f(g)`, `g`
/// flattened (and passed by value, so that an elementwise op on it may run in place).
pub(crate) fn map_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    f: &mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
) {
    struct Visit<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        f: &'a mut dyn FnMut(Tensor<B::InnerBackend, 1>) -> Tensor<B::InnerBackend, 1>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let shape = g.shape();
                let flat = (self.f)(g.reshape([shape.num_elements()]));
                let g: Tensor<B::InnerBackend, D> = flat.reshape(shape);
                self.grads.register(param.id, g);
            }
        }
    }
    model.visit(&mut Visit { grads, f });
}

/// The global L2 norm of the gradients of `model`'s parameters.
pub fn grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) -> f64
where
    B::InnerBackend: ToyBackend,
{
    let mut sum: Option<Tensor<B::InnerBackend, 1>> = None;
    map_grads::<B, M>(model, grads, &mut |g| {
        let sq = Tensor::from_primitive(TensorPrimitive::Float(
            <B::InnerBackend as ToyBackend>::sum_squares(g.clone().into_primitive().tensor()),
        ));
        sum = Some(match sum.take() {
            Some(s) => s + sq,
            None => sq,
        });
        g
    });
    // One read back to the host per step.
    sum.map_or(0.0, |s| s.into_scalar().elem::<f64>().sqrt())
}

/// Clip the gradients to the global norm `clip` (0: no clipping) before optimizer step
/// `step` (from 0): their norm before clipping and whether they were scaled down; a non-finite
/// norm is [`TrainError::Diverged`].
pub fn clip_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    clip: f32,
    step: usize,
) -> Result<(f64, bool), TrainError>
where
    B::InnerBackend: ToyBackend,
{
    let norm = grad_norm::<B, M>(model, grads);
    if !norm.is_finite() {
        return Err(TrainError::Diverged {
            step: step + 1,
            grad_norm: norm,
        });
    }
    let clipped = clip > 0.0 && norm > clip as f64;
    if clipped {
        scale_grads::<B, M>(model, grads, clip as f64 / norm);
    }
    Ok((norm, clipped))
}

/// Scale every gradient by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    map_grads::<B, M>(model, grads, &mut |g| g.mul_scalar(factor));
}

/// Split `grads` into the gradients of matrices and those of vectors.
fn split_by_rank<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: GradientsParams,
    exempt: &[ParamId],
) -> (GradientsParams, GradientsParams) {
    struct Split<'a> {
        all: GradientsParams,
        matrices: GradientsParams,
        vectors: GradientsParams,
        exempt: &'a [ParamId],
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Split<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.all.remove::<B::InnerBackend, D>(param.id) {
                let to = if D >= 2 && !self.exempt.contains(&param.id) {
                    &mut self.matrices
                } else {
                    &mut self.vectors
                };
                to.register(param.id, g);
            }
        }
    }
    let mut split = Split {
        all: std::mem::take(&mut grads),
        matrices: GradientsParams::new(),
        vectors: GradientsParams::new(),
        exempt,
    };
    model.visit(&mut split);
    (split.matrices, split.vectors)
}

/// burn's `AdamW` (no AMSGrad, no cautious decay) stepped by [`ToyBackend::adamw_step`], with
/// burn's `AdamWState` as its state, so checkpoints hold the same records.
#[derive(Debug, Clone, Copy)]
pub struct FusedAdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
}

impl<B: ToyBackend> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let prim = |t: Tensor<B, D>| t.into_primitive().tensor();
        let (time, moments) = match state {
            Some(s) => {
                let m = s.momentum;
                (m.time + 1, Some((prim(m.moment_1), prim(m.moment_2))))
            }
            None => (1, None),
        };
        let step = AdamWStep {
            lr,
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            time,
        };
        let (p, m, v) = B::adamw_step(prim(tensor), prim(grad), moments, step);
        let tensor = |t| Tensor::from_primitive(TensorPrimitive::Float(t));
        let momentum = AdaptiveMomentumState::new(time, tensor(m), tensor(v));
        (tensor(p), Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

type Adam<B, M> = OptimizerAdaptor<FusedAdamW, M, B>;

/// The moments of one AdamW group, keyed by parameter id: the same type whatever the module (burn's
/// adaptor records a map from parameter ids), named here through the llama model.
type GroupRecord<B> = <Adam<B, Transformer<B>> as Optimizer<Transformer<B>, B>>::Record;

/// The optimizer state a checkpoint holds: the moments of both groups.
pub type OptimRecord<B> = (GroupRecord<B>, GroupRecord<B>);

/// AdamW over two parameter groups (see the module docs) of the module `M`.
pub struct TrainOptimizer<B: AutodiffBackend + ToyBackend, M: AutodiffModule<B>>
where
    B::InnerBackend: ToyBackend,
{
    decay: Adam<B, M>,
    no_decay: Adam<B, M>,
    /// Matrices stepped without decay all the same (`without_decay`).
    exempt: Vec<ParamId>,
}

impl<B: AutodiffBackend + ToyBackend, M: AutodiffModule<B>> TrainOptimizer<B, M>
where
    B::InnerBackend: ToyBackend,
{
    /// The two groups' AdamW with `config`'s betas and epsilon: one with its weight decay, one
    /// without.
    pub fn new(config: &OptimConfig) -> Self {
        let adamw = |weight_decay: f32| {
            OptimizerAdaptor::from(FusedAdamW {
                beta_1: config.beta1,
                beta_2: config.beta2,
                epsilon: config.epsilon,
                weight_decay,
            })
        };
        TrainOptimizer {
            decay: adamw(config.weight_decay),
            no_decay: adamw(0.0),
            exempt: Vec::new(),
        }
    }

    /// Step `params` without weight decay whatever their rank.
    pub fn without_decay(mut self, params: impl IntoIterator<Item = ParamId>) -> Self {
        self.exempt.extend(params);
        self
    }

    /// One AdamW step of both groups at learning rate `lr`.
    pub fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        let (decay, no_decay) = split_by_rank::<B, _>(&model, grads, &self.exempt);
        let model = self.decay.step(lr, model, decay);
        self.no_decay.step(lr, model, no_decay)
    }

    /// The moments of both groups, for a checkpoint.
    pub fn to_record(&self) -> OptimRecord<B> {
        (self.decay.to_record(), self.no_decay.to_record())
    }

    /// This optimizer with a checkpoint's moments restored.
    pub fn load_record(self, record: OptimRecord<B>) -> Self {
        TrainOptimizer {
            decay: self.decay.load_record(record.0),
            no_decay: self.no_decay.load_record(record.1),
            exempt: self.exempt,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Flex, NdArray};
    use burn::optim::AdamWConfig;
    use burn::tensor::TensorData;
    use burn::tensor::backend::Backend;

    use super::*;

    fn bits<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Vec<u32> {
        let v = t.to_data().convert::<f32>().into_vec::<f32>().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `FusedAdamW` steps exactly as burn's `AdamW`: parameters and both moments, bit for bit,
    /// over several steps, with and without weight decay.
    fn steps_like_burn<B: ToyBackend>() {
        let device = Default::default();
        for weight_decay in [0.0, 0.1] {
            let config = AdamWConfig::new()
                .with_beta_1(0.9)
                .with_beta_2(0.95)
                .with_epsilon(1e-8)
                .with_weight_decay(weight_decay);
            let burn = config.build();
            let ours = FusedAdamW {
                beta_1: 0.9,
                beta_2: 0.95,
                epsilon: 1e-8,
                weight_decay,
            };
            let values = |seed: u32| -> Vec<f32> {
                (0..70_000u32)
                    .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
                    .collect()
            };
            let tensor =
                |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [700, 100]), &device);
            let (mut p_burn, mut p_ours) = (tensor(values(1)), tensor(values(1)));
            let (mut s_burn, mut s_ours) = (None, None);
            for step in 0..4u32 {
                let g = tensor(values(step + 7));
                let lr = 1e-3 * (step + 1) as f64;
                (p_burn, s_burn) = SimpleOptimizer::<B>::step(&burn, lr, p_burn, g.clone(), s_burn);
                (p_ours, s_ours) = SimpleOptimizer::<B>::step(&ours, lr, p_ours, g, s_ours);
                let (a, b) = (s_burn.as_ref().unwrap(), s_ours.as_ref().unwrap());
                assert_eq!(
                    bits(&p_burn),
                    bits(&p_ours),
                    "param, step {step}, decay {weight_decay}"
                );
                assert_eq!(
                    bits(&a.momentum.moment_1),
                    bits(&b.momentum.moment_1),
                    "m, step {step}"
                );
                assert_eq!(
                    bits(&a.momentum.moment_2),
                    bits(&b.momentum.moment_2),
                    "v, step {step}"
                );
                assert_eq!(a.momentum.time, b.momentum.time);
            }
        }
    }

    /// With a zero gradient, AdamW's only change to a parameter is its decay: a matrix named
    /// by `without_decay` keeps its values, the other shrinks by `lr × weight_decay`.
    #[test]
    fn matrices_named_without_decay_take_none() {
        use burn::backend::Autodiff;
        use burn::nn::LinearConfig;
        type Ad = Autodiff<NdArray>;
        let device = Default::default();
        let pair = (
            LinearConfig::new(4, 3).init::<Ad>(&device),
            LinearConfig::new(4, 3).init::<Ad>(&device),
        );
        let weights = |p: &(burn::nn::Linear<Ad>, burn::nn::Linear<Ad>)| {
            let v = |t: Tensor<Ad, 2>| t.into_data().into_vec::<f32>().unwrap();
            (v(p.0.weight.val()), v(p.1.weight.val()))
        };
        let (a0, b0) = weights(&pair);
        let loss = (pair.0.weight.val().sum() + pair.1.weight.val().sum()) * 0.0;
        let grads = GradientsParams::from_grads(loss.backward(), &pair);
        let config = OptimConfig {
            weight_decay: 0.5,
            ..OptimConfig::default()
        };
        let mut optim = TrainOptimizer::<Ad, _>::new(&config).without_decay([pair.1.weight.id]);
        let pair = optim.step(0.1, pair, grads);
        let (a1, b1) = weights(&pair);
        for (x0, x1) in a0.iter().zip(&a1) {
            assert!((x1 - x0 * (1.0 - 0.1 * 0.5)).abs() < 1e-6, "{x0} → {x1}");
        }
        assert_eq!(b0, b1, "an exempt matrix was decayed");
    }

    #[test]
    fn fused_adamw_steps_like_burns_on_the_cpu_backends() {
        steps_like_burn::<Flex>(); // the native one-pass step
        steps_like_burn::<NdArray>(); // the reference body
    }
}
