//! Where every crate's tests find SmolLM2-135M-Instruct. One file, included by each test suite
//! with `#[path = ".../test-support/smollm2.rs"] mod ...;` (no test-only crate to build).

use std::path::PathBuf;

/// `SmolLM2-135M-Instruct.<kind>.gguf` in the model cache (`TOY_MODEL_CACHE`, default
/// `~/.cache/toy-models`), as `scripts/fetch-smollm2.sh` leaves it. Missing is a failure, not a
/// skip: these tests are part of the suite, and the suite's script fetches the model first.
pub fn smollm2(kind: &str) -> PathBuf {
    let path = model_cache().join(format!("SmolLM2-135M-Instruct.{kind}.gguf"));
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-smollm2.sh first",
        path.display()
    );
    path
}

/// The model cache: `TOY_MODEL_CACHE`, default `~/.cache/toy-models`.
#[allow(dead_code)] // outside `smollm2`, only toy-models' suites use it
pub fn model_cache() -> PathBuf {
    std::env::var_os("TOY_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/toy-models")))
        .expect("neither TOY_MODEL_CACHE nor HOME is set")
}
