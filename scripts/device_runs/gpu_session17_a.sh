#!/usr/bin/env bash
# Seventeenth session, first device call: the fp8 GEMV behind a cp.async pipeline (stream configs).
# GPU tests of the new path, the per-linear A/B at M = 1 and 8, fp8 decode at 4K (batches 1, 8; the
# calibration now includes the stream configs), bf16 in the same call for the ratio.
set -uo pipefail
source "$(dirname "$0")/../device_env.sh"
timeout 150 $GPU_PYTEST tests/test_gpu_quant.py -k "stream or calibration_records or fma_gemv_every" 2>&1 \
  | tee "$OUT/pytest.log" | tail -4
timeout 200 python3 scripts/fp8_gemv_ab.py "$OUT/fp8-ab.json" 1 8 2>&1 | grep -v -i warn | tee "$OUT/fp8-ab.log" \
  | grep -v "^           [a-z]*:\|^           fma n\|^           stream n" | tail -40
decode_4k fp8 150 4 --quantization fp8
decode_4k bf16 90 3
# triton 3.6 here (3.9 on the CPU box): did its pipeliner turn the stream loop into cp.async copies?
echo "fp8 GEMV PTX with cvt e4m3x2 and 16-byte cp.async: $(grep -l 'cvt.rn.f16x2.e4m3x2' "$TRITON_CACHE_DIR"/*/_gemv_kernel.ptx 2>/dev/null | xargs -r grep -l 'cp.async.cg.shared.global' | wc -l)"
