#!/usr/bin/env bash
# Twelfth session: is the 4K decode step of runs 58-59 (4.87 ms, 4.76 in run 54) a regression? The
# session's start (b33bdea, unpacked under old_b33/) against HEAD, interleaved, in one call.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
micro() {  # name, directory holding the salaserve package to run
  (cd "$2" && PYTHONPATH=/tmp/site timeout 100 python3 -m salaserve.bench.micro --contexts 4096 --batches 1 \
    --prefill "" --json "$OUT/micro-$1.json" 2>&1 | grep -v -i warn | tail -1 | sed "s/^/$1 /")
}
micro head "$PWD"; micro b33bdea "$PWD/old_b33"; micro head2 "$PWD"; micro b33bdea2 "$PWD/old_b33"
