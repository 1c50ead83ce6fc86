#!/usr/bin/env bash
# A memory soak of toy serve: SOAK_S seconds (default 600) of the hostile mixed load of
# toy-serve/tests/py/load_test.py (greedy chat plain and streamed, each checked against its answer
# alone, a ~950-token prompt read cold, plus malformed JSON, unknown models, missing keys,
# oversize bodies and prompts, clients that hang up mid-stream) from CLIENTS closed-loop clients
# (default 16), in two halves with an idle moment after each, the server's RSS and prefix cache
# sampled every 10 s. Prints one JSON line (requests, failures, rss_timeline, the idle RSS after
# each half, the busy peaks of the second and last quarter) and the machine it ran on; exit status
# 1 if any answer was wrong, the server was not idle after a half, or memory grew: idle RSS less
# the prefix cache by more than 5% (or 32 MiB; 10% or 64 MiB under 600 s) between the halves, or (runs of 600 s and more)
# the last quarter's busy peak over the second quarter's by as much. scripts/test.sh runs 120 s.
#
#   TOY_BIN   toy binary (default: $CARGO_TARGET_DIR/release/toy)
#   MODEL     default: $TOY_MODEL_CACHE (~/.cache/toy-models)/SmolLM2-135M-Instruct.Q8_0.gguf
#   CLIENTS   default 16; the server runs --parallel CLIENTS
#   SOAK_S    default 600
set -euo pipefail
cd "$(dirname "$0")/.."
TOY_BIN="${TOY_BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}/release/toy}"
MODEL="${MODEL:-${TOY_MODEL_CACHE:-$HOME/.cache/toy-models}/SmolLM2-135M-Instruct.Q8_0.gguf}"
PY="${TOY_VENV:-$HOME/.cache/toy-venv}/bin/python"
CLIENTS="${CLIENTS:-16}"
SOAK_S="${SOAK_S:-600}"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
key="soak-$RANDOM"
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT

echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# flags: $(lscpu | sed -n 's/^Flags: *//p' | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512[a-z_]*|amx[a-z_]*)$' | tr '\n' ' ')"
echo "# toy serve $(basename "$MODEL") --parallel $CLIENTS, $CLIENTS clients, ${SOAK_S} s"
"$TOY_BIN" serve "$MODEL" --port "$port" --api-key "$key" --parallel "$CLIENTS" --max-queue 256 >/dev/null 2>&1 &
pid=$!
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
"$PY" toy-serve/tests/py/load_test.py "http://127.0.0.1:$port" --key "$key" --pid "$pid" \
  --clients "$CLIENTS" --max-tokens 32 --soak "$SOAK_S"
