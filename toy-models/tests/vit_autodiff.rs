//! The ViT's gradients under burn's `Autodiff` (toy's attention, linear and cross-entropy
//! backwards, burn's Conv2d, LayerNorm and GELU ones, and the position-embedding resampling)
//! against central finite differences of its loss, for coordinates of every kind of parameter.
//!
//! The loss is the mean cross-entropy of a batch at the model's own 8×8 size plus that of one
//! at 12×12, whose position embeddings are resampled, so that the gradient through
//! the resampling is checked too. In f64 (NdArray) the check is tight: tolerance 1e-3 relative to
//! max(|fd|, [`FLOOR`]) (measured ≤ 2.7e-4; it cannot tell burn's own `gelu` backward, the
//! tanh approximation's derivative, from the exact one: 3.4e-4 with it); in f32 (Flex, what `--backend cpu` trains on) it is loose
//! (1e-2, measured ≤ 4.4e-4), to catch a wrong or missing gradient rather than rounding.
//!
//! A test binary of its own, not a module of `autodiff.rs`: that one differentiates on
//! `NdArray<f64>`, and burn keeps one default float type per device, which `NdArray<f32>` (the
//! seeded init here) and `NdArray<f64>` share — in one process, whichever runs first sets it.

use std::collections::HashMap;
use std::convert::Infallible;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::module::Param;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::gpt2::{LayerNorm, Linear};
use toy_models::{QLinear, Vit, VitConfig};

/// Gradients smaller than this are compared absolutely: the loss carries ~1e-6 of noise even
/// on the f64 backend (some ops round through f32), which leaves ~5e-5 in a central difference.
const FLOOR: f64 = 5e-2;

fn config() -> VitConfig {
    // 2×2 patches of 4 pixels, 2 blocks of 2 heads.
    VitConfig::new(8, 4, 16, 2, 2, 32, 5)
}

/// The parameters, by timm name: a seeded random model, every tensor perturbed so that
/// LayerNorms and biases are not at their trivial init.
fn parameters() -> HashMap<String, Vec<f32>> {
    let device = Default::default();
    NdArray::<f32>::seed(&device, 23);
    let model = config().init::<NdArray<f32>>(&device);
    model
        .timm_tensors()
        .into_iter()
        .enumerate()
        .map(|(k, (name, _, v))| {
            let v = v
                .iter()
                .enumerate()
                .map(|(i, x)| x + (((i * 7 + k * 13) % 17) as f32 / 17.0 - 0.5) * 0.3)
                .collect();
            (name, v)
        })
        .collect()
}

fn build<B: ToyBackend>(values: &HashMap<String, Vec<f32>>, device: &B::Device) -> Vit<B> {
    config()
        .build(device, |name, _, _| {
            Ok::<_, Infallible>(values[name].clone())
        })
        .unwrap()
}

