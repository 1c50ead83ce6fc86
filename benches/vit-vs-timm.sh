#!/usr/bin/env bash
# ViT training speed side by side: `toy train --arch vit-tiny` and PyTorch + timm
# (benches/vit_timm_step.py) on the same model (toy's vit-tiny shape: d 96, 4 blocks of 3 heads,
# MLP 384, 4×4 patches), batch (64), images (the bundled digits, fixtures/digits/train) and thread
# count, in one run. Prints a markdown table of median step time and peak RSS per image size,
# and toy / PyTorch ratios, with the CPU's model and flags.
#
#   benches/vit-vs-timm.sh        (~3 minutes on 2 cores, plus a one-time PyTorch + timm venv)
#
# toy's step time comes from its `step` events (images / images_per_s): forward, backward,
# clipping and AdamW, and also decoding and transforming the step's PNGs, which the PyTorch side
# does once before timing. Both are medians over steps 5..STEPS.
#
# Environment: TOY (the toy binary; default: build it), VENV (PyTorch + timm; default
# ~/.cache/toy-vit-venv), OUT (default /tmp/toy-vit-bench), THREADS (default 2), STEPS (30).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$HOME/.cache/toy-vit-venv}"
OUT="${OUT:-/tmp/toy-vit-bench}"
THREADS="${THREADS:-2}"
STEPS="${STEPS:-30}"
if [ -z "${TOY:-}" ]; then
  (cd "$ROOT" && cargo build --release -p toy-cli >&2)
  TOY="${CARGO_TARGET_DIR:-$ROOT/target}/release/toy"
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --index-url https://download.pytorch.org/whl/cpu torch torchvision >&2 ||
    "$VENV/bin/pip" install --quiet torch torchvision >&2
  "$VENV/bin/pip" install --quiet timm safetensors >&2
fi
rm -rf "$OUT" && mkdir -p "$OUT/runs"
DATA="$ROOT/fixtures/digits"

for size in 16 32; do
  echo "== toy: vit-tiny at ${size}x${size}" >&2
  RAYON_NUM_THREADS="$THREADS" /usr/bin/time -f "%M" -o "$OUT/toy-$size.rss" \
    "$TOY" --backend cpu train --arch vit-tiny --quiet --runs-dir "$OUT/runs" --run-id "s$size" \
    --data "$DATA" --image-size "$size" --crop-padding 0 --batch-size 64 --steps "$STEPS" \
    --eval-every 0 --checkpoint-every 0 >&2
  echo "== PyTorch + timm: the same at ${size}x${size}" >&2
  /usr/bin/time -f "%M" -o "$OUT/torch-$size.rss" \
    "$VENV/bin/python" "$ROOT/benches/vit_timm_step.py" "$DATA/train" "$size" "$STEPS" \
    "$OUT/torch-$size.json" --threads "$THREADS" >&2
done

python3 - "$OUT" <<'PY'
import json, os, statistics, subprocess, sys
out = sys.argv[1]
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
field = lambda name: next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith(name)), "?")
flags = [f for f in field("Flags").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
print(f"CPU: {field('Model name')}; {os.cpu_count()} CPUs; flags: {' '.join(flags)}; load average {os.getloadavg()[0]:.1f} at the end")
print()
print("| images | toy ms/step | PyTorch+timm ms/step | toy / PyTorch time | toy peak RSS MB | PyTorch peak RSS MB |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
rss = lambda name: int(open(os.path.join(out, name + ".rss")).read().split()[-1]) / 1024
for size in (16, 32):
    events = [json.loads(l) for l in open(os.path.join(out, "runs", f"s{size}", "events.jsonl"))]
    ms = [1000 * e["tokens"] / e["tokens_per_s"] for e in events if e.get("event") == "step" and e["step"] >= 5]
    toy = statistics.median(ms)
    torch = json.load(open(os.path.join(out, f"torch-{size}.json")))["ms_per_step"]
    print(f"| {size}×{size}, batch 64 | {toy:.0f} | {torch:.0f} | {toy / torch:.2f}× | {rss(f'toy-{size}'):.0f} | {rss(f'torch-{size}'):.0f} |")
PY
