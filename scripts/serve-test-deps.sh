#!/usr/bin/env bash
# What the `toy serve` tests need besides Rust: a Python venv with the official `openai` client
# (pydantic comes with it), `jsonschema` (the structured-output test validates with it) and
# `websockets` (for the DevTools protocol), and headless Chromium for the chat-page test.
# Idempotent and fast when everything is already there.
#
#   TOY_VENV   the venv (default: $HOME/.cache/toy-venv); the tests look for it there too
set -euo pipefail
VENV="${TOY_VENV:-$HOME/.cache/toy-venv}"

if ! "$VENV/bin/python" -c 'import openai, websockets, jsonschema' 2>/dev/null; then
  echo "[serve-deps] creating $VENV with openai, websockets and jsonschema from PyPI" >&2
  [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check 'openai>=1.50,<3' 'websockets>=12' 'jsonschema>=4'
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "[serve-deps] installing Debian's chromium (headless chat-page test)" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
