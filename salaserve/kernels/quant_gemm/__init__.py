"""Triton kernels for quantized linear layers (bf16 activations) and the dispatch by M
(`quant_linear`; the table is in docs/quantization.md).

  w4a16 (GPTQ int4, v2 zeros, group scales, optional act-order g_idx / channel perm):
      - M <= 16 (decode, verify), where `calibrate_w4` timed the shape at start-up: the fastest of
        `w4a16_gemv_dp2a` (M <= 2: x rounded to int16, integer dot products; where it cannot run,
        `w4a16_gemv_fma` instead), `w4a16_gemv_fma` (3 <= M <= 4) and `w4a16_gemv_wgmma` (M >= 4,
        on a repacked copy of the weights) (kernel, config and split-K per shape and M bucket).
      - M <= W4_FMA_MAX_M otherwise: `w4a16_gemv_fma`, each nibble read into an fp32 mantissa as
        16 + q/16 or 1 + q/16 (a shift per two nibbles, a lop3 and an fma per nibble).
      - M > 16 with an fp8 copy (`QuantizedLinearWeights.prefill`, made at start-up on GPUs with fp8
        tensor cores; dispatch.FP8_COPY_ABOVE_ROWS): the copy as fp8 weights below (w8a16 up to
        GEMV_MAX_M, w8a8 on cuBLAS above). Without it:
      - M <= GEMV_MAX_M: `w4a16_gemv`, split-K, tl.dot with BLOCK_M 16..64 on a [BK, BN] tile
        unpacked in registers (or fp32 FMAs at M = 1: the older decode kernel).
      - prefill:
        `w4a16_dense_mm`, W dequantized into a shared bf16 scratch, then cuBLAS
        (`w4a16_gemm`, the dequantize-in-tile GEMM, stays for act-order without reordering).
  fp8 (e4m3 weights, fp32 per-channel scale):
      - M <= 8, where `calibrate_fp8_gemv` measured it faster than w8a16: gemv/'s FMA GEMV on
        the fp8 codes (`gemv_fp8`, cvt-converted in registers; with PDL and, at one row, the
        silu_mul epilogue on gate_up).
      - M <= GEMV_MAX_M otherwise: `w8a16_gemv`, split-K on tensor cores (x padded to 16 rows)
        with the weights converted to bf16 and x exact.
      - above: w8a8 on cuBLAS (`quantize_rows_fp8`, one kernel for the per-token activation
        scales, then `torch._scaled_mm` with rowwise weight scales).

Split-K reduction is done inside the same launch: every split writes an fp32 partial, bumps a
per-tile counter, and the last one to arrive sums the partials in split order and writes the
output. One launch per linear (a separate reduce or memset kernel would cost ~4 us each inside a
CUDA graph, x 4 linears x 32 layers), deterministic results, counters re-armed by the kernel.

int4 -> float without the slow int->float convert: (nibble | 0x4B000000) read as fp32 is exactly
2**23 + nibble, so subtracting (2**23 + zero) gives q - zero in one FADD.

Weights are read once per launch: K*N/2 bytes of int4 plus fp16 scales and packed zeros (~4% more
at group 128). Act-order checkpoints should go through formats.reorder_act_order at load time: the
kernels then gather x through perm and keep one scale row per K tile; the per-channel g_idx lookup
(ACT_ORDER) stays correct but gathers scales and zeros per element.

Modules: dispatch.py (quant_linear: each weight format's kernel route), w4_decode.py (the int4 decode
calibration and its dispatch), w4_fma.py (the int4 decode GEMV on FMAs), w4_dp2a.py (the int4 decode
GEMV on integer dot products), w4_wgmma.py (the int4 decode GEMV on warpgroup MMAs, and its repacked
weight layout), w4_dot.py (int4 on tensor cores, prefill), fp8.py (the w8a16 GEMV and the fp8 decode
calibration), rowquant.py (per-token fp8 activations, w8a8 on cuBLAS), _common.py (split-K launch
pieces). This package exports the submodules' public names; their private helpers and the Triton
kernels themselves are imported from the submodule that defines them.
"""

from __future__ import annotations

from salaserve.kernels.quant_gemm._common import GEMV_MAX_M, SPLIT_K_CTAS_PER_SM, SPLIT_K_MIN_CHANNELS
from salaserve.kernels.quant_gemm.dispatch import (LINEAR_KERNELS, fp8_linear, fp8_scaled_mm_takes, quant_linear,
                                                   w4a16_linear)
