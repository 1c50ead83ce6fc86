#!/usr/bin/env bash
# toy serve next to llama.cpp's llama-server under the same load: 32 concurrent clients × 4
# greedy chat requests (half streamed) of 16 tokens, 4 sequences at once on each server, 2
# threads, the same Q8_0 file. Prints both JSON results from toy-serve/tests/py/load_test.py.
#
#   LLAMA_SERVER  llama-server binary (default: ~/.cache/toy-anchors/llamacpp/build-noamx/bin/llama-server)
#   TOY_BIN       toy binary (default: $CARGO_TARGET_DIR/release/toy)
#   MODEL         default: ~/.cache/toy-models/SmolLM2-135M-Instruct.Q8_0.gguf
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER="${LLAMA_SERVER:-$HOME/.cache/toy-anchors/llamacpp/build-noamx/bin/llama-server}"
TOY_BIN="${TOY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}/release/toy}"
MODEL="${MODEL:-$HOME/.cache/toy-models/SmolLM2-135M-Instruct.Q8_0.gguf}"
PY="${TOY_VENV:-$HOME/.cache/toy-venv}/bin/python"
LOAD=(--bench --clients 32 --requests 4 --max-tokens 16 --waves 1)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { for _ in $(seq 120); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.5; done; return 1; }

echo "# $(date -u +%FT%TZ) $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
p=$(port)
"$TOY_BIN" serve "$MODEL" --port "$p" --max-concurrency 4 >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_health "http://127.0.0.1:$p"
echo "toy serve: $("$PY" toy-serve/tests/py/load_test.py "http://127.0.0.1:$p" --pid $pid "${LOAD[@]}")"
kill $pid; wait $pid 2>/dev/null || true

p=$(port)
"$LLAMA_SERVER" -m "$MODEL" --port "$p" -c 8192 -np 4 -t 2 --no-webui >/dev/null 2>&1 &
pid=$!
wait_health "http://127.0.0.1:$p"
echo "llama-server: $("$PY" toy-serve/tests/py/load_test.py "http://127.0.0.1:$p" --pid $pid "${LOAD[@]}")"
kill $pid; wait $pid 2>/dev/null || true
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
