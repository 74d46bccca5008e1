# Sourced by the device scripts (scripts/device_runs/gpu_*.sh): installs the carried wheels (.whl, see README),
# puts them and the checkout on PYTHONPATH, and makes $OUT.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Triton's compiled kernels kept in the checkout (ignored), reused while the machine stays warm.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
# The GPU tests, verbose enough to keep the printed errors and the summary line (pyproject's
# addopts already has -q).
GPU_PYTEST="python3 -m pytest -m gpu -s -p no:cacheprovider -rfE --tb=short"
# Decode at 4K context, batches 1 and 8, no prefill (salaserve.bench.micro), the shared step of the
# quantized-vs-bf16 device scripts: decode_4k LABEL TIMEOUT TAIL_LINES [more micro arguments].
# Writes $OUT/micro-LABEL.json and .log, prints the log's last lines.
decode_4k() {
  local label=$1 limit=$2 lines=$3
  shift 3
  timeout "$limit" python3 -m salaserve.bench.micro --contexts 4096 --batches 1,8 --prefill "" "$@" \
    --json "$OUT/micro-$label.json" 2>&1 | grep -v -i warn | tee "$OUT/micro-$label.log" | tail -"$lines"
}
# One `profile_step --graph` process: profile_graph NAME ARGS... writes $OUT/NAME.log and .json and prints one
# line with its graph replay (or, with --ab / --ab-kv-cache, each variant's median). PROFILE_TIMEOUT: seconds
# (default 200).
profile_graph() {
  local name=$1
  shift
  timeout "${PROFILE_TIMEOUT:-200}" python3 -m salaserve.bench.profile_step --graph --top 14 --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v -i warn > "$OUT/$name.log"
  echo "$name ($*): $(grep -E 'graph replay|median' "$OUT/$name.log" | cut -c1-110 | tr '\n' ' ')"
}
# One `profile_step --prefill 32768` process (eager, under the profiler): prefill_profile NAME ARGS... writes
# $OUT/NAME.log and .json and prints the prefill's line and the rows of the kernels matching PREFILL_KERNELS
# (default: the sparse attention kernels, the fp8 pages' dequantize and the KV stores).
prefill_profile() {
  local name=$1
  shift
  timeout "${PROFILE_TIMEOUT:-200}" python3 -m salaserve.bench.profile_step --prefill 32768 --top 24 \
    --json "$OUT/$name.json" "$@" 2>&1 | grep -v -i warn > "$OUT/$name.log"
  echo "$name: $(grep -E '^prefill of' "$OUT/$name.log")"
  grep -E "${PREFILL_KERNELS:-_sparse_prefill_attn_kernel|_sparse_window_attn_kernel|_dequantize_pages|_store_kv}" \
    "$OUT/$name.log"
}
