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

command -v python3 >/dev/null || { echo "python3 is needed to fetch the test model from PyPI" >&2; exit 1; }

echo "== lavapipe (software Vulkan) for the wgpu tests" >&2
scripts/gpu-test-deps.sh
echo "== build (release)" >&2
cargo build --release --locked -p toy-cli
echo "== fetch SmolLM2-135M-Instruct and derive F32/Q8_0 with toy convert" >&2
TOY_BIN="$CARGO_TARGET_DIR/release/toy" scripts/fetch-smollm2.sh >/dev/null
echo "== openai client, websockets and chromium for the toy serve tests" >&2
scripts/serve-test-deps.sh
echo "== tests" >&2
cargo test --release --locked --workspace
echo "== scripts/gpu-check.sh --dry-run (every step of the device check that needs no GPU)" >&2
OUT="${TMPDIR:-/tmp}/toy-gpu-check-dry-run" scripts/gpu-check.sh --dry-run
