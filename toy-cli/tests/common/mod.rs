// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

//! Shared by the `toy` binary's end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

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

/// The stdout of a `toy` run that must succeed (its stderr in the panic otherwise).
pub fn success(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "toy failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The complete lines of an event log.
pub fn events(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == kind).collect()
}

pub fn step_losses(events: &[Value]) -> Vec<(u64, f64)> {
    of_kind(events, "step")
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect()
}
