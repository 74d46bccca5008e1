#!/usr/bin/env bash
# Twenty-second session, call D: run 117's A/B hit "misaligned address" in a TMA launch after the GPU
# tests had passed; every shape, config and split one at a time, synchronously, to name the launch.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
CUDA_LAUNCH_BLOCKING=1 timeout 170 python3 scripts/w4_tma_ab.py --check-only 2>&1 | grep -v -i warn \
  | tee "$OUT/w4-tma-check.log" | tail -40
