#!/usr/bin/env bash
# Twenty-eighth session: fp8 against bf16 KV pages at 128K with batches (profile_step --ab-kv-cache, one process
# each). At batch 1 the decode attention is latency-bound (run 145: fp8 +0.009 ms at 131080). Each sequence's
# sparse layers read ~96 selected pages per KV head (64 top-k + 32 local): ~6.3 MB per layer in bf16, half in
# fp8, so with more sequences the bytes should start to count. Prediction: batch 8 fp8 -0.2..-0.6% of the
# step; batch 32 -1..-2%.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
PROFILE_TIMEOUT=280 profile_graph ab-kv-b8 --batch 8 --context 131080 --ab-kv-cache --rounds 5
PROFILE_TIMEOUT=300 profile_graph ab-kv-b32 --batch 32 --context 131080 --ab-kv-cache --rounds 5
