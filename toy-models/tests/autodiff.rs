//! Training differentiates the model through burn's `Autodiff` backend, which runs the reference
//! bodies of the `ToyBackend` ops (and the closed-form backward of `cross_entropy`, the loss
//! training uses). Check its gradients of that next-token cross-entropy against
//! central finite differences on a tiny model, for a coordinate of every kind of parameter
//! (embedding, attention projections behind RoPE and GQA, norms, MLP, output head).
//!
//! In f64 (NdArray) the check is tight. Its step is not tiny because burn computes `sigmoid` (in
//! SiLU) through f32 on every backend (`burn-backend` `ActivationOps::sigmoid`), which leaves
//! ~1e-8 of noise in the loss; a step of 1e-2 with Richardson extrapolation keeps both that noise
//! and the truncation error near 1e-6 (measured: relative errors 1e-5 … 2e-4, against a
//! tolerance of 1e-3; a wrong gradient is off by far more). In f32 (Flex, what `--backend cpu`
//! trains on) the check is loose (measured ≤ 2.6e-3, tolerance 1e-2), to catch a wrong or
//! missing gradient rather than rounding.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::{AutodiffModule, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::llama::{Block, Ffn, Mlp};
use toy_models::{LlamaConfig, QLinear, Transformer};

#[path = "../../test-support/next_token_loss.rs"]
mod next_token_loss;
use next_token_loss::next_token_loss as loss;

/// A parameter of the model, and one coordinate of it (flat, row-major).
#[derive(Debug, Clone, Copy)]
enum Which {
    Embedding,
    Wq(usize),
    Wk(usize),
    Wv(usize),
    Wo(usize),
    Gate(usize),
    Down(usize),
    Output,
    AttnNorm(usize),
    FfnNorm(usize),
    OutputNorm,
}

fn dense<B: Backend>(q: &mut QLinear<B>) -> &mut Param<Tensor<B, 2>> {
    match q {
        QLinear::Dense(p) => p,
        _ => unreachable!("LlamaConfig::init makes dense weights"),
    }
}

/// The chosen parameter: a matrix or a vector.
enum ParamMut<'a, B: Backend> {
    Matrix(&'a mut Param<Tensor<B, 2>>),
    Vector(&'a mut Param<Tensor<B, 1>>),
}

fn param<B: Backend>(model: &mut Transformer<B>, which: Which) -> ParamMut<'_, B> {
    use ParamMut::{Matrix, Vector};
    match which {
        Which::Embedding => {
            Matrix(&mut model.token_embd.dense_mut().expect("a dense table").weight)
        }
        Which::Wq(l) => Matrix(dense(&mut model.blocks[l].attn.wq)),
        Which::Wk(l) => Matrix(dense(&mut model.blocks[l].attn.wk)),
        Which::Wv(l) => Matrix(dense(&mut model.blocks[l].attn.wv)),
        Which::Wo(l) => Matrix(dense(&mut model.blocks[l].attn.wo)),
        Which::Gate(l) => Matrix(dense(&mut mlp(&mut model.blocks[l]).gate)),
        Which::Down(l) => Matrix(dense(&mut mlp(&mut model.blocks[l]).down)),
        Which::Output => Matrix(dense(model.output.as_mut().expect("an untied head"))),
        Which::AttnNorm(l) => Vector(&mut model.blocks[l].attn_norm.gamma),
        Which::FfnNorm(l) => Vector(&mut model.blocks[l].ffn_norm.gamma),
        Which::OutputNorm => Vector(&mut model.output_norm.gamma),
    }
}

/// The dense MLP of a block (these tests build dense models).
fn mlp<B: Backend>(block: &mut Block<B>) -> &mut Mlp<B> {
    match &mut block.ffn {
        Ffn::Dense(m) => m,
        Ffn::Moe(_) => unreachable!("the test model is dense"),
    }
}

