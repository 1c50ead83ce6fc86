//! toy's ViT against timm: a tiny seeded timm `VisionTransformer` saved by timm
//! (`fixtures/vit/timm-vit.safetensors`, made by `fixtures/vit/make_vit_fixtures.py`) loaded by
//! toy must give timm's logits on timm's 8 images within 1e-4 on every backend, also at another
//! image size (position embeddings resampled as timm resamples them); the file toy writes back
//! must reload to the same model; toy's `vit_tiny_patch16_224` preset must have exactly timm's
//! tensors; and bad files must be one-line errors naming the file. `wgpu.rs` runs the same
//! checks on the cubecl kernels.

mod common;

use std::path::PathBuf;

use burn::backend::{Flex, NdArray};
use safetensors::SafeTensors;
use toy_models::VitConfig;
use toy_models::vit::timm::{VitFileError, load_safetensors, read_safetensors};

use common::vit::{fixture, full_attention_is_unmasked, logits, matches_timm, vit224_matches_timm};

#[test]
fn logits_match_timm_on_cpu() {
    matches_timm::<Flex>("cpu");
}

#[test]
fn logits_match_timm_on_ndarray() {
    matches_timm::<NdArray>("ndarray");
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

#[test]
fn full_attention_sees_every_key() {
    full_attention_is_unmasked::<Flex>("cpu");
    full_attention_is_unmasked::<NdArray>("ndarray");
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
/// `TOY_VIT224_DIR=DIR cargo test --release -p toy-models --test vit -- --ignored` (and
/// `--test wgpu` for the cubecl kernels).
#[test]
#[ignore = "needs TOY_VIT224_DIR from make_vit_fixtures.py --tiny224"]
fn vit_tiny_patch16_224_matches_timm() {
    vit224_matches_timm::<Flex>("cpu");
    vit224_matches_timm::<NdArray>("ndarray");
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
