//! The ViT checks of `vit.rs` against timm, generic over the backend (`wgpu.rs` runs them on
//! the cubecl kernels).

use std::path::PathBuf;

use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use safetensors::SafeTensors;
use toy_kernels::{AttentionOptions, ToyBackend};
use toy_models::vit::timm::load_safetensors;
use toy_models::{Vit, VitConfig};

/// The logits' agreement with timm's required on every backend (the bound).
pub const TOLERANCE: f32 = 1e-4;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/vit")).join(name)
}

/// `name` of the fixture's inputs and expected outputs: its values and shape.
pub fn io(name: &str) -> (Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(fixture("timm-vit.io.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let values = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (values, t.shape().to_vec())
}

pub fn logits<B: ToyBackend>(model: &Vit<B>, images: &str, device: &B::Device) -> Vec<f32> {
    let (values, shape) = io(images);
    let shape: [usize; 4] = shape.try_into().unwrap();
    let x = Tensor::<B, 4>::from_data(TensorData::new(values, shape), device);
    model
        .forward(x)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// timm's logits at 32×32 and at 48×48 (position embeddings resampled) within [`TOLERANCE`].
pub fn matches_timm<B: ToyBackend>(backend: &str) {
    let device = B::Device::default();
    let loaded = load_safetensors::<B>(&fixture("timm-vit.safetensors"), &device).unwrap();
    assert_eq!(
        loaded.config,
        VitConfig::new(32, 8, 128, 2, 2, 256, 10),
        "the shape read from timm's tensors (heads: timm's 64-wide)"
    );
    for (images, expected) in [("images", "logits"), ("images_48", "logits_48")] {
        let got = logits(&loaded.model, images, &device);
        let diff = max_abs_diff(&got, &io(expected).0);
        eprintln!("{backend}: {expected} max |toy - timm| = {diff:.3e}");
        assert!(
            diff <= TOLERANCE,
            "{backend}: {expected} differ from timm's by {diff}"
        );
    }
}

/// Non-causal attention (`AttentionOptions::full`) on each backend equals burn's own attention
/// without a mask.
pub fn full_attention_is_unmasked<B: ToyBackend>(backend: &str) {
    let device = B::Device::default();
    let shape = [2, 3, 17, 16];
    let make = |seed: usize| {
        let values: Vec<f32> = (0..shape.iter().product::<usize>())
            .map(|i| (((i * 7919 + seed * 104729) % 1000) as f32 / 500.0 - 1.0) * 1.5)
            .collect();
        Tensor::<B, 4>::from_data(TensorData::new(values, shape), &device)
    };
    let (q, k, v) = (make(1), make(2), make(3));
    let scale = 0.25f32;
    let expected = burn::tensor::module::attention(
        q.clone(),
        k.clone(),
        v.clone(),
        None,
        None,
        burn::tensor::ops::AttentionModuleOptions {
            scale: Some(scale as f64),
            softcap: None,
            is_causal: false,
        },
    );
    let got = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(<B as ToyBackend>::attention(
        q.into_primitive().tensor(),
        k.into_primitive().tensor(),
        v.into_primitive().tensor(),
        AttentionOptions::full(scale, 17),
    )));
    let diff = max_abs_diff(
        &got.into_data().convert::<f32>().into_vec().unwrap(),
        &expected.into_data().convert::<f32>().into_vec().unwrap(),
    );
    assert!(diff < 1e-5, "{backend}: full attention differs by {diff}");
}

/// timm's own `vit_tiny_patch16_224` (seeded random init, 23 MB: not committed) from the folder
/// `TOY_VIT224_DIR` that `make_vit_fixtures.py --tiny224 DIR` writes: its logits on 8 images
/// within [`TOLERANCE`].
pub fn vit224_matches_timm<B: ToyBackend>(backend: &str) {
    let dir = PathBuf::from(std::env::var("TOY_VIT224_DIR").expect("TOY_VIT224_DIR"));
    let bytes = std::fs::read(dir.join("vit_tiny_patch16_224.io.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let read = |name: &str| -> Vec<f32> {
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let (images, expected) = (read("images"), read("logits"));
    let device = B::Device::default();
    let loaded =
        load_safetensors::<B>(&dir.join("vit_tiny_patch16_224.safetensors"), &device).unwrap();
    assert_eq!(loaded.config, VitConfig::timm_vit_tiny_patch16_224());
    let x = Tensor::<B, 4>::from_data(TensorData::new(images, [8, 3, 224, 224]), &device);
    let start = std::time::Instant::now();
    let got: Vec<f32> = loaded
        .model
        .forward(x)
        .into_data()
        .convert::<f32>()
        .into_vec()
        .unwrap();
    let diff = max_abs_diff(&got, &expected);
    eprintln!(
        "vit_tiny_patch16_224 {backend}: max |toy - timm| = {diff:.3e} ({:.2} s for 8 images)",
        start.elapsed().as_secs_f64()
    );
    assert!(diff <= TOLERANCE, "{backend}: {diff}");
}
