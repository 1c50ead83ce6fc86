//! AdamW with weight decay on matrices only, and global gradient-norm clipping.
//!
//! burn 0.21's `AdamW` applies one weight decay to every parameter it steps, and has no
//! parameter groups. But its optimizer adaptor only steps the parameters that have a gradient in
//! the `GradientsParams` it is given, so two AdamW instances — one with the configured decay,
//! one with none — each given the gradients of their own parameters, make the two groups that
//! GPT-style training uses: decay on 2-D weights (embeddings, projections, the output head), none
//! on the RMSNorm gains. Each instance keeps the moments of its own parameters.
//!
//! Clipping is by the global norm over all gradients (burn's `GradientClipping::Norm` clips each
//! parameter's gradient on its own, which changes the update's direction).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};
use toy_kernels::ToyBackend;
use toy_models::Transformer;

use crate::config::OptimConfig;

/// Apply `f` to every gradient of `grads` that belongs to a parameter of `model`.
fn for_each_grad<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    f: &mut dyn FnMut(GradRef<'_, B>),
) {
    struct Visit<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        f: &'a mut dyn FnMut(GradRef<'_, B>),
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Visit<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let n = g.shape().num_elements();
                let flat: Tensor<B::InnerBackend, 1> = g.clone().reshape([n]);
                let mut replacement = None;
                (self.f)(GradRef {
                    flat,
                    replace: &mut replacement,
                });
                let g = match replacement {
                    Some(r) => r.reshape(g.shape()),
                    None => g,
                };
                self.grads.register(param.id, g);
            }
        }
    }
    model.visit(&mut Visit { grads, f });
}

/// One gradient, flattened; set `replace` to change it.
struct GradRef<'a, B: AutodiffBackend> {
    flat: Tensor<B::InnerBackend, 1>,
    replace: &'a mut Option<Tensor<B::InnerBackend, 1>>,
}

/// The global L2 norm of the gradients of `model`'s parameters.
pub fn grad_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
) -> f64 {
    let mut sum: Option<Tensor<B::InnerBackend, 1>> = None;
    for_each_grad::<B, M>(model, grads, &mut |g| {
        let sq = g.flat.square().sum();
        sum = Some(match sum.take() {
            Some(s) => s + sq,
            None => sq,
        });
    });
    // One read back to the host per step.
    sum.map_or(0.0, |s| s.into_scalar().elem::<f64>().sqrt())
}

/// Scale every gradient by `factor`.
pub fn scale_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    for_each_grad::<B, M>(model, grads, &mut |g| {
        *g.replace = Some(g.flat.mul_scalar(factor));
    });
}

/// Split `grads` into the gradients of matrices and those of vectors.
fn split_by_rank<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mut grads: GradientsParams,
) -> (GradientsParams, GradientsParams) {
    struct Split {
        all: GradientsParams,
        matrices: GradientsParams,
        vectors: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Split {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.all.remove::<B::InnerBackend, D>(param.id) {
                let to = if D >= 2 {
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
    };
    model.visit(&mut split);
    (split.matrices, split.vectors)
}

type Adam<B, M> = OptimizerAdaptor<AdamW, M, B>;

/// The moments of one AdamW group, keyed by parameter id: the same type whatever the module (burn's
/// adaptor records a map from parameter ids), named here through the llama model.
type GroupRecord<B> = <Adam<B, Transformer<B>> as Optimizer<Transformer<B>, B>>::Record;

/// The optimizer state a checkpoint holds: the moments of both groups.
pub type OptimRecord<B> = (GroupRecord<B>, GroupRecord<B>);

/// AdamW over two parameter groups (see the module docs) of the module `M`.
pub struct TrainOptimizer<B: AutodiffBackend + ToyBackend, M: AutodiffModule<B>> {
    decay: Adam<B, M>,
    no_decay: Adam<B, M>,
}

impl<B: AutodiffBackend + ToyBackend, M: AutodiffModule<B>> TrainOptimizer<B, M> {
    pub fn new(config: &OptimConfig) -> Self {
        let adamw = |decay: f32| {
            AdamWConfig::new()
                .with_beta_1(config.beta1)
                .with_beta_2(config.beta2)
                .with_epsilon(config.epsilon)
                .with_weight_decay(decay)
                .init::<B, M>()
        };
        TrainOptimizer {
            decay: adamw(config.weight_decay),
            no_decay: adamw(0.0),
        }
    }

    /// One AdamW step of both groups at learning rate `lr`.
    pub fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        let (decay, no_decay) = split_by_rank::<B, _>(&model, grads);
        let model = self.decay.step(lr, model, decay);
        self.no_decay.step(lr, model, no_decay)
    }

    pub fn to_record(&self) -> OptimRecord<B> {
        (self.decay.to_record(), self.no_decay.to_record())
    }

    pub fn load_record(self, record: OptimRecord<B>) -> Self {
        TrainOptimizer {
            decay: self.decay.load_record(record.0),
            no_decay: self.no_decay.load_record(record.1),
        }
    }
}