/// Deterministic images and labels: a batch of 3 at 8×8 and one of 2 at 12×12.
fn batches<B: Backend>(device: &B::Device) -> Vec<(Tensor<B, 4>, Tensor<B, 1, Int>)> {
    [(3usize, 8usize), (2, 12)]
        .into_iter()
        .map(|(n, side)| {
            let len = n * 3 * side * side;
            let pixels: Vec<f32> = (0..len)
                .map(|i| (((i * 2654435761usize) >> 7) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let labels: Vec<i64> = (0..n as i64).map(|i| (i * 3 + side as i64) % 5).collect();
            (
                Tensor::from_data(TensorData::new(pixels, [n, 3, side, side]), device),
                Tensor::from_data(TensorData::new(labels, [n]), device),
            )
        })
        .collect()
}

fn loss<B: ToyBackend>(model: &Vit<B>, device: &B::Device) -> Tensor<B, 1> {
    batches::<B>(device)
        .into_iter()
        .map(|(x, y)| model.loss(x, y))
        .reduce(|a, b| a + b)
        .unwrap()
}

fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_data().convert::<f64>().into_vec::<f64>().unwrap()[0]
}

fn flat<B: Backend, const D: usize>(t: Option<Tensor<B, D>>, name: &str) -> Vec<f64> {
    let t = t.unwrap_or_else(|| panic!("{name}: no gradient"));
    t.into_data().convert::<f64>().into_vec::<f64>().unwrap()
}

fn linear_grad<B: AutodiffBackend>(l: &Linear<B>, part: &str, g: &B::Gradients) -> Vec<f64> {
    match part {
        "weight" => match &l.weight {
            QLinear::Dense(w) => flat(w.grad(g), part),
            QLinear::Packed(_) => unreachable!("init makes dense weights"),
        },
        _ => flat(l.bias.grad(g), part),
    }
}

fn norm_grad<B: AutodiffBackend>(n: &LayerNorm<B>, part: &str, g: &B::Gradients) -> Vec<f64> {
    let p: &Param<Tensor<B, 1>> = if part == "weight" { &n.weight } else { &n.bias };
    flat(p.grad(g), part)
}

/// The gradient of the parameter `name` (timm's name).
fn grad<B: AutodiffBackend>(m: &Vit<B>, g: &B::Gradients, name: &str) -> Vec<f64> {
    let (stem, part) = name.rsplit_once('.').unwrap_or((name, ""));
    match stem {
        "cls_token" => flat(m.cls_token.grad(g), name),
        "pos_embed" => flat(m.pos_embed.grad(g), name),
        "patch_embed.proj" if part == "weight" => flat(m.patch_embed.weight.grad(g), name),
        "patch_embed.proj" => flat(m.patch_embed.bias.as_ref().unwrap().grad(g), name),
        "norm" => norm_grad(&m.norm, part, g),
        "head" => linear_grad(&m.head, part, g),
        _ => {
            let rest = stem.strip_prefix("blocks.").unwrap();
            let (i, layer) = rest.split_once('.').unwrap();
            let b = &m.blocks[i.parse::<usize>().unwrap()];
            match layer {
                "norm1" => norm_grad(&b.norm1, part, g),
                "norm2" => norm_grad(&b.norm2, part, g),
                "attn.qkv" => linear_grad(&b.qkv, part, g),
                "attn.proj" => linear_grad(&b.proj, part, g),
                "mlp.fc1" => linear_grad(&b.fc1, part, g),
                "mlp.fc2" => linear_grad(&b.fc2, part, g),
                other => panic!("unknown layer {other}"),
            }
        }
    }
}

/// Compare the autodiff gradient with central differences of step `eps` at two coordinates of
/// every parameter; returns the largest relative error.
fn check<B: AutodiffBackend + ToyBackend>(backend: &str, eps: f32, tolerance: f64) {
    let device = B::Device::default();
    let values = parameters();
    let model = build::<B>(&values, &device);
    let grads = loss(&model, &device).backward();
    let inner = |v: &HashMap<String, Vec<f32>>| scalar(loss(&build::<B>(v, &device), &device));
    let mut worst = 0.0f64;
    let mut names: Vec<&String> = values.keys().collect();
    names.sort();
    for name in names {
        let analytic = grad(&model, &grads, name);
        let n = values[name].len();
        for idx in [0, n / 2 + 1].into_iter().filter(|&i| i < n) {
            // Central differences at steps eps and eps/2, Richardson-extrapolated (error
            // O(eps⁴)): the step can then be large enough that the ops burn computes in f32
            // even on an f64 backend (see autodiff.rs) leave little noise in the quotient.
            let central = |h: f32| {
                let mut v = values.clone();
                let x = values[name][idx];
                let (up, down) = (x + h, x - h);
                v.get_mut(name).unwrap()[idx] = up;
                let l_up = inner(&v);
                v.get_mut(name).unwrap()[idx] = down;
                let l_down = inner(&v);
                // The step actually taken (the f32 sums round).
                (l_up - l_down) / (up as f64 - down as f64)
            };
            let fd = (4.0 * central(eps / 2.0) - central(eps)) / 3.0;
            let err = (analytic[idx] - fd).abs() / fd.abs().max(FLOOR);
            worst = worst.max(err);
            assert!(
                err <= tolerance,
                "{backend}: d loss / d {name}[{idx}]: autodiff {} vs finite differences {fd} (relative error {err:.2e})",
                analytic[idx]
            );
        }
    }
    eprintln!("{backend}: largest relative error {worst:.2e} (tolerance {tolerance:.0e})");
}

#[test]
fn gradients_match_finite_differences_f64() {
    check::<Autodiff<NdArray<f64>>>("ndarray f64", 4e-2, 1e-3);
}

#[test]
fn gradients_match_finite_differences_flex_f32() {
    check::<Autodiff<Flex>>("cpu f32", 4e-2, 1e-2);
}
