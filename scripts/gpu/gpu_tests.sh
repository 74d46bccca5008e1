#!/usr/bin/env bash
# The GPU test suite, or part of it, on the GPU machine:
#   scripts/gpu/gpu_tests.sh [MARKER_EXPR] [PYTEST_ARGS...]      (default marker expression: gpu)
#   scripts/gpu/gpu_tests.sh "gpu and not sweep"                 every GPU test but the config sweeps
#   scripts/gpu/gpu_tests.sh gpu tests/test_gpu_quant.py::test_decode_kernels tests/test_kv_fp8.py
# Select tests by node id (file::test), not by -k: on the device -k has selected far more than asked.
# Prints the failures and the summary line; the whole log goes to $OUT/gpu-tests.log.
set -uo pipefail
source "$(dirname "$0")/env.sh"
marker=${1:-gpu}
[ $# -gt 0 ] && shift
python3 -m pytest -m "$marker" -s -p no:cacheprovider -rfE --tb=short "$@" 2>&1 \
  | grep -v -i -E "warn|deprecat" > "$OUT/gpu-tests.log"
rc=${PIPESTATUS[0]}
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/gpu-tests.log" | tail -40
exit "$rc"
