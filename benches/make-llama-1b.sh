#!/usr/bin/env bash
# A real-scale benchmark model: random weights with Llama-3.2-1B's shapes (1.24 B parameters),
# written by benches/make_llama_1b.py (see its docstring), quantized by llama.cpp's llama-quantize
# to Q4_K_M and Q8_0, checked by running llama.cpp on it, and llama.cpp's greedy ids recorded.
#
#   benches/make-llama-1b.sh
#
#   TOY_MODEL_CACHE   default $HOME/.cache/toy-models; files go to $TOY_MODEL_CACHE/llama-1b-shape/:
#                       llama-1b-shape.<DTYPE>.gguf  (~2.5 GB)  llama-1b-shape.Q8_0.gguf (~1.3 GB)
#                       llama-1b-shape.Q4_K_M.gguf (~0.8 GB)    *.log
#   TOY_ANCHOR_CACHE  llama.cpp build (shared/anchors/llamacpp/build_llamacpp.sh) and the SmolLM2 GGUF
#                     whose tokenizer is copied (default $HOME/.cache/toy-anchors)
#   DTYPE             BF16 (default) or F16: the type of the unquantized matrices
#   SEED              default 1234
#   FORCE=1           rebuild files that exist
#
# Writes fixtures/llama-1b-shape/expected.json (small, committed; expected.avx512.json on a CPU
# with AVX-512, whose llama.cpp build sums its f32 parts in 16 lanes): greedy ids of 2 prompts x
# 16 tokens from toy-oracle for the Q4_K_M and Q8_0 files, file sizes, sha256s, step timings.
# Needs ~5 GB of disk and ~2 GB of RAM; ~10 min on 2 cores.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${TOY_ANCHOR_CACHE:-$HOME/.cache/toy-anchors}"
OUTDIR="${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}/llama-1b-shape"
BIN="$CACHE/llamacpp/build/bin"
TOK="$CACHE/model/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPE="${DTYPE:-BF16}"
SEED="${SEED:-1234}"
mkdir -p "$OUTDIR"
[ -s "$TOK" ] || { echo "missing $TOK (shared/anchors/llamacpp/fetch_model.sh)" >&2; exit 1; }
SRC="$OUTDIR/llama-1b-shape.$DTYPE.gguf"
META="$OUTDIR/steps.json"
# step timings survive re-runs that skip existing files (FORCE=1 starts over)
{ [ -s "$META" ] && [ "${FORCE:-0}" != 1 ]; } || echo '{}' > "$META"
step() {  # step NAME CMD... : run, time, record
  local name="$1"; shift
  local t0 t1
  t0=$(date +%s.%N)
  nice -n 10 "$@"
  t1=$(date +%s.%N)
  python3 - "$META" "$name" "$t0" "$t1" <<'PY'
import json, sys
p, name, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
d = json.load(open(p)); d.setdefault("step_seconds", {})[name] = round(t1 - t0, 1); json.dump(d, open(p, "w"))
PY
  echo "[llama-1b] $name: $(python3 -c "print(round($t1 - $t0, 1))") s"
}

if [ ! -s "$SRC" ] || [ "${FORCE:-0}" = 1 ]; then
  step "write_$DTYPE" python3 "$ROOT/benches/make_llama_1b.py" write "$SRC.part" --tokenizer "$TOK" --dtype "$DTYPE" --seed "$SEED"
  mv "$SRC.part" "$SRC"
fi
for Q in Q8_0 Q4_K_M; do
  dst="$OUTDIR/llama-1b-shape.$Q.gguf"
  if [ ! -s "$dst" ] || [ "${FORCE:-0}" = 1 ]; then
    step "quantize_$Q" "$BIN/llama-quantize" "$SRC" "$dst.part" "$Q" 2 > "$OUTDIR/quantize.$Q.log" 2>&1 \
      || { tail -20 "$OUTDIR/quantize.$Q.log"; exit 1; }
    mv "$dst.part" "$dst"
  fi
done
# llama.cpp's own CLI loads and generates (default context settings)
step "llama_completion_Q4_K_M" "$BIN/llama-completion" -m "$OUTDIR/llama-1b-shape.Q4_K_M.gguf" -p "The capital of France is" \
  -n 16 -t 2 --temp 0 -no-cnv --no-warmup > "$OUTDIR/llama-completion.Q4_K_M.log" 2>&1 \
  || { tail -30 "$OUTDIR/llama-completion.Q4_K_M.log"; exit 1; }
grep -E "eval time|load time" "$OUTDIR/llama-completion.Q4_K_M.log" | sed 's/^/[llama-completion] /' || true

python3 - "$META" "$OUTDIR" "$DTYPE" "$SEED" <<'PY'
import json, os, sys
p, d, dtype, seed = sys.argv[1:]
m = json.load(open(p))
m["disk_bytes"] = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith(".gguf")}
m["source_dtype"], m["seed"] = dtype, int(seed)
m["machine"] = {"cpu": next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                "nproc": os.cpu_count()}
json.dump(m, open(p, "w"))
PY
# The AVX2 and AVX-512 builds of llama.cpp give different greedy ids on this model (their f32
# parts differ): each CPU writes its own fixture, and toy checks both (toy-models/tests/).
EXPECTED=expected.json
grep -q avx512f /proc/cpuinfo && EXPECTED=expected.avx512.json
step "toy_oracle_expect" python3 "$ROOT/benches/make_llama_1b.py" expect --oracle "$BIN/toy-oracle" --meta "$META" \
  --out "$ROOT/fixtures/llama-1b-shape/$EXPECTED" "$OUTDIR/llama-1b-shape.Q4_K_M.gguf" "$OUTDIR/llama-1b-shape.Q8_0.gguf"
du -h "$OUTDIR"/*.gguf
