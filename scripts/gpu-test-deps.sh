#!/usr/bin/env bash
# What the wgpu tests need on a machine without a GPU: Mesa's Vulkan drivers, whose lavapipe
# (a software Vulkan device) runs toy's cubecl kernels on the CPU. Idempotent and fast when the
# driver is already there. Machines with a GPU and its Vulkan driver need nothing from this.
set -euo pipefail
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  echo "[gpu-deps] installing mesa-vulkan-drivers (lavapipe) for the wgpu tests" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers >/dev/null
fi
