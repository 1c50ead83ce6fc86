// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the `toy` binary's end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Run the `toy` binary built for these tests.
pub fn toy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_toy"))
        .args(args)
        .output()
        .expect("run toy")
}

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `SmolLM2-135M-Instruct.<kind>.gguf` in the model cache (`TOY_MODEL_CACHE`, default
/// `~/.cache/toy-models`), as `scripts/fetch-smollm2.sh` leaves it; fails loudly if missing.
pub fn smollm2(kind: &str) -> PathBuf {
    let cache = std::env::var_os("TOY_MODEL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/toy-models")
        });
    let path = cache.join(format!("SmolLM2-135M-Instruct.{kind}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-smollm2.sh first",
        path.display()
    );
    path
}
