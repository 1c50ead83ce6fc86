//! How well a ViT classifies a set of images: top-1 and top-5 accuracy, mean cross-entropy and
//! the confusion matrix (`toy eval MODEL --data DIR`, and the held-out evaluation of a run); and
//! the class probabilities of single images (`toy classify`).

use std::path::PathBuf;

use burn::tensor::Tensor;
use serde::Serialize;
use toy_core::rng::SplitMix64;
use toy_kernels::ToyBackend;
use toy_models::vit::Vit;

use super::to_tensors;
use crate::TrainError;
use crate::images::Transform;

/// The result of evaluating a classifier on labelled images.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImageEval {
    /// Images evaluated.
    pub images: usize,
    /// Mean cross-entropy of the true class (nats).
    pub loss: f64,
    /// Fraction whose highest-scoring class is the true one.
    pub top1: f64,
    /// Fraction whose true class is among the five highest-scoring (all of them when a model
    /// has five classes or fewer).
    pub top5: f64,
    /// `confusion[t][p]`: images of true class `t` predicted as class `p`.
    pub confusion: Vec<Vec<usize>>,
}

/// Evaluate `model` on `samples` (transformed by `transform`, without augmentation), `batch`
/// images per forward pass.
pub fn evaluate_images<B: ToyBackend>(
    model: &Vit<B>,
    samples: &[(PathBuf, usize)],
    transform: &Transform,
    batch: usize,
) -> Result<ImageEval, TrainError> {
    let n_classes = model.n_classes();
    let device = model.device();
    let mut confusion = vec![vec![0usize; n_classes]; n_classes];
    let (mut nll, mut top1, mut top5) = (0.0f64, 0usize, 0usize);
    for chunk in samples.chunks(batch.max(1)) {
        // No augmentation: the transform draws nothing from the generator.
        let (images, _) = to_tensors::<B>(chunk, transform, &device, |_| SplitMix64::new(0))?;
        for (row, (_, truth)) in log_softmax_rows(model.forward(images))?.iter().zip(chunk) {
            let truth = *truth;
            if truth >= n_classes {
                return Err(TrainError::Data(format!(
                    "the data has class {truth} but the model only {n_classes} classes"
                )));
            }
            nll -= row[truth] as f64;
            let better = row.iter().filter(|&&v| v > row[truth]).count();
            top1 += usize::from(better == 0);
            top5 += usize::from(better < 5);
            confusion[truth][argmax(row)] += 1;
        }
    }
    let n = samples.len().max(1) as f64;
    Ok(ImageEval {
        images: samples.len(),
        loss: nll / n,
        top1: top1 as f64 / n,
        top5: top5 as f64 / n,
        confusion,
    })
}

/// Class probabilities of each image of `images` (`[n, 3, h, w]`, transformed): a row per image.
pub fn probabilities<B: ToyBackend>(
    model: &Vit<B>,
    images: Tensor<B, 4>,
) -> Result<Vec<Vec<f32>>, TrainError> {
    Ok(log_softmax_rows(model.forward(images))?
        .into_iter()
        .map(|row| row.into_iter().map(f32::exp).collect())
        .collect())
}

/// The rows of `logits` (`[n, classes]`) as log-probabilities on the host, computed in f64.
fn log_softmax_rows<B: ToyBackend>(logits: Tensor<B, 2>) -> Result<Vec<Vec<f32>>, TrainError> {
    let [_, c] = logits.dims();
    let values = logits
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| TrainError::Backend(format!("cannot read the logits: {e:?}")))?;
    Ok(values
        .chunks(c)
        .map(|row| {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            let log_z = max + sum.ln();
            row.iter().map(|&v| (v as f64 - log_z) as f32).collect()
        })
        .collect())
}

/// Index of the largest value (the first of equals).
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0
}
