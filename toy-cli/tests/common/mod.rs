// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the `toy` binary's end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "../../../test-support/smollm2.rs"]
mod smollm2_path;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use smollm2_path::smollm2;

/// The `toy` binary built for these tests, set to reproduce llama.cpp's AVX-512 x86 build: the
/// llama.cpp outputs the tests compare with (`fixtures/smollm2/`, `fixtures/finetune/`,
/// `fixtures/corpus/`) were made by that build (see `fixtures/quant/README.md`).
pub fn toy_command() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_toy"));
    cmd.env("TOY_GGML_ISA", "avx512");
    cmd
}

/// Run the `toy` binary built for these tests.
pub fn toy(args: &[&str]) -> Output {
    toy_command().args(args).output().expect("run toy")
}

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A fresh, empty scratch folder `<suite>/<name>-<pid>` under cargo's temporary directory for
/// integration tests (what an earlier run left there is removed first).
pub fn scratch_dir(suite: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(suite)
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
