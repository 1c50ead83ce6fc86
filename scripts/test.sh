#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a Linux machine with the Rust toolchain.
# Installs what the tests need (the SmolLM2 model from PyPI, Mesa's lavapipe Vulkan driver for
# the wgpu kernel tests), then runs every test.
#
#   CARGO_TARGET_DIR  build folder (default: $HOME/.cache/toy-target, kept between runs so the
#                     ~5 min cold build of burn is paid once)
#   TOY_MODEL_CACHE   where models go (default: $HOME/.cache/toy-models)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}"
START=$(date +%s)
# phase NAME: a header with the minutes since the start, so that a slow CI log says where.
phase() { echo "== [$(( ($(date +%s) - START) / 60 )) min] $1" >&2; }

command -v python3 >/dev/null || { echo "python3 is needed to fetch the test model from PyPI" >&2; exit 1; }

phase "lavapipe (software Vulkan) for the wgpu tests"
scripts/gpu-test-deps.sh
phase "build (release)"
cargo build --release --locked -p toy-cli
phase "fetch SmolLM2-135M-Instruct and derive F32/Q8_0 with toy convert"
TOY_BIN="$CARGO_TARGET_DIR/release/toy" scripts/fetch-smollm2.sh >/dev/null
phase "openai client, websockets and chromium for the toy serve tests"
scripts/serve-test-deps.sh
phase "build the tests"
cargo test --release --locked --workspace --no-run
phase "tests"
cargo test --release --locked --workspace
phase "cargo doc: the API reference builds with no warning (an undocumented public item, a broken link)"
RUSTDOCFLAGS="-D warnings" cargo doc --release --locked --no-deps --workspace
phase "examples (built by cargo test): toy-models' train_loop, toy-kernels' custom_op; generate, embed, lora_loop and toy-serve's own_app on SmolLM2 Q8_0"
EXAMPLES="$CARGO_TARGET_DIR/release/examples"
SMOLLM2_Q8="${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}/SmolLM2-135M-Instruct.Q8_0.gguf"
"$EXAMPLES/train_loop" >&2  # asserts that its loss halves
"$EXAMPLES/custom_op" wgpu >&2  # asserts that each override matches its reference body
# The library's quick start must keep working: greedy SmolLM2 knows this one.
generated=$("$EXAMPLES/generate" "$SMOLLM2_Q8" "The capital of France is")
echo "$generated" >&2
grep -q "Paris" <<<"$generated"
embedded=$("$EXAMPLES/embed" "$SMOLLM2_Q8")
echo "$embedded" >&2
grep -q 'nearest to "The cat sat on the mat.": "A kitten' <<<"$embedded"
# QLoRA in a plain burn loop teaches the base one sentence (the example asserts the loss fell 4×).
taught=$("$EXAMPLES/lora_loop" "$SMOLLM2_Q8")
echo "$taught" >&2
grep -q "^after: .*Pip" <<<"$taught"
# toy-serve's ModelService mounted in an axum app of the example's own, asked one question.
served=$("$EXAMPLES/own_app" "$SMOLLM2_Q8")
echo "$served" >&2
grep -q "Red" <<<"$served"
phase "toy new: the generated app runs and the generated library's test passes (this checkout, its Cargo.lock)"
# The same CARGO_TARGET_DIR: the projects reuse what the suite built wherever their dependencies
# resolve to the same versions and features.
NEW_DIR="${TMPDIR:-/tmp}/toy-new-$$"
rm -rf "$NEW_DIR"
"$CARGO_TARGET_DIR/release/toy" new "$NEW_DIR/app" >&2
"$CARGO_TARGET_DIR/release/toy" new "$NEW_DIR/lib" --lib >&2
# The app is train_loop (which asserts that its loss halves) and generate, as the examples above.
(cd "$NEW_DIR/app" && cargo run --release -q) >&2
generated=$(cd "$NEW_DIR/app" && cargo run --release -q --bin generate -- "$SMOLLM2_Q8" "The capital of France is")
echo "$generated" >&2
grep -q "Paris" <<<"$generated"
(cd "$NEW_DIR/lib" && cargo test --release -q) >&2
rm -rf "$NEW_DIR"
phase "serve soak, 2 minutes: 16 clients of mixed and hostile requests (benches/serve-soak.sh; the hour-long run is by hand)"
SOAK_S=120 TOY_BIN="$CARGO_TARGET_DIR/release/toy" benches/serve-soak.sh
phase "fuzz smoke: each target of fuzz/ for 60 s (scripts/fuzz.sh; the long runs are by hand)"
scripts/fuzz.sh
phase "scripts/gpu-check.sh --dry-run (every step of the device check that needs no GPU)"
# The binaries are the ones just built and tested (cargo test builds the examples too): a second
# `cargo build -p toy-kernels` would resolve features for that crate alone and rebuild burn.
OUT="${TMPDIR:-/tmp}/toy-gpu-check-dry-run" TOY_BIN="$CARGO_TARGET_DIR/release/toy" \
  scripts/gpu-check.sh --dry-run
phase "done"
