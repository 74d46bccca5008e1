#!/usr/bin/env bash
# Train the built-in default model on the GPU machine, with `.corpus/` carried (made here by
# `python -m tools.small_data --out .corpus/code.jsonl.xz`), then optionally its EAGLE-3 head:
#   scripts/gpu/train_default.sh [TRAIN_SMALL_ARGS...]
#   DRAFT_ARGS="--samples 4096 --steps 1500" scripts/gpu/train_default.sh --minutes 4.5 ...
# Writes $OUT/default_model (copy it to salaserve/assets/default_model/), $OUT/train.log and, with
# DRAFT_ARGS, $OUT/eagle3 (the head) and $OUT/draft.log.
set -uo pipefail
source "$(dirname "$0")/env.sh"
python3 -m tools.train_small --out "$OUT/default_model" --extra-corpus .corpus/code.jsonl.xz "$@" 2>&1 \
  | grep -v -i -E "warn|deprecat" > "$OUT/train.log"
rc=${PIPESTATUS[0]}
grep -v -E "^step [0-9]+/" "$OUT/train.log" | tail -30
[ "$rc" -ne 0 ] && exit "$rc"
if [ -n "${DRAFT_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m salaserve.cli train-draft --model "$OUT/default_model" --out /tmp/draft --device cuda $DRAFT_ARGS 2>&1 \
    | grep -v -i -E "warn|deprecat" > "$OUT/draft.log"
  rc=${PIPESTATUS[0]}
  tail -12 "$OUT/draft.log"
  [ -d /tmp/draft/head ] && cp -r /tmp/draft/head "$OUT/eagle3" && cp /tmp/draft/curves.json "$OUT/eagle3/"
fi
exit "$rc"
