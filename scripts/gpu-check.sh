#!/usr/bin/env bash
# The device check for a lent NVIDIA GPU: one prepared run, no improvising (docs/gpu.md).
#
#   scripts/gpu-check.sh            on the GPU machine: builds toy with cuda, checks exactness
#                                   against the CPU backend, benchmarks, trains, serves (~10 min
#                                   on 16 cores, most of it the first build)
#   scripts/gpu-check.sh --dry-run  on any machine (CI): every step that needs no GPU, with the
#                                   GPU steps run on `--backend cpu` at small sizes so that the
#                                   script cannot rot, and the CUDA probe required to fail with
#                                   its one-line error
#
#   OUT               results folder (default /tmp/toy-gpu-check): results.jsonl (one JSON
#                     object per step), summary.md (the table for docs/performance.md), and
#                     each step's raw output in logs/
#   CARGO_TARGET_DIR  build folder (default $HOME/.cache/toy-target)
#   TOY_BIN           a toy binary to use instead of building one (the build step is skipped)
#   TOY_MODEL_CACHE   SmolLM2 and the 1B-shaped model are used from here when present (the
#                     device machine has no internet: anything missing is made on the machine
#                     from the bundled corpus, or skipped and said so)
#
# Every step is recorded as passed, failed or skipped with its reason; the script goes on after
# a failure and exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-/tmp/toy-gpu-check}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}"
MODELS="${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}"
TOY="${TOY_BIN:-$CARGO_TARGET_DIR/release/toy}"
rm -rf "$OUT" && mkdir -p "$OUT/logs" "$OUT/models"
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
FAILED=0
START=$(date +%s)

if [ "$DRY" = 1 ]; then
  B=cpu
  STEPS_TRAIN=3
else
  B=cuda
  STEPS_TRAIN=20
fi

# record NAME STATUS SECONDS JSON-FIELDS: one line of results.jsonl.
record() {
  local name="$1" status="$2" secs="$3" fields="${4:-}"
  [ -n "$fields" ] || fields='{}'
  python3 - "$name" "$status" "$secs" "$fields" >>"$RESULTS" <<'EOF'
import json, sys
name, status, secs, fields = sys.argv[1:5]
row = {"step": name, "status": status, "seconds": int(secs)}
row.update(json.loads(fields))
print(json.dumps(row))
EOF
  [ "$status" = failed ] && FAILED=$((FAILED + 1))
  echo "== $name: $status (${secs}s)" >&2
}

# run NAME CMD...: the command's output in logs/NAME.log; returns its status.
run() {
  local name="$1"
  shift
  "$@" >"$OUT/logs/$name.log" 2>&1
}

echo "== toy device check ($([ "$DRY" = 1 ] && echo dry run on the CPU || echo cuda)), results in $OUT" >&2

# 1. The machine.
t=$(date +%s)
cpu=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
gpu="none"
if command -v nvidia-smi >/dev/null; then
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
fi
nvcc_v="none"
command -v nvcc >/dev/null && nvcc_v=$(nvcc --version | tail -1)
record machine passed $(($(date +%s) - t)) "$(python3 -c 'import json,sys; print(json.dumps({"cpu": sys.argv[1], "cores": int(sys.argv[2]), "gpu": sys.argv[3], "nvcc": sys.argv[4], "dry_run": sys.argv[5] == "1"}))' "$cpu" "$(nproc)" "$gpu" "$nvcc_v" "$DRY")"
if [ "$DRY" = 0 ] && [ "$gpu" = none ]; then
  echo "error: no NVIDIA GPU (nvidia-smi missing or silent); run with --dry-run on a machine without one" >&2
  exit 2
fi

# 2. Build (cuda is a default feature: it compiles without the CUDA toolkit).
t=$(date +%s)
if [ -n "${TOY_BIN:-}" ] && [ -x "$CARGO_TARGET_DIR/release/examples/bench_kernels" ]; then
  record build skipped 0 '{"why": "TOY_BIN given, bench_kernels already built (cargo test builds it)"}'
elif [ -n "${TOY_BIN:-}" ]; then
  record build failed 0 '{"why": "TOY_BIN given but $CARGO_TARGET_DIR/release/examples/bench_kernels is missing"}'
elif run build cargo build --release --locked -p toy-cli && run build-kernels cargo build --release --locked -p toy-kernels --example bench_kernels; then
  record build passed $(($(date +%s) - t))
else
  record build failed $(($(date +%s) - t)) '{"log": "logs/build.log"}'
  echo "the build failed: nothing else can run (logs/build.log)" >&2
  exit 1
fi

