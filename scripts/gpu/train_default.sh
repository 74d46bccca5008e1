#!/usr/bin/env bash
# Train the built-in default model on the GPU machine, with `.corpus/` carried (made here by
# `python -m tools.small_data --out .corpus/code.jsonl.xz`), then optionally its EAGLE-3 head:
#   scripts/gpu/train_default.sh [TRAIN_SMALL_ARGS...]
#   DRAFT_ARGS="--samples 4096 --steps 1500" scripts/gpu/train_default.sh --minutes 4.5 ...
# The machine returns at most 8 files of 16 MiB: $OUT gets train.log, the checkpoint's metrics.json
# and README.md, and model.safetensors in 15 MiB parts (here: `cat model.safetensors.part-* >
# model.safetensors`; config and tokenizer files are the preset's and write_tokenizer's). With
# DRAFT_ARGS, also the head's model.safetensors and config.json as eagle3-*.
set -uo pipefail
source "$(dirname "$0")/env.sh"
model=/tmp/default_model
python3 -m tools.train_small --out "$model" --extra-corpus .corpus/code.jsonl.xz "$@" 2>&1 \
  | grep -v -i -E "warn|deprecat" > "$OUT/train.log"
rc=${PIPESTATUS[0]}
grep -v -E "^step [0-9]+/" "$OUT/train.log" | tail -30
[ -f "$model/model.safetensors" ] && split -b 15M "$model/model.safetensors" "$OUT/model.safetensors.part-"
cp "$model"/metrics.json "$model"/README.md "$OUT/" 2>/dev/null
[ "$rc" -ne 0 ] && exit "$rc"
if [ -n "${DRAFT_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m salaserve.cli train-draft --model "$model" --out /tmp/draft --device cuda $DRAFT_ARGS 2>&1 \
    | grep -v -i -E "warn|deprecat" > /tmp/draft.log
  rc=${PIPESTATUS[0]}
  tail -12 /tmp/draft.log
  for f in model.safetensors config.json; do cp "/tmp/draft/head/$f" "$OUT/eagle3-$f" 2>/dev/null; done
fi
exit "$rc"
