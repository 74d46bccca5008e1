#!/usr/bin/env bash
# Thirtieth session, call F: the issue's decode row re-measured at today's code, one machine start: bf16, w4a16
# and fp8 weights, batch 1 at 4096 tokens, one `profile_step --graph` process each (cold Triton cache).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
PROFILE_TIMEOUT=110 profile_graph bf16-4k --batch 1 --context 4096
PROFILE_TIMEOUT=190 profile_graph w4a16-4k --batch 1 --context 4096 --quantization w4a16
PROFILE_TIMEOUT=170 profile_graph fp8-4k --batch 1 --context 4096 --quantization fp8
