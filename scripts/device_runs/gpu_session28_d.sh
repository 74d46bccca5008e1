#!/usr/bin/env bash
# Twenty-eighth session: the whole GPU suite at HEAD, file by file, as far as the call's budget ($1 seconds,
# default 570) goes, over the files named in $2 (default: all) (sessions 14-27 ran only the files their changes touched). One summary line per file and
# the slowest tests; full logs in $OUT. MARK: the marker expression (default gpu; e.g. "gpu and not sweep").
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
start=$SECONDS
budget=${1:-570}
files=${2:-"test_gpu_engine test_kernels_attention test_kv_fp8 test_kernels_sparse test_kernels_lightning
             test_sampler test_kernels_gemv test_gpu_quant"}
for f in $files; do
  left=$((budget - (SECONDS - start)))
  [ "$left" -lt 20 ] && { echo "$f: not run (budget spent)"; continue; }
  timeout "$left" python3 -m pytest -m "${MARK:-gpu}" -p no:cacheprovider -rfE --tb=short --durations=3 "tests/$f.py" \
    > "$OUT/$f.log" 2>&1
  rc=$?
  echo "$f (rc $rc, $((SECONDS - start))s): $(grep -E '(passed|failed|error)' "$OUT/$f.log" | tail -1)"
  grep -E "^FAILED|^ERROR" "$OUT/$f.log" | head -5
done
