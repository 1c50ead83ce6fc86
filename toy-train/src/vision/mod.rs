//! Image classification with a ViT (`toy_models::vit`): a run's configuration, its images split
//! into training and held-out sets, seeded augmented batches, the training loop
//! ([`train::train_vision`]: `toy train --arch vit-tiny`) and evaluation ([`eval`]: `toy eval
//! MODEL --data DIR`, `toy classify`).
//!
//! Images are normalized with ImageNet's mean and standard deviation, as timm's models expect,
//! so a model trained here and a timm model are fed the same way.

pub mod eval;
pub mod train;

use std::path::PathBuf;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};
use toy_core::rng::SplitMix64;
use toy_models::vit::VitConfig;

use crate::TrainError;
use crate::config::OptimConfig;
use crate::data::permutation;
use crate::images::{Augment, IMAGENET_MEAN, IMAGENET_STD, ImageFolder, Transform};

/// Where a run's images come from and how training shows them to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageDataConfig {
    /// Training images: a folder of class folders (torchvision's `ImageFolder`).
    pub train: PathBuf,
    /// Held-out images, a folder with the same class folders. `None`: `val_fraction` of each
    /// class of `train` is held out instead (a seeded draw).
    pub val: Option<PathBuf>,
    /// Fraction of each class of `train` held out when there is no `val` folder.
    pub val_fraction: f64,
    /// Training augmentation: a random crop of the image padded by this many zero pixels on
    /// each side (0: no shift).
    pub crop_padding: usize,
    /// Training augmentation: random horizontal flips (off for digits and text).
    pub flip: bool,
}

/// Everything that decides an image-classification run (`runs/<id>/config.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionConfig {
    /// The model; `vit.n_classes` is the number of class folders.
    pub vit: VitConfig,
    /// Class names (the class folders) in class-id order; written into the model.
    pub labels: Vec<String>,
    /// The images and their augmentation.
    pub data: ImageDataConfig,
    /// Steps, batch (images per step), learning rates, warmup, weight decay, clipping;
    /// `seq_len` is 1 (an image is one prediction) and `grad_accum` 1.
    pub optim: OptimConfig,
    /// Evaluate on the held-out images every N steps (0: only at the end).
    pub eval_every: usize,
    /// Write a checkpoint every N steps (0: only at the end).
    pub checkpoint_every: usize,
    /// A timm `.safetensors` or ViT `.gguf` to fine-tune (its classifier head is drawn anew
    /// when its class count is not the data's).
    pub base: Option<PathBuf>,
    /// Seed of the weights, the image order and the augmentation.
    pub seed: u64,
}

impl VisionConfig {
    /// Check the run before it starts: the model and optimizer settings (one device, no gradient
    /// accumulation), one label per class, and the held-out fraction.
    pub fn check(&self) -> Result<(), TrainError> {
        self.vit.check().map_err(TrainError::Config)?;
        self.optim.check()?;
        if self.optim.grad_accum != 1 || self.optim.devices != 1 {
            return Err(TrainError::Config(
                "image classification trains on one device without gradient accumulation".into(),
            ));
        }
        if self.labels.len() != self.vit.n_classes {
            return Err(TrainError::Config(format!(
                "{} labels for a model of {} classes",
                self.labels.len(),
                self.vit.n_classes
            )));
        }
        if self.data.val.is_none() && !(0.0..1.0).contains(&self.data.val_fraction) {
            return Err(TrainError::Config(
                "the held-out fraction must be in [0, 1)".into(),
            ));
        }
        Ok(())
    }

    /// The training transform: the model's image size, seeded crop (and flip) augmentation.
    pub fn train_transform(&self) -> Transform {
        Transform {
            augment: Some(Augment {
                padding: self.data.crop_padding,
                flip: self.data.flip,
            }),
            ..eval_transform(&self.vit)
        }
    }
}

/// How a model of shape `vit` sees an image at evaluation: resized so the shorter side is the
/// model's image size, centre-cropped, ImageNet-normalized.
pub fn eval_transform(vit: &VitConfig) -> Transform {
    Transform {
        size: vit.image_size,
        mean: IMAGENET_MEAN,
        std: IMAGENET_STD,
        augment: None,
    }
}

/// Images with their class ids.
pub type Samples = Vec<(PathBuf, usize)>;