from salaserve.kernels.quant_gemm.fp8 import Fp8GemvTuning, calibrate_fp8_gemv, fp8_candidates, fp8_gemv_choice, w8a16_gemv
from salaserve.kernels.quant_gemm.rowquant import (ROWQUANT_ONE_PASS_MAX, fp8_quantize_rows_ref, fp8_scaled_mm,
                                                   fp8_scaled_mm_quantized, quantize_rows_fp8, rowquant_constexprs,
                                                   rowquant_warps)
from salaserve.kernels.quant_gemm.w4_decode import (W4DecodeTuning, calibrate_w4, rounded_choices, w4_candidates,
                                                    w4_decode_choice, w4_rounded_choice, w4_rounded_usable, w4_shape,
                                                    w4_silu_out_usable, w4a16_decode, w4a16_decode_rounded)
from salaserve.kernels.quant_gemm.w4_dot import w4a16_dense_mm, w4a16_dequantize, w4a16_gemm, w4a16_gemv
from salaserve.kernels.quant_gemm.w4_dp2a import (W4_DP2A_CONFIGS, W4_DP2A_GROUP_MULTIPLE, W4_DP2A_MAX_M,
                                                  W4_DP2A_ROUNDED_CONFIGS, X_TILE, round_x_int16, w4_dp2a_layout,
                                                  w4_dp2a_usable, w4a16_gemv_dp2a, w4a16_gemv_dp2a_rounded)
from salaserve.kernels.quant_gemm.w4_fma import (W4_FMA_CONFIGS, W4_FMA_GROUP_MULTIPLE, W4_FMA_MAX_M, w4_fma_layout,
                                                 w4a16_gemv_fma)
from salaserve.kernels.quant_gemm.w4_wgmma import (W4_WGMMA_CONFIGS, W4_WGMMA_MAX_M, W4_WGMMA_MIN_M, W4WgmmaWeights,
                                                   repack_w4_for_wgmma, w4_wgmma_usable, w4a16_gemv_wgmma,
                                                   w4a16_wgmma_ref)

__all__ = [
    # dispatch
    "quant_linear", "LINEAR_KERNELS", "fp8_linear", "w4a16_linear", "fp8_scaled_mm_takes", "GEMV_MAX_M",
    "SPLIT_K_CTAS_PER_SM", "SPLIT_K_MIN_CHANNELS",
    # fp8 weights
    "w8a16_gemv", "fp8_gemv_choice", "fp8_candidates", "calibrate_fp8_gemv", "Fp8GemvTuning",
    "quantize_rows_fp8", "fp8_quantize_rows_ref", "fp8_scaled_mm", "fp8_scaled_mm_quantized",
    "rowquant_constexprs", "rowquant_warps", "ROWQUANT_ONE_PASS_MAX",
    # int4 weights: the decode calibration and its dispatch
    "calibrate_w4", "W4DecodeTuning", "w4_candidates", "rounded_choices", "w4_shape", "w4_decode_choice",
    "w4_rounded_choice", "w4_rounded_usable", "w4_silu_out_usable", "w4a16_decode", "w4a16_decode_rounded",
    # int4 weights: the kernels
    "w4a16_gemv", "w4a16_gemm", "w4a16_dense_mm", "w4a16_dequantize",
    "w4a16_gemv_fma", "w4_fma_layout", "W4_FMA_CONFIGS", "W4_FMA_GROUP_MULTIPLE", "W4_FMA_MAX_M",
    "w4a16_gemv_dp2a", "w4a16_gemv_dp2a_rounded", "round_x_int16", "w4_dp2a_layout", "w4_dp2a_usable",
    "W4_DP2A_CONFIGS", "W4_DP2A_ROUNDED_CONFIGS", "W4_DP2A_GROUP_MULTIPLE", "W4_DP2A_MAX_M", "X_TILE",
    "w4a16_gemv_wgmma", "w4a16_wgmma_ref", "repack_w4_for_wgmma", "w4_wgmma_usable", "W4WgmmaWeights",
    "W4_WGMMA_CONFIGS", "W4_WGMMA_MAX_M", "W4_WGMMA_MIN_M",
]
