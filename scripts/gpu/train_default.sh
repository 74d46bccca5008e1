#!/usr/bin/env bash
# Train the built-in default model on the GPU machine, with `.corpus/` carried (made here by
# `python -m tools.small_data --out .corpus/code.jsonl.xz`):
#   scripts/gpu/train_default.sh [TRAIN_SMALL_ARGS...]
# The machine returns at most 8 files of 16 MiB: $OUT gets train.log, the checkpoint's metrics.json
# and README.md, and model.safetensors in 15 MiB parts (here: `cat model.safetensors.part-* >
# model.safetensors`; config and tokenizer files are the preset's and write_tokenizer's).
set -uo pipefail
source "$(dirname "$0")/env.sh"
model=/tmp/default_model
python3 -m tools.train_small --out "$model" --extra-corpus .corpus/code.jsonl.xz "$@" 2>&1 \
  | grep -v -i -E "warn|deprecat" > "$OUT/train.log"
rc=${PIPESTATUS[0]}
grep -v -E "^step [0-9]+/" "$OUT/train.log" | tail -30
[ -f "$model/model.safetensors" ] && split -b 15M "$model/model.safetensors" "$OUT/model.safetensors.part-"
cp "$model"/metrics.json "$model"/README.md "$OUT/" 2>/dev/null
exit "$rc"
