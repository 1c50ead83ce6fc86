#!/usr/bin/env bash
# Coverage-guided fuzzing of toy's parsers on the stable toolchain (libFuzzer via libfuzzer-sys).
#
#   scripts/fuzz.sh                      every target for 60 s (what CI runs)
#   scripts/fuzz.sh gguf 3600            one target for an hour
#   scripts/fuzz.sh gguf 0 -jobs=2       extra libFuzzer flags after the seconds (0: no limit)
#   scripts/fuzz.sh --list               the targets
#
# cargo-fuzz needs nightly for its sanitizers; without them it only adds these flags, which
# stable rustc takes: SanitizerCoverage's inline 8-bit counters, PC table and comparison
# tracing (what libFuzzer's coverage feedback reads), debug assertions and overflow checks (so
# an arithmetic overflow on hostile input is a crash, as in a debug build), and `--cfg fuzzing`.
#
# The corpus grows in $TOY_FUZZ_DIR/<target> (default ~/.cache/toy-fuzz), seeded from committed
# files (`seeds` below: the GGUF and tokenizer fixtures, fuzz/seeds/<target>). A crash is written
# to $TOY_FUZZ_DIR/<target>-artifacts/crash-* and fails the run; replay one with
# `$CARGO_TARGET_DIR/fuzz/<host>/release/<target> FILE`. Inputs are capped at 1 MiB (chat
# templates at 16 KiB) and a run at 2 GiB of RSS.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=(gguf tokenizer_text tokenizer_vocab chat_template)
if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${TARGETS[@]}"; exit 0; fi
if [[ $# -gt 0 ]]; then TARGETS=("$1"); shift; fi
SECONDS_EACH="${1:-60}"; shift || true
if ! command -v c++ >/dev/null; then
  # libfuzzer-sys compiles libFuzzer (C++) into each target.
  echo "[fuzz] installing g++ for libFuzzer" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
HOST="$(rustc -vV | sed -n 's/^host: //p')"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/toy-target}/fuzz"
# `--target` keeps these flags off build scripts and proc macros (as cargo-fuzz does).
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo build --release --locked --manifest-path fuzz/Cargo.toml --target "$HOST" \
  $(printf -- '--bin %s ' "${TARGETS[@]}")
WORK="${TOY_FUZZ_DIR:-$HOME/.cache/toy-fuzz}"
seeds() {
  case "$1" in
    gguf) echo fixtures/gguf fixtures/tokenizer fixtures/quant/kernels ;;
    chat_template) echo fuzz/seeds/chat_template fixtures/chat ;;
    tokenizer_vocab) ;;  # structured input (`arbitrary`): libFuzzer starts from nothing
    *) echo "fuzz/seeds/$1" ;;
  esac
}
for t in "${TARGETS[@]}"; do
  mkdir -p "$WORK/$t" "$WORK/$t-artifacts"
  echo "== fuzz $t for ${SECONDS_EACH}s (corpus $WORK/$t)" >&2
  max_len=1048576
  mode=()
  if [[ "$t" == chat_template ]]; then
    # A chat template stays under 16 KiB: a longer chain of operators runs minijinja's parser
    # out of stack, which only the render sandbox contains (this build renders in process).
    max_len=16384
    # Nor can an in-process render survive a string grown by concatenation until memory runs
    # out; in toy the sandbox's address-space limit turns that into an error (tested in
    # toy-core). So libFuzzer runs this target in fork mode, where such an input is written to
    # the artifacts as oom-* and the run goes on; crashes and hangs still stop it.
    mode=(-fork=1 -ignore_ooms=1 -ignore_timeouts=0 -ignore_crashes=0)
  fi
  ooms_before=$(find "$WORK/$t-artifacts" -name 'oom-*' | wc -l)
  # shellcheck disable=SC2046
  "$CARGO_TARGET_DIR/$HOST/release/$t" "$WORK/$t" $(seeds "$t") "${mode[@]}" \
    -max_total_time="$SECONDS_EACH" -max_len="$max_len" -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$WORK/$t-artifacts/" -print_final_stats=1 "$@"
  ooms=$(( $(find "$WORK/$t-artifacts" -name 'oom-*' | wc -l) - ooms_before ))
  if (( ooms > 0 )); then
    echo "[fuzz] $t: $ooms input(s) ran out of memory in process (contained by the sandbox in toy;" \
      "see whether a filter could refuse them sooner): $WORK/$t-artifacts/oom-*" >&2
  fi
done
