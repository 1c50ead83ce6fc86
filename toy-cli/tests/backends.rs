//! `--backend wgpu|metal|cuda` end to end: the GPU backends run the real model with toy's cubecl
//! kernels and give llama.cpp's greedy ids, and every way a GPU backend can fail to start is a
//! one-line error (exit 1, no panic) that says what to install or set.

mod common;

use std::process::Output;

use common::{root, smollm2};
use serde_json::Value;

fn toy_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = common::toy_command();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run toy")
}

fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].contains(needle),
        "{:?} does not mention {needle:?}",
        lines[0]
    );
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// `toy --backend B --dtype D infer` greedy on SmolLM2 Q8_0 for 16 tokens: llama.cpp's ids.
fn infer_matches_llama_cpp(backend: &str, dtype: &str) {
    let oracle: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/smollm2/greedy.json")).unwrap(),
    )
    .unwrap();
    let case = &oracle["results"]["Q8_0"][0];
    let model = smollm2("Q8_0");
    let out = toy_env(
        &[
            "--backend",
            backend,
            "--dtype",
            dtype,
            "infer",
            model.to_str().unwrap(),
            "-p",
            case["prompt"].as_str().unwrap(),
            "-n",
            "16",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(
        ids(&v["ids"]),
        ids(&case["gen_ids"])[..16],
        "{backend} {dtype}"
    );
    assert!(v["text"].as_str().unwrap().starts_with(" Paris."));
}

#[test]
fn wgpu_infer_matches_llama_cpp() {
    infer_matches_llama_cpp("wgpu", "f32");
}

/// f16 weights and activations: on this prompt llama.cpp's margins are wide enough for f16's
/// deviation (toy-models/tests/wgpu.rs, `f16::`, measures it), so the ids are still llama.cpp's.
#[test]
fn wgpu_f16_infer_matches_llama_cpp() {
    infer_matches_llama_cpp("wgpu", "f16");
}

#[test]
fn f16_where_it_does_not_apply_is_a_clean_error() {
    let model = smollm2("Q8_0");
    let model = model.to_str().unwrap();
    let infer = ["--dtype", "f16", "infer", model, "-p", "hi", "-n", "1"];
    assert_clean_error(&toy_env(&infer, &[]), "--dtype f16 is for the GPU backends");
    let train = ["--dtype", "f16", "train", "--steps", "1"];
    assert_clean_error(&toy_env(&train, &[]), "training keeps f32");
}

#[test]
fn wgpu_without_vulkan_driver_is_a_clean_error() {
    let model = smollm2("Q8_0");
    let out = toy_env(
        &[
            "--backend",
            "wgpu",
            "infer",
            model.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "1",
        ],
        &[
            ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
            ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
        ],
    );
    assert_clean_error(&out, "mesa-vulkan-drivers");
}

#[test]
fn wgpu_unknown_adapter_is_a_clean_error() {
    let model = smollm2("Q8_0");
    let args = [
        "--backend",
        "wgpu",
        "infer",
        model.to_str().unwrap(),
        "-p",
        "hi",
        "-n",
        "1",
    ];
    assert_clean_error(
        &toy_env(&args, &[("TOY_WGPU_DEVICE", "discrete:7")]),
        "no discrete adapter number 7",
    );
    assert_clean_error(
        &toy_env(&args, &[("TOY_WGPU_DEVICE", "tpu")]),
        "expected default",
    );
}

#[cfg(not(target_os = "macos"))]
#[test]
fn metal_off_macos_is_a_clean_error() {
    let model = smollm2("Q8_0");
    let out = toy_env(
        &[
            "--backend",
            "metal",
            "infer",
            model.to_str().unwrap(),
            "-p",
            "hi",
        ],
        &[],
    );
    assert_clean_error(&out, "needs macOS");
}

/// Where an NVIDIA driver is present this runs the model on CUDA; elsewhere it checks that the
/// missing driver is reported in one line instead of cubecl's panic in a worker thread.
#[test]
fn cuda_runs_or_says_what_is_missing() {
    let has_driver = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
    ]
    .iter()
    .any(|dir| std::path::Path::new(dir).join("libcuda.so.1").exists());
    if has_driver {
        infer_matches_llama_cpp("cuda", "f32");
    } else {
        let model = smollm2("Q8_0");
        let out = toy_env(
            &[
                "--backend",
                "cuda",
                "infer",
                model.to_str().unwrap(),
                "-p",
                "hi",
            ],
            &[],
        );
        assert_clean_error(&out, "libcuda was not found");
    }
}