/// A run's images: the classes, the training images and the held-out ones.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSplit {
    /// Class names, sorted: a class id is a position here.
    pub classes: Vec<String>,
    /// The training images.
    pub train: Samples,
    /// The held-out images.
    pub val: Samples,
}

impl ImageSplit {
    /// Read the folders of `data` (nothing is decoded yet). Without a `val` folder, each class
    /// gives `round(val_fraction × its images)` of them, drawn with `seed`, to the held-out set
    /// (at least one training image stays).
    pub fn open(data: &ImageDataConfig, seed: u64) -> Result<Self, TrainError> {
        let train = ImageFolder::open(&data.train)?;
        let Some(val_dir) = &data.val else {
            let mut split = ImageSplit {
                classes: train.classes.clone(),
                train: Vec::new(),
                val: Vec::new(),
            };
            for class in 0..train.classes.len() {
                let files: Vec<&PathBuf> = train
                    .samples
                    .iter()
                    .filter(|(_, c)| *c == class)
                    .map(|(p, _)| p)
                    .collect();
                let held = ((files.len() as f64 * data.val_fraction).round() as usize)
                    .min(files.len() - 1);
                let order = permutation(files.len(), seed ^ (class as u64 + 1));
                let mut val: Vec<usize> = order[..held].to_vec();
                val.sort();
                for (i, path) in files.into_iter().enumerate() {
                    let to = if val.binary_search(&i).is_ok() {
                        &mut split.val
                    } else {
                        &mut split.train
                    };
                    to.push((path.clone(), class));
                }
            }
            return Ok(split);
        };
        let val = ImageFolder::open(val_dir)?;
        if val.classes != train.classes {
            return Err(TrainError::Data(format!(
                "{}: its class folders {:?} are not those of {} ({:?})",
                val_dir.display(),
                val.classes,
                data.train.display(),
                train.classes
            )));
        }
        Ok(ImageSplit {
            classes: train.classes,
            train: train.samples,
            val: val.samples,
        })
    }

    /// The training batch of optimizer step `step` (from 0): `batch` images of a seeded
    /// shuffle of the training set (a new shuffle each epoch, the last partial batch of an
    /// epoch skipped), each transformed with its own seeded crop and flip; and the epoch. A
    /// function of the seed and the step alone, so a resumed run sees what it would have seen.
    pub fn train_batch<B: Backend>(
        &self,
        transform: &Transform,
        seed: u64,
        step: usize,
        batch: usize,
        device: &B::Device,
    ) -> Result<(Tensor<B, 4>, Tensor<B, 1, Int>, u64), TrainError> {
        let per_epoch = self.train.len() / batch;
        if per_epoch == 0 {
            return Err(TrainError::Data(format!(
                "{} training images are fewer than one batch of {batch}; lower --batch-size",
                self.train.len()
            )));
        }
        let (epoch, k) = ((step / per_epoch) as u64, step % per_epoch);
        let order = permutation(
            self.train.len(),
            seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let picked = order[k * batch..(k + 1) * batch]
            .iter()
            .map(|&i| &self.train[i]);
        let draw = |i: usize| {
            SplitMix64::new(seed ^ ((step * batch + i) as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
        };
        let (images, labels) = to_tensors(picked, transform, device, draw)?;
        Ok((images, labels, epoch))
    }
}

/// `samples` transformed (image `i` augmented with `rng(i)`) into an image batch
/// `[n, 3, size, size]` and its labels.
pub fn to_tensors<'a, B: Backend>(
    samples: impl IntoIterator<Item = &'a (PathBuf, usize)>,
    transform: &Transform,
    device: &B::Device,
    rng: impl Fn(usize) -> SplitMix64,
) -> Result<(Tensor<B, 4>, Tensor<B, 1, Int>), TrainError> {
    let s = transform.size;
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for (i, (path, class)) in samples.into_iter().enumerate() {
        pixels.extend(transform.load(path, &mut rng(i))?);
        labels.push(*class as i64);
    }
    let n = labels.len();
    Ok((
        Tensor::from_data(TensorData::new(pixels, [n, 3, s, s]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    ))
}

/// Class names of a model: its labels, or `class 0`, `class 1`, … when it has none.
pub fn class_names(labels: Option<&[String]>, n_classes: usize) -> Vec<String> {
    match labels {
        Some(l) if l.len() == n_classes => l.to_vec(),
        _ => (0..n_classes).map(|i| format!("class {i}")).collect(),
    }
}
