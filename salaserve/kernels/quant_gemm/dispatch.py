"""quant_linear: a quantized linear layer through the kernels that serve its format, by M (the table
is in docs/quantization.md and the package docstring).

LINEAR_KERNELS maps a weight format (quant/formats/) to its kernel route; a format without one, or
any format with backend "torch" (or CPU tensors under "auto"), runs its Format.reference_linear.
"""

from __future__ import annotations

import torch

from salaserve.kernels.quant_gemm._common import GEMV_MAX_M
from salaserve.kernels.quant_gemm.fp8 import fp8_gemv_choice, w8a16_gemv
from salaserve.kernels.quant_gemm.rowquant import fp8_scaled_mm
from salaserve.kernels.quant_gemm.w4_decode import w4_decode_choice, w4a16_decode
from salaserve.kernels.quant_gemm.w4_dot import w4a16_dense_mm, w4a16_gemm, w4a16_gemv
from salaserve.kernels.quant_gemm.w4_fma import W4_FMA_GROUP_MULTIPLE, W4_FMA_MAX_M, w4a16_gemv_fma
from salaserve.kernels.quant_gemm.w4_wgmma import W4_WGMMA_MAX_M
from salaserve.quant import formats
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.quant.formats.fp8 import FP8, takes_w8a8
from salaserve.quant.formats.w4a16 import W4A16


# int4 weights with an fp8 copy (QuantizedLinearWeights.prefill) take it above the wgmma decode
# kernel's rows: w8a16 on tensor cores up to GEMV_MAX_M, w8a8 on cuBLAS above. The int4 tl.dot
# GEMV there is slower than reading the copy's twice as many bytes: a decode step at 32 rows, 4K
# context, 8.75 ms against 6.88 ms through the copy (H100, one process).
FP8_COPY_ABOVE_ROWS = W4_WGMMA_MAX_M


def fp8_scaled_mm_takes(M: int, w: QuantizedLinearWeights) -> bool:
    """Whether quant_linear sends M rows through w8a8 on cuBLAS (the format's prefill sizes) rather
    than a decode kernel."""
    return w.format == FP8.name and takes_w8a8(M, w)


def fp8_linear(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """fp8 weights, x [M, K]: the calibrated fp8 GEMV (M <= 8, where it beat w8a16), w8a16 on tensor
    cores up to GEMV_MAX_M, w8a8 on cuBLAS above (the interpreter: the reference)."""
    M = x.shape[0]
    if (cfg := fp8_gemv_choice(M, w, x.device)) is not None:
        from salaserve.kernels import gemv as G

        return G.gemv_fp8(x, w.weight, w.scale, cfg)
    if not fp8_scaled_mm_takes(M, w):
        return w8a16_gemv(x, w.weight, w.scale)
    if x.is_cuda:
        return fp8_scaled_mm(x, w.weight, w.scale)
    return formats.get(FP8.name).reference_linear(x, w)  # interpreter: no cuBLAS fp8


def w4a16_linear(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """int4 weights, x [M, K]: the calibrated decode kernel, else the FMA GEMV (M <= 4), the tl.dot
    GEMV (M <= GEMV_MAX_M), the dequantize-into-scratch GEMM (prefill), or the dequantize-in-tile
    GEMM (act-order without reordering)."""
    M = x.shape[0]
    if x.is_cuda and (choice := w4_decode_choice(x, w)) is not None:
        return w4a16_decode(x, w, choice)  # decode: the kernel the start-up calibration picked
    if M <= W4_FMA_MAX_M and w.g_idx_trivial and w.group_size % W4_FMA_GROUP_MULTIPLE == 0:
        return w4a16_gemv_fma(x, w)  # decode: the 1 + q/16 FMA kernel
    if M <= GEMV_MAX_M:
        return w4a16_gemv(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, w.perm, act_order=not w.g_idx_trivial)
    if w.g_idx_trivial and w.group_size % 8 == 0:
        return w4a16_dense_mm(x, w)  # prefill: dequantize into scratch + cuBLAS
    return w4a16_gemm(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, w.perm, act_order=not w.g_idx_trivial)


# weight format -> the kernels that serve it (x [M, K] with M >= 1, w) -> y [M, N]
LINEAR_KERNELS = {FP8.name: fp8_linear, W4A16.name: w4a16_linear}


def quant_linear(x: torch.Tensor, w: QuantizedLinearWeights, backend: str = "auto") -> torch.Tensor:
    """y = x @ W^T for x [..., K]. backend "auto": the format's kernels (LINEAR_KERNELS) on CUDA, its
    reference matmul elsewhere; "triton" forces the kernels (CPU works under TRITON_INTERPRET=1);
    "torch" the reference. int4 weights with an fp8 copy take it above FP8_COPY_ABOVE_ROWS rows."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}")
    K, N = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    use_kernels = backend == "triton" or (backend == "auto" and x.is_cuda)
    if w.prefill is not None and M > FP8_COPY_ABOVE_ROWS:
        return quant_linear(x, w.prefill, backend)
    kernels = LINEAR_KERNELS.get(w.format) if use_kernels else None
    if M == 0:
        y = x2.new_empty(0, N)
    elif kernels is not None:
        y = kernels(x2, w)
    else:
        y = formats.get(w.format).reference_linear(x2, w)
    return y.reshape(*lead, N)
