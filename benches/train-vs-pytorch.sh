#!/usr/bin/env bash
# Training speed side by side: `toy train` and PyTorch (shared/anchors/pytorch/train_bench.py) on
# the same workloads, machine, thread count and token stream, in one run. Prints a markdown
# table of median step time, tokens/s and peak RSS per workload, and toy/PyTorch ratios.
#
#   benches/train-vs-pytorch.sh            (~15 minutes on 2 cores, plus a one-time ~5.6 GiB
#                                           PyTorch venv from PyPI on the first run)
#
# Workloads (PyTorch's shapes, so both sides run the same model):
#   scratch-tiny   llama d=64,  L=2, H=4, KV=2, ffn=172, seq 64,  batch 8, vocab 49152, 25 steps
#   scratch-small  llama d=256, L=4, H=8, KV=4, ffn=688, seq 128, batch 8, vocab 49152, 25 steps
#   lora           LoRA r=8 alpha 16 on q,v over SmolLM2-135M (Q4_1 base, f32), seq 128, batch 4,
#                  lr 1e-4, 10 steps
# Step time is the median over steps 5..N (PyTorch's timing window); toy's comes from the
# `step` events (tokens / tokens_per_s), so it excludes evaluation, samples and checkpoints.
#
# Environment: TOY (the toy binary; default: build it), TOY_ANCHOR_CACHE (PyTorch venv, model and
# token stream; default ~/.cache/toy-anchors), TOY_ANCHORS (the anchors/pytorch folder; default
# ../shared/anchors/pytorch next to the repo), OUT (results; default /tmp/toy-train-bench),
# THREADS (default 2).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ANCHORS="${TOY_ANCHORS:-$ROOT/../shared/anchors/pytorch}"
CACHE="${TOY_ANCHOR_CACHE:-$HOME/.cache/toy-anchors}"
OUT="${OUT:-/tmp/toy-train-bench}"
THREADS="${THREADS:-2}"
[ -f "$ANCHORS/train_bench.py" ] || {
  echo "error: $ANCHORS/train_bench.py not found: set TOY_ANCHORS to shared/anchors/pytorch" >&2
  exit 1
}
if [ -z "${TOY:-}" ]; then
  (cd "$ROOT" && cargo build --release -p toy-cli >&2)
  TOY="${CARGO_TARGET_DIR:-$ROOT/target}/release/toy"
fi
rm -rf "$OUT" && mkdir -p "$OUT/pytorch" "$OUT/runs"

echo "== PyTorch venv, model and token stream (shared/anchors/pytorch)" >&2
bash "$ANCHORS/setup.sh" >&2
bash "$ANCHORS/fetch_model.sh" >&2
MODEL="$CACHE/model/SmolLM2-135M-Instruct.Q4_1.gguf"

echo "== PyTorch: train_bench.py --parts scratch-tiny,scratch-small,lora" >&2
TOY_ANCHOR_OUT="$OUT/pytorch" TOY_ANCHOR_THREADS="$THREADS" \
  "$CACHE/venv/bin/python" "$ANCHORS/train_bench.py" --parts scratch-tiny,scratch-small,lora >&2
DATA="$CACHE/data/train_tokens.u32"

# toy train NAME ARGS...: one run with its peak RSS (KiB) in $OUT/NAME.rss.
toy_run() {
  local name="$1"
  shift
  echo "== toy: $name" >&2
  RAYON_NUM_THREADS="$THREADS" /usr/bin/time -f "%M" -o "$OUT/$name.rss" \
    "$TOY" --backend cpu train --quiet --runs-dir "$OUT/runs" --run-id "$name" --data "$DATA" \
    --eval-every 0 --sample-every 0 --checkpoint-every 0 "$@" >&2
}
toy_run scratch-tiny --tokenizer "$MODEL" --layers 2 --d-model 64 --heads 4 --kv-heads 2 \
  --ffn 172 --context 64 --seq-len 64 --batch-size 8 --steps 25 --lr 1e-3
toy_run scratch-small --tokenizer "$MODEL" --layers 4 --d-model 256 --heads 8 --kv-heads 4 \
  --ffn 688 --context 128 --seq-len 128 --batch-size 8 --steps 25 --lr 1e-3
toy_run lora --recipe lora --base "$MODEL" --lora-rank 8 --lora-alpha 16 --lora-dropout 0 \
  --lora-targets q,v --seq-len 128 --batch-size 4 --steps 10 --lr 1e-4

python3 - "$OUT" <<'EOF'
import json, os, statistics, sys, platform, subprocess
out = sys.argv[1]
torch = json.load(open(os.path.join(out, "pytorch", "train_bench.json")))["results"]
def toy(name, first):
    steps = [json.loads(l) for l in open(os.path.join(out, "runs", name, "events.jsonl"))]
    steps = [e for e in steps if e.get("event") == "step"]
    ms = [1000 * e["tokens"] / e["tokens_per_s"] for e in steps if e["step"] >= first]
    rss_mb = int(open(os.path.join(out, name + ".rss")).read().split()[-1]) / 1024
    return statistics.median(ms), steps[-1]["tokens"], rss_mb
load = os.getloadavg()[0]
print(f"{platform.node()}, {os.cpu_count()} CPUs, load average {load:.1f} at the end")
print()
print("| workload | toy ms/step | PyTorch ms/step | toy / PyTorch time | toy tokens/s | PyTorch tokens/s | toy peak RSS MB | PyTorch peak RSS MB |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for name in ["scratch-tiny", "scratch-small", "lora"]:
    t = torch[name]
    first = t["timing_window_steps"][0]
    ms, tokens, rss = toy(name, first)
    print(f"| {name} | {ms:.0f} | {t['ms_per_step_median']:.0f} | {ms / t['ms_per_step_median']:.2f} | "
          f"{tokens / ms * 1000:.0f} | {t['tokens_per_s']:.0f} | {rss:.0f} | {t['peak_rss_mb']:.0f} |")
EOF