# 3. The CUDA probe: a one-line error without a GPU, a working device with one.
t=$(date +%s)
if [ "$DRY" = 1 ]; then
  # Any file will do: `bench` probes the backend before it reads the model.
  printf 'not a model' >"$OUT/models/probe.gguf"
  if "$TOY" --backend cuda bench "$OUT/models/probe.gguf" -p 1 -n 1 >"$OUT/logs/probe.log" 2>&1; then
    record cuda-probe failed $(($(date +%s) - t)) '{"why": "--backend cuda succeeded on a machine without a GPU"}'
  else
    lines=$(grep -c . "$OUT/logs/probe.log")
    msg=$(head -1 "$OUT/logs/probe.log")
    if [ "$lines" = 1 ] && grep -q -- "--backend cuda" "$OUT/logs/probe.log" && ! grep -qi panick "$OUT/logs/probe.log"; then
      record cuda-probe passed $(($(date +%s) - t)) "$(python3 -c 'import json,sys; print(json.dumps({"error": sys.argv[1]}))' "$msg")"
    else
      record cuda-probe failed $(($(date +%s) - t)) '{"why": "the error is not one line naming --backend cuda", "log": "logs/probe.log"}'
    fi
  fi
fi

# 4. Models: a trained one made here (F32, then F16 / Q8_0 / Q4_0 by toy convert), and the cached
#    SmolLM2 and 1B-shaped files where this machine has them.
t=$(date +%s)
if run train-base "$TOY" --backend cpu train --quiet --preset tiny --steps $([ "$DRY" = 1 ] && echo 2 || echo 30) \
  --runs-dir "$OUT/runs" --run-id base --eval-every 0 --sample-every 0 --checkpoint-every 0; then
  cp "$OUT/runs/base/model.gguf" "$OUT/models/tiny.F32.gguf"
  ok=1
  for ty in f16 q8_0 q4_0; do
    run "convert-$ty" "$TOY" convert --to "$ty" "$OUT/models/tiny.F32.gguf" "$OUT/models/tiny.$ty.gguf" || ok=0
  done
  [ "$ok" = 1 ] && record models passed $(($(date +%s) - t)) || record models failed $(($(date +%s) - t)) '{"log": "logs/convert-*.log"}'
else
  record models failed $(($(date +%s) - t)) '{"log": "logs/train-base.log"}'
fi
FILES=""
for f in "$OUT"/models/tiny.*.gguf; do [ -f "$f" ] && FILES="$FILES $f"; done
if [ "$DRY" = 0 ]; then
  for t_ in Q8_0 Q4_K_M F16; do
    f="$MODELS/SmolLM2-135M-Instruct.$t_.gguf"
    [ -f "$f" ] && FILES="$FILES $f"
  done
  for t_ in Q4_K_M Q8_0; do
    f="$MODELS/llama-1b-shape/llama-1b-shape.$t_.gguf"
    [ -f "$f" ] && FILES="$FILES $f"
  done
fi

# 5. Exactness: greedy ids on the device backend against the CPU backend's (the CPU is llama.cpp's
#    arithmetic; docs/correctness.md), 32 tokens per model.
t=$(date +%s)
rows="[]"
for f in $FILES; do
  name=$(basename "$f")
  "$TOY" --backend cpu infer "$f" -p "The capital of France is" -n 32 --temperature 0 --ignore-eos --json >"$OUT/logs/greedy-cpu-$name.json" 2>>"$OUT/logs/greedy.log"
  "$TOY" --backend $B infer "$f" -p "The capital of France is" -n 32 --temperature 0 --ignore-eos --json >"$OUT/logs/greedy-$B-$name.json" 2>>"$OUT/logs/greedy.log"
  rows=$(python3 - "$rows" "$name" "$OUT/logs/greedy-cpu-$name.json" "$OUT/logs/greedy-$B-$name.json" <<'EOF'
import json, sys
rows, name, a, b = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    ca, cb = json.load(open(a))["ids"], json.load(open(b))["ids"]
    same = next((i for i, (x, y) in enumerate(zip(ca, cb)) if x != y), min(len(ca), len(cb)))
    rows.append({"model": name, "agree": same, "of": len(ca)})
except Exception as e:
    rows.append({"model": name, "error": str(e)})
print(json.dumps(rows))
EOF
)
done
if python3 -c 'import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r and all("agree" in x for x in r) else 1)' "$rows"; then
  record exactness passed $(($(date +%s) - t)) "{\"models\": $rows}"
else
  record exactness failed $(($(date +%s) - t)) "{\"models\": $rows}"
fi

# 6. Speed: toy bench (pp128 / tg64; pp16 / tg8 in the dry run).
t=$(date +%s)
rows="[]"
bench_ok=1
for f in $FILES; do
  name=$(basename "$f")
  if [ "$DRY" = 1 ]; then args="-p 16 -n 8 -r 1"; else args="-p 128 -n 64 -r 3"; fi
  if "$TOY" --backend $B bench "$f" $args --json >"$OUT/logs/bench-$name.json" 2>>"$OUT/logs/bench.log"; then
    rows=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); b=json.load(open(sys.argv[3])); r.append({"model": sys.argv[2], "rows": [{"test": x["test"], "tok_s": x["toy_tok_s"]} for x in b["rows"]], "peak_rss_mb": b.get("peak_rss_mb")}); print(json.dumps(r))' "$rows" "$name" "$OUT/logs/bench-$name.json")
  else
    bench_ok=0
  fi