/// Add `delta` to coordinate `idx` (flat, row-major) of the chosen parameter.
fn bump<B: Backend>(model: &mut Transformer<B>, which: Which, idx: usize, delta: f64) {
    fn onehot<B: Backend, const D: usize>(
        like: &Tensor<B, D>,
        idx: usize,
        delta: f64,
    ) -> Tensor<B, D> {
        let shape = like.shape();
        let mut v = vec![0.0f64; shape.num_elements()];
        v[idx] = delta;
        Tensor::from_data(TensorData::new(v, shape), &like.device())
    }
    match param(model, which) {
        ParamMut::Matrix(p) => {
            let v = p.val();
            *p = Param::from_tensor(v.clone() + onehot(&v, idx, delta));
        }
        ParamMut::Vector(p) => {
            let v = p.val();
            *p = Param::from_tensor(v.clone() + onehot(&v, idx, delta));
        }
    }
}

/// The analytic gradient of the chosen parameter, flat, on the host.
fn grad_of<B: AutodiffBackend>(
    model: &Transformer<B>,
    which: Which,
    grads: &B::Gradients,
) -> Vec<f64> {
    let mut model = model.clone();
    let data = match param(&mut model, which) {
        ParamMut::Matrix(p) => p.val().grad(grads).map(|g| g.into_data()),
        ParamMut::Vector(p) => p.val().grad(grads).map(|g| g.into_data()),
    };
    data.expect("every parameter gets a gradient")
        .iter::<f64>()
        .collect()
}

fn check<B: AutodiffBackend + ToyBackend>(eps: f64, tolerance: f64)
where
    B::InnerBackend: ToyBackend,
{
    let device = Default::default();
    B::seed(&device, 11);
    // Two layers, GQA (4 query heads on 2 KV heads), partial widths everywhere, untied output.
    let config = LlamaConfig::new(2, 16, 4, 2, 4, 24, 19, 32).with_tied_embeddings(false);
    let model: Transformer<B> = config.init(&device);
    let tokens: Vec<i64> = vec![1, 5, 9, 2, 17, 3, 3, 8, 0, 12, 4, 18, 6, 11];
    let batch = 2;

    let grads = loss(&model, &tokens, batch).backward();
    let inner = model.valid();
    let loss_at = |m: &Transformer<B::InnerBackend>| -> f64 {
        loss(m, &tokens, batch).into_scalar().elem::<f64>()
    };

    let cases = [
        (Which::Embedding, 5 * 16 + 3),
        (Which::Wq(0), 7),
        (Which::Wk(1), 33),
        (Which::Wv(0), 20),
        (Which::Wo(1), 41),
        (Which::Gate(0), 100),
        (Which::Down(1), 200),
        (Which::Output, 12 * 16 + 9),
        (Which::AttnNorm(1), 4),
        (Which::FfnNorm(0), 11),
        (Which::OutputNorm, 2),
    ];
    for (which, idx) in cases {
        let analytic = grad_of(&model, which, &grads)[idx];
        let shifted = |delta: f64| {
            let mut m = inner.clone();
            bump(&mut m, which, idx, delta);
            loss_at(&m)
        };
        let central = |e: f64| (shifted(e) - shifted(-e)) / (2.0 * e);
        // Richardson extrapolation of two central differences: error O(ε⁴) instead of O(ε²).
        let numeric = (4.0 * central(eps / 2.0) - central(eps)) / 3.0;
        let err = (analytic - numeric).abs() / numeric.abs().max(1e-3);
        assert!(
            err < tolerance,
            "{which:?}[{idx}]: autodiff {analytic:.9}, finite difference {numeric:.9}, rel err {err:.2e}"
        );
        // A zero gradient would pass trivially; these coordinates all influence the loss.
        assert!(
            numeric.abs() > 1e-6,
            "{which:?}[{idx}] does not move the loss"
        );
    }
}

#[test]
fn gradients_match_finite_differences_f64() {
    check::<Autodiff<NdArray<f64>>>(1e-2, 1e-3);
}

#[test]
fn gradients_match_finite_differences_flex_f32() {
    check::<Autodiff<Flex>>(5e-2, 1e-2);
}
