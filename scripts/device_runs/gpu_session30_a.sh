#!/usr/bin/env bash
# Thirtieth session, call A: fp8 against bf16 KV pages under the twenty-ninth session's defaults (staged fp8
# prefill, the two-wave decode split rule) at 131080 tokens, batches 1 and 32, one process each
# (`--ab-kv-cache`); then batch 32's split count, old rule (2) against the new (0 = the rule: 4), bf16 pages.
# Predictions: docs/perf-notes.md (twenty-ninth session: kv b1 +0.010..+0.020 ms, b32 -0.4..-0.8%;
# thirtieth session: 4 splits -0.3..-1.0% against 2).
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
PROFILE_TIMEOUT=170 profile_graph ab-kv-b1 --batch 1 --context 131080 --ab-kv-cache --rounds 7
PROFILE_TIMEOUT=200 profile_graph ab-kv-b32 --batch 32 --context 131080 --ab-kv-cache --rounds 5
PROFILE_TIMEOUT=200 profile_graph ab-splits-b32 --batch 32 --context 131080 \
  --ab salaserve.kernels.attention:DECODE_NUM_SPLITS=2,0 --rounds 5
