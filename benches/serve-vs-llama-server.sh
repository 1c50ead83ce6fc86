#!/usr/bin/env bash
# toy serve next to llama.cpp's llama-server under the same load, one run: for each client count
# (8, 32, 64) every client sends 4 greedy chat requests (half streamed) of 32 tokens, closed
# loop. Each server runs at its best setting for that load: as many sequences at once as clients
# (toy --parallel N, llama-server -np N with continuous batching, its default), 2 threads, the
# same Q8_0 file, a context of 512 tokens per sequence. Prints one JSON line per server and load
# from toy-serve/tests/py/load_test.py (req/s, completion tok/s, p50/p99 latency, time to first
# token, RSS) and the machine it ran on.
#
#   LLAMA_SERVER  llama-server binary (default: ~/.cache/toy-anchors/llamacpp/build/bin/llama-server;
#                 on an Intel Xeon with AMX, llama.cpp's native AMX kernels segfault on these VMs:
#                 build it with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16, docs/performance.md)
#   TOY_BIN       toy binary (default: $CARGO_TARGET_DIR/release/toy)
#   MODEL         default: ~/.cache/toy-models/SmolLM2-135M-Instruct.Q8_0.gguf
#   CLIENTS       default: "8 32 64"
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER="${LLAMA_SERVER:-$HOME/.cache/toy-anchors/llamacpp/build/bin/llama-server}"
TOY_BIN="${TOY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}/release/toy}"
MODEL="${MODEL:-$HOME/.cache/toy-models/SmolLM2-135M-Instruct.Q8_0.gguf}"
PY="${TOY_VENV:-$HOME/.cache/toy-venv}/bin/python"
CLIENTS="${CLIENTS:-8 32 64}"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { for _ in $(seq 240); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT

echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# flags: $(lscpu | sed -n 's/^Flags: *//p' | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512[a-z_]*|amx[a-z_]*)$' | tr '\n' ' ')"
for n in $CLIENTS; do
  load=(--bench --clients "$n" --requests 4 --max-tokens 32 --waves 1)
  p=$(port)
  "$TOY_BIN" serve "$MODEL" --port "$p" --parallel "$n" --ctx 512 --max-queue 256 >/dev/null 2>&1 &
  pid=$!
  wait_health "http://127.0.0.1:$p"
  echo "toy serve --parallel $n: $("$PY" toy-serve/tests/py/load_test.py "http://127.0.0.1:$p" --pid $pid "${load[@]}")"
  kill $pid; wait $pid 2>/dev/null || true

  p=$(port)
  "$LLAMA_SERVER" -m "$MODEL" --port "$p" -c $((512 * n)) -np "$n" -t 2 --no-webui >/dev/null 2>&1 &
  pid=$!
  wait_health "http://127.0.0.1:$p"
  echo "llama-server -np $n: $("$PY" toy-serve/tests/py/load_test.py "http://127.0.0.1:$p" --pid $pid "${load[@]}")"
  kill $pid; wait $pid 2>/dev/null || true
done
pid=
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
