#!/usr/bin/env bash
# Kernel-level measurements on the GPU machine, one process per call, on the full-size model with
# dummy weights unless --model is given:
#   scripts/gpu/micro.sh micro NAME [ARGS...]    python -m benchmarks.micro ARGS: decode step per
#                                                 (batch, context), prefill, floors
#   scripts/gpu/micro.sh decode NAME [ARGS...]   the same at 4K, batches 1 and 8, no prefill: the decode
#                                                 row of BENCHMARKS.md (e.g. --quantization w4a16)
#   scripts/gpu/micro.sh graph NAME [ARGS...]    python -m benchmarks.profile_step --graph ARGS: one
#                                                 line with the replay (with --ab / --ab-kv-cache, each
#                                                 variant's median)
#   scripts/gpu/micro.sh mixed NAME [ARGS...]    profile_step ARGS (e.g. --mixed 128 --batch 31 --context 16384):
#                                                 one eager prefill-carrying step's wall, host and kernel time
#   scripts/gpu/micro.sh prefill NAME [ARGS...]  profile_step --prefill 32768 ARGS: the prefill line and
#                                                 the rows of the kernels matching $KERNELS (default: the
#                                                 sparse attention kernels, the fp8 pages' dequantize, the
#                                                 KV stores)
# Writes $OUT/NAME.json and $OUT/NAME.log. TIMEOUT: seconds per process (default 600; 200 for graph, mixed and
# prefill).
set -uo pipefail
source "$(dirname "$0")/env.sh"
if [ $# -lt 2 ]; then
  sed -n '2,18p' "$0"
  exit 2
fi
mode=$1 name=$2
shift 2
log="$OUT/$name.log"
case "$mode" in
  micro|decode)
    [ "$mode" = decode ] && set -- --contexts 4096 --batches 1,8 --prefill "" "$@"
    timeout "${TIMEOUT:-600}" python3 -m benchmarks.micro "$@" --json "$OUT/$name.json" 2>&1 \
      | grep -v -i warn > "$log"
    rc=${PIPESTATUS[0]}
    tail -30 "$log"
    ;;
  graph)
    timeout "${TIMEOUT:-200}" python3 -m benchmarks.profile_step --graph --top 14 --json "$OUT/$name.json" "$@" \
      2>&1 | grep -v -i warn > "$log"
    rc=${PIPESTATUS[0]}
    echo "$name ($*): $(grep -E 'graph replay|median' "$log" | cut -c1-110 | tr '\n' ' ')"
    ;;
  mixed)
    timeout "${TIMEOUT:-200}" python3 -m benchmarks.profile_step --top 14 --json "$OUT/$name.json" "$@" \
      2>&1 | grep -v -i warn > "$log"
    rc=${PIPESTATUS[0]}
    echo "$name: $(grep -E '^(mixed step|under the profiler)' "$log" | tr '\n' ' ')"
    ;;
  prefill)
    timeout "${TIMEOUT:-200}" python3 -m benchmarks.profile_step --prefill 32768 --top 24 \
      --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn > "$log"
    rc=${PIPESTATUS[0]}
    echo "$name: $(grep -E '^prefill of' "$log")"
    grep -E "${KERNELS:-_sparse_prefill_attn_kernel|_sparse_window_attn_kernel|_dequantize_pages|_store_kv}" "$log"
    ;;
  *)
    echo "unknown mode $mode (micro, decode, graph, mixed, prefill)" >&2
    exit 2
    ;;
esac
exit "$rc"