done
[ "$bench_ok" = 1 ] && record bench passed $(($(date +%s) - t)) "{\"models\": $rows}" || record bench failed $(($(date +%s) - t)) "{\"models\": $rows, \"log\": \"logs/bench.log\"}"

# 7. Each kernel's time, bytes/s and FLOP/s at SmolLM2's shapes (the device's copy bandwidth is
#    the reference: H200 ≈ 4.3 TB/s).
t=$(date +%s)
if [ "$DRY" = 1 ]; then
  record kernels skipped 0 '{"why": "dry run: bench_kernels is built (step 2); timing CPU kernels here says nothing about a GPU"}'
elif run kernels "$CARGO_TARGET_DIR/release/examples/bench_kernels" cuda; then
  record kernels passed $(($(date +%s) - t)) '{"table": "logs/kernels.log"}'
else
  record kernels failed $(($(date +%s) - t)) '{"log": "logs/kernels.log"}'
fi

# 8. Training on the device: the tiny preset, median step time.
t=$(date +%s)
if run train "$TOY" --backend $B train --quiet --preset tiny --steps $STEPS_TRAIN --runs-dir "$OUT/runs" \
  --run-id train --eval-every 0 --sample-every 0 --checkpoint-every 0; then
  fields=$(python3 - "$OUT/runs/train/events.jsonl" <<'EOF'
import json, statistics, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
st = [e for e in ev if e.get("event") == "step"]
ms = [1000 * e["tokens"] / e["tokens_per_s"] for e in st[1:] or st]
print(json.dumps({"steps": len(st), "median_ms_per_step": round(statistics.median(ms), 1), "last_loss": st[-1].get("loss")}))
EOF
)
  record train passed $(($(date +%s) - t)) "$fields"
else
  record train failed $(($(date +%s) - t)) '{"log": "logs/train.log"}'
fi

# 9. Serving: 8 concurrent completions of 16 tokens against `toy serve` on the device.
t=$(date +%s)
SERVE_MODEL=$(echo $FILES | awk '{print $NF}')
PORT=$((20000 + RANDOM % 20000))
"$TOY" --backend $B serve "$SERVE_MODEL" --port $PORT >"$OUT/logs/serve.log" 2>&1 &
SERVE_PID=$!
up=0
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { up=1; break; }
  sleep 0.5
done
if [ "$up" = 1 ]; then
  fields=$(python3 - "$PORT" <<'EOF'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
port = sys.argv[1]
def one(i):
    body = json.dumps({"prompt": f"Request {i}: the weather", "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))["usage"]["completion_tokens"]
t = time.time()
with ThreadPoolExecutor(8) as pool:
    tokens = sum(pool.map(one, range(8)))
wall = time.time() - t
print(json.dumps({"requests": 8, "completion_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1)}))
EOF
)
  if [ -n "$fields" ]; then record serve passed $(($(date +%s) - t)) "$fields"; else record serve failed $(($(date +%s) - t)) '{"log": "logs/serve.log"}'; fi
else
  record serve failed $(($(date +%s) - t)) '{"why": "toy serve did not come up in 60 s", "log": "logs/serve.log"}'
fi
kill $SERVE_PID 2>/dev/null
wait $SERVE_PID 2>/dev/null

# 10. llama.cpp with CUDA, for llama-bench side by side: only where nvcc is present.
if [ "$DRY" = 1 ] || [ "$nvcc_v" = none ]; then
  record llama-cpp-cuda skipped 0 "{\"why\": \"$([ "$DRY" = 1 ] && echo 'dry run' || echo 'no nvcc on this machine: toy figures only')\"}"
else
  record llama-cpp-cuda skipped 0 '{"why": "nvcc found; build llama.cpp with GGML_CUDA=ON from the llama-cpp-python sdist (shared/anchors/llamacpp/build_llamacpp.sh) and run llama-bench by hand: it needs the sdist, which this offline machine cannot fetch"}'
fi

# The summary.
python3 - "$RESULTS" "$(($(date +%s) - START))" >"$OUT/summary.md" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"# toy device check ({'dry run' if rows[0].get('dry_run') else 'cuda'}), {sys.argv[2]} s\n")
m = rows[0]
print(f"CPU {m['cpu']}, {m['cores']} cores; GPU {m['gpu']}; nvcc {m['nvcc']}\n")
print("| step | status | seconds | figures |")
print("| --- | --- | ---: | --- |")
for r in rows[1:]:
    rest = {k: v for k, v in r.items() if k not in ("step", "status", "seconds")}
    print(f"| {r['step']} | {r['status']} | {r['seconds']} | `{json.dumps(rest)}` |")
EOF
cat "$OUT/summary.md" >&2
[ "$FAILED" = 0 ] || { echo "$FAILED step(s) failed: see $OUT/logs" >&2; exit 1; }
