#!/usr/bin/env bash
# One device call: the soar-quick S1/S8/Smax run against a server on the full-size dummy model.
#   scripts/device_runs/gpu_soar_quick.sh ["extra serve flags"]
# Copies result.json, report.md, the latency plots and the server log tail into $OUT.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
python3 -c "import fastapi, uvicorn, fla" || exit 1
python3 -m salaserve.cli make-checkpoint --preset full --out /tmp/full --no-weights
RUN=/tmp/soar-quick
python3 -m salaserve.cli bench run --workload soar-quick --model /tmp/full --seed 0 \
  --server-args "--load-format dummy ${1:-}" --out "$RUN" --no-progress --start-timeout 900
rc=$?
cp "$RUN"/result.json "$RUN"/report.md "$RUN"/latency_*.png "$OUT"/ 2>/dev/null
tail -200 "$RUN"/server.log > "$OUT"/server_tail.log 2>/dev/null
cat "$RUN"/report.md 2>/dev/null
exit $rc
