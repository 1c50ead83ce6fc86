// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the `toy` binary's end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "../../../test-support/smollm2.rs"]
mod smollm2_path;
#[allow(unused_imports)] // as with dead_code above: each test binary uses a subset
pub use smollm2_path::smollm2;

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
