#!/usr/bin/env bash
# Side-by-side CPU benchmark: toy vs llama.cpp's llama-bench on SmolLM2-135M-Instruct (Q8_0, Q4_1,
# F32), same files, same threads, one run. Prints the markdown rows that docs/performance.md holds.
#
#   LLAMA_BENCH   path to llama-bench (default: the anchor build in $TOY_ANCHOR_CACHE, see
#                 shared/anchors/llamacpp/build_llamacpp.sh; on CPUs with AMX build it with
#                 CMAKE_C(XX)_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16": llama.cpp's AMX
#                 path crashes on some VMs)
#   THREADS       default 2
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}"
THREADS="${THREADS:-2}"
CACHE="${TOY_ANCHOR_CACHE:-$HOME/.cache/toy-anchors}"
LLAMA_BENCH="${LLAMA_BENCH:-$CACHE/llamacpp/build/bin/llama-bench}"

cargo build --release --quiet -p toy-cli
TOY="$CARGO_TARGET_DIR/release/toy"
MODELS=$(TOY_BIN="$TOY" scripts/fetch-smollm2.sh)
vs=()
if [ -x "$LLAMA_BENCH" ]; then vs=(--vs-llama-cpp "$LLAMA_BENCH"); else echo "no llama-bench at $LLAMA_BENCH: toy only" >&2; fi

echo "date $(date -u +%FT%TZ), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
for kind in Q8_0 Q4_1 F32; do
  "$TOY" bench "$MODELS/SmolLM2-135M-Instruct.$kind.gguf" -p 128 -n 64 -r 3 -t "$THREADS" "${vs[@]}" | tail -n +3
done
echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"
