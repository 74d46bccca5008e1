#!/usr/bin/env bash
# The end-to-end metric on the GPU machine: `salaserve bench e2e` (soar-quick S1/S8/Smax on the full-size
# dummy model, each tier beside its floor) for the configurations given, one server after another.
#   scripts/gpu/e2e.sh [--config NAME[@TIERS]=FLAGS ...] [--tiers S1,S8,Smax]   (default configs: bf16, w4a16, fp8;
#                                                   @Smax: that configuration runs only Smax)
# Writes $OUT/latest.json (copy it to benchmarks/e2e/latest.json) and, per configuration, the server log's
# tail and the step trace when the flags ask for one (--step-trace /tmp/e2e/NAME.steps).
# The machine's git metadata can be older than the files it runs: each configuration's `git_tree` names
# the code; `git log --format='%H %T' | grep TREE` finds its commit.
set -uo pipefail
source "$(dirname "$0")/env.sh"
python3 -c "import fastapi, uvicorn, fla" || exit 1
python3 -m salaserve.cli bench e2e --out "$OUT/latest.json" --work-dir /tmp/e2e "$@" 2>&1 \
  | grep -v -i -E "warn|deprecat" | tee "$OUT/e2e.log" | grep -v "^ " | tail -40
rc=${PIPESTATUS[0]}
for d in /tmp/e2e/*/; do
  name=$(basename "$d")
  grep -E "ready:|cold path|start-up|warm-up|ERROR|Traceback" "$d/server.log" | tail -30 > "$OUT/server-$name.log"
done
exit "$rc"
