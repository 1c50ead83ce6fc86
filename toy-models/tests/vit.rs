//! toy's ViT against timm: a tiny seeded timm `VisionTransformer` saved by timm
//! (`fixtures/vit/timm-vit.safetensors`, made by `fixtures/vit/make_vit_fixtures.py`) loaded by
//! toy must give timm's logits on timm's 8 images within 1e-4 on every backend, also at another
//! image size (position embeddings resampled as timm resamples them); the file toy writes back
//! must reload to the same model; toy's `vit_tiny_patch16_224` preset must have exactly timm's
//! tensors; and bad files must be one-line errors naming the file.

use std::path::PathBuf;

use burn::backend::{Flex, NdArray};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use burn_cubecl::CubeBackend;
use cubecl::wgpu::WgpuRuntime;
use safetensors::SafeTensors;
use toy_kernels::{AttentionOptions, ToyBackend};
use toy_models::vit::timm::{VitFileError, load_safetensors, read_safetensors};
use toy_models::{Vit, VitConfig};

type Wgpu = CubeBackend<WgpuRuntime, f32, i32, u32>;

/// The logits' agreement with timm's required on every backend (the bound).
const TOLERANCE: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/vit")).join(name)
}

/// `name` of the fixture's inputs and expected outputs: its values and shape.
fn io(name: &str) -> (Vec<f32>, Vec<usize>) {
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

fn logits<B: ToyBackend>(model: &Vit<B>, images: &str, device: &B::Device) -> Vec<f32> {
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

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// timm's logits at 32×32 and at 48×48 (position embeddings resampled) within [`TOLERANCE`].
fn matches_timm<B: ToyBackend>(backend: &str) {
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

#[test]
fn logits_match_timm_on_cpu() {
    matches_timm::<Flex>("cpu");
}

#[test]
fn logits_match_timm_on_ndarray() {
    matches_timm::<NdArray>("ndarray");
}

#[test]
fn logits_match_timm_on_wgpu() {
    matches_timm::<Wgpu>("wgpu");
}

/// The file toy writes holds timm's names, shapes and the same values: reading it back gives
/// the same model and logits (that timm itself reads it: `make_vit_fixtures.py --check`).
#[test]
fn safetensors_round_trip() {
    let device = Default::default();
    let loaded = load_safetensors::<Flex>(&fixture("timm-vit.safetensors"), &device).unwrap();
    let labels: Vec<String> = (0..10).map(|i| format!("class {i}")).collect();
    let bytes = loaded.model.to_safetensors(Some(&labels)).unwrap();
    // Left for `make_vit_fixtures.py --check` (timm reading toy's file).
    let kept = std::env::temp_dir().join("toy-vit-round-trip.safetensors");
    std::fs::write(&kept, &bytes).unwrap();
    eprintln!("wrote {}", kept.display());
    let again = read_safetensors::<Flex>(&bytes, "round trip", &device).unwrap();
    assert_eq!(again.config, loaded.config);
    assert_eq!(again.labels.as_deref(), Some(&labels[..]));
    // Same names, shapes and bits as the file timm wrote.
    let original = std::fs::read(fixture("timm-vit.safetensors")).unwrap();
    let (timm, toy) = (
        SafeTensors::deserialize(&original).unwrap(),
        SafeTensors::deserialize(&bytes).unwrap(),
    );
    let mut names = timm.names();
    names.sort();
    let mut toy_names = toy.names();
    toy_names.sort();
    assert_eq!(names, toy_names);
    for name in names {
        let (a, b) = (timm.tensor(name).unwrap(), toy.tensor(name).unwrap());
        assert_eq!(a.shape(), b.shape(), "{name}");
        assert_eq!(a.data(), b.data(), "{name}: values changed");
    }
    let a = logits(&loaded.model, "images", &device);
    let b = logits(&again.model, "images", &device);
    assert_eq!(a, b);
}

/// toy's `vit_tiny_patch16_224` has exactly the tensors of timm's (names, shapes and order of
/// its `state_dict`, `fixtures/vit/vit_tiny_patch16_224.names.json`).
#[test]
fn preset_has_timm_vit_tiny_patch16_224s_tensors() {
    let text = std::fs::read_to_string(fixture("vit_tiny_patch16_224.names.json")).unwrap();
    let timm: Vec<(String, Vec<usize>)> = serde_json::from_str(&text).unwrap();
    assert_eq!(VitConfig::timm_vit_tiny_patch16_224().timm_names(), timm);
}

/// Non-causal attention (`AttentionOptions::full`) on each backend equals burn's own attention
/// without a mask.
fn full_attention_is_unmasked<B: ToyBackend>(backend: &str) {
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

#[test]
fn full_attention_sees_every_key() {
    full_attention_is_unmasked::<Flex>("cpu");
    full_attention_is_unmasked::<NdArray>("ndarray");
    full_attention_is_unmasked::<Wgpu>("wgpu");
}

/// A broken file, a file of another model and a truncated one: one-line errors naming the file.
#[test]
fn bad_files_are_one_line_errors_naming_the_file() {
    let device = Default::default();
    let dir = std::env::temp_dir().join(format!("toy-vit-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let original = std::fs::read(fixture("timm-vit.safetensors")).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "garbage.safetensors",
            b"not a safetensors file at all".to_vec(),
        ),
        (
            "truncated.safetensors",
            original[..original.len() / 2].to_vec(),
        ),
        (
            // The fixture's inputs: a safetensors file, but no ViT in it.
            "not-a-vit.safetensors",
            std::fs::read(fixture("timm-vit.io.safetensors")).unwrap(),
        ),
    ];
    for (name, bytes) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = match load_safetensors::<Flex>(&path, &device) {
            Ok(_) => panic!("{name}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(!err.contains('\n'), "{err}");
        eprintln!("{err}");
    }
    let missing = dir.join("absent.safetensors");
    let err = load_safetensors::<Flex>(&missing, &device).err().unwrap();
    assert!(matches!(err, VitFileError::Io { .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// timm's own `vit_tiny_patch16_224` (seeded random init, 23 MB: not committed). Make it with
/// `make_vit_fixtures.py --tiny224 DIR`, then
/// `TOY_VIT224_DIR=DIR cargo test --release -p toy-models --test vit -- --ignored`.
#[test]
#[ignore = "needs TOY_VIT224_DIR from make_vit_fixtures.py --tiny224"]
fn vit_tiny_patch16_224_matches_timm() {
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
    fn run<B: ToyBackend>(dir: &std::path::Path, images: &[f32], expected: &[f32], backend: &str) {
        let device = B::Device::default();
        let loaded =
            load_safetensors::<B>(&dir.join("vit_tiny_patch16_224.safetensors"), &device).unwrap();
        assert_eq!(loaded.config, VitConfig::timm_vit_tiny_patch16_224());
        let x =
            Tensor::<B, 4>::from_data(TensorData::new(images.to_vec(), [8, 3, 224, 224]), &device);
        let start = std::time::Instant::now();
        let got: Vec<f32> = loaded
            .model
            .forward(x)
            .into_data()
            .convert::<f32>()
            .into_vec()
            .unwrap();
        let diff = max_abs_diff(&got, expected);
        eprintln!(
            "vit_tiny_patch16_224 {backend}: max |toy - timm| = {diff:.3e} ({:.2} s for 8 images)",
            start.elapsed().as_secs_f64()
        );
        assert!(diff <= TOLERANCE, "{backend}: {diff}");
    }
    let (images, expected) = (read("images"), read("logits"));
    run::<Flex>(&dir, &images, &expected, "cpu");
    run::<NdArray>(&dir, &images, &expected, "ndarray");
    run::<Wgpu>(&dir, &images, &expected, "wgpu");
}

/// The GGUF checkpoint (`vit` architecture keys) holds the same model: same shape, labels and
/// logits; `load_vit` tells it from safetensors by its magic.
#[test]
fn gguf_round_trip() {
    let device = Default::default();
    let loaded = load_safetensors::<Flex>(&fixture("timm-vit.safetensors"), &device).unwrap();
    let labels: Vec<String> = (0..10).map(|i| format!("label-{i}")).collect();
    let dir = std::env::temp_dir().join(format!("toy-vit-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vit.gguf");
    loaded
        .model
        .save_gguf(&loaded.config, Some(&labels), &path)
        .unwrap();
    let again = toy_models::vit::gguf::load_vit::<Flex>(&path, &device).unwrap();
    assert_eq!(again.config, loaded.config);
    assert_eq!(again.labels.as_deref(), Some(&labels[..]));
    assert_eq!(
        logits(&again.model, "images", &device),
        logits(&loaded.model, "images", &device)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A GGUF of another architecture (a llama fixture) is refused in one line naming the file.
#[test]
fn a_language_model_is_not_a_vit() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/models/tiny-gpt2.gguf"
    ));
    let err = match toy_models::vit::gguf::load_vit::<Flex>(&path, &Default::default()) {
        Ok(_) => panic!("a gpt2 GGUF loaded as a ViT"),
        Err(e) => e.to_string(),
    };
    eprintln!("{err}");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(err.contains("`gpt2` model, not a ViT"), "{err}");
    assert!(!err.contains('\n'), "{err}");
}
