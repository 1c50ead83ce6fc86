#!/usr/bin/env bash
# toy next to llama.cpp on every common GGUF weight type, CPU, same files, same threads, one run:
# llama-bench's pp128 / tg64 against `toy bench`'s, and both programs' peak resident memory (toy's
# from `toy bench`, which loads the model and runs both tests; llama.cpp's from `llama-simple`
# loading the same file and generating 64 tokens). Prints the markdown table of
# docs/performance.md, preceded by the CPU's model and flags.
#
#   LLAMA_BIN   directory with llama-bench and llama-simple (default: the anchor build,
#               $TOY_ANCHOR_CACHE/llamacpp/build/bin, see shared/anchors/llamacpp/)
#   THREADS     default 2
#   REPS        repetitions per test (default 3)
#   FILES       the GGUF files to measure (default: SmolLM2-135M-Instruct in F32 F16 BF16 Q8_0
#               Q4_0 Q4_K_M Q5_K_M Q6_K from $TOY_MODEL_CACHE — fixtures/smollm2/make_quant_types.sh
#               makes them — and the Llama-3.2-1B-shaped model of benches/make-llama-1b.sh in
#               Q4_K_M and Q8_0, where present)
#   TOY_ARGS    extra arguments for `toy` (e.g. `--backend ndarray`); TOY_CPU=avx2 forces toy's
#               AVX2 kernels (compare with an AVX2 llama.cpp build: GGML_NATIVE=OFF GGML_AVX2=ON)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}"
THREADS="${THREADS:-2}"
REPS="${REPS:-3}"
CACHE="${TOY_ANCHOR_CACHE:-$HOME/.cache/toy-anchors}"
MODELS="${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}"
LLAMA_BIN="${LLAMA_BIN:-$CACHE/llamacpp/build/bin}"

cargo build --release --quiet -p toy-cli
TOY="$CARGO_TARGET_DIR/release/toy"
if [ -z "${FILES:-}" ]; then
  FILES=""
  for t in F32 F16 BF16 Q8_0 Q4_0 Q4_K_M Q5_K_M Q6_K; do
    f="$MODELS/SmolLM2-135M-Instruct.$t.gguf"
    [ -f "$f" ] && FILES="$FILES $f"
  done
  for t in Q4_K_M Q8_0; do
    f="$MODELS/llama-1b-shape/llama-1b-shape.$t.gguf"
    [ -f "$f" ] && FILES="$FILES $f"
  done
fi
[ -n "$FILES" ] || { echo "no model files: run fixtures/smollm2/make_quant_types.sh and benches/make-llama-1b.sh" >&2; exit 1; }
[ -x "$LLAMA_BIN/llama-bench" ] || { echo "no llama-bench in $LLAMA_BIN" >&2; exit 1; }

echo "date $(date -u +%FT%TZ), threads $THREADS, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'); flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o 'avx[0-9a-z_]*\|f16c\|fma\|amx[a-z_]*' | sort -u | xargs)"
echo
echo "| file | test | toy t/s | llama.cpp t/s | toy / llama.cpp | toy peak RSS MB | llama.cpp peak RSS MB |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
for f in $FILES; do
  # shellcheck disable=SC2086
  json=$("$TOY" ${TOY_ARGS:-} bench "$f" -p 128 -n 64 -r "$REPS" -t "$THREADS" --json --vs-llama-cpp "$LLAMA_BIN/llama-bench")
  llama_rss=$(python3 - "$LLAMA_BIN/llama-simple" "$f" "$THREADS" <<'PY'
import resource, subprocess, sys
simple, model, threads = sys.argv[1:]
# llama-simple has no thread flag: it uses the default (all cores), which is what a user gets.
subprocess.run([simple, "-m", model, "-n", "64", "Once upon a time"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
print(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
PY
)
  python3 - "$json" "$llama_rss" "$(basename "$f")" <<'PY'
import json, sys
r, llama_rss, name = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
rss = r.get("peak_rss_mb")
for row in r["rows"]:
    lc = row.get("llama_cpp_tok_s")
    ratio = f"{row['toy_tok_s'] / lc:.2f}" if lc else "—"
    lcs = f"{lc:.1f}" if lc else "—"
    print(f"| {name} | {row['test']} | {row['toy_tok_s']:.1f} | {lcs} | {ratio} | {rss:.0f} | {llama_rss} |")
PY
done
echo
echo "load after $(cut -d' ' -f1-3 /proc/loadavg)"
