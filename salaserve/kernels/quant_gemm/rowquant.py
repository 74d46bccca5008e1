"""Per-token dynamic fp8 quantization of activations (`quantize_rows_fp8`) and w8a8 on cuBLAS
(`fp8_scaled_mm`): the fp8 prefill path."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import fp8_codes, fp8_row_scale, silu_mul_rounded, tl_dtype
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.quant.formats import FP8_MAX
from salaserve.quant.formats.fp8 import quantize_rows_e4m3
from salaserve.kernels.options import INTERPRET

@triton.jit
def _rows_tile(x_rows, kk, mask, K, SILU: tl.constexpr, DT: tl.constexpr):
    """fp32 values of x's rows at channels kk; SILU: x is [gate | up] (2K wide) and the values are
    silu_mul's, rounded to DT after the silu and after the product as fused.silu_mul."""
    if SILU:
        gate = tl.load(x_rows + kk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + kk, mask=mask, other=0.0).to(tl.float32)
        return silu_mul_rounded(gate, up, DT, DT)
    return tl.load(x_rows + kk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, FP8_MAX_C: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                              SILU: tl.constexpr = False, DT: tl.constexpr = tl.bfloat16,
                              INTERPRET: tl.constexpr = False):
    """ROWS rows per program: s = max(amax|x|, 1e-12) * (1/448), q = clamp(x * (1/s)) in e4m3.
    ONE_PASS (BLOCK >= K): the rows stay in registers between the max and the scaling, so x is read
    once; otherwise one row, two passes, the second from L2. The reciprocal is IEEE-rounded
    (div_rn) and the product is torch's too: bit-equal to fp8_quantize_rows_ref. SILU: the rows
    quantized are silu_mul of x = [gate | up] (the MLP's down input, never written in bf16)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    if ONE_PASS:
        kk = tl.arange(0, BLOCK)[None, :]
        mask = row_mask[:, None] & (kk < K)
        x = _rows_tile(x_rows, kk, mask, K, SILU, DT)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            kk = k0 + tl.arange(0, BLOCK)[None, :]
            xt = _rows_tile(x_rows, kk, row_mask[:, None] & (kk < K), K, SILU, DT)
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=1))
    sx, inv = fp8_row_scale(amax, FP8_MAX_C)
    if ONE_PASS:
        tl.store(q_rows + kk, fp8_codes(x, inv[:, None], q_ptr, FP8_MAX_C, INTERPRET), mask=mask)
    else:
        for k0 in range(0, K, BLOCK):
            kk = k0 + tl.arange(0, BLOCK)[None, :]
            mask = row_mask[:, None] & (kk < K)
            v = _rows_tile(x_rows, kk, mask, K, SILU, DT)
            tl.store(q_rows + kk, fp8_codes(v, inv[:, None], q_ptr, FP8_MAX_C, INTERPRET), mask=mask)
    tl.store(s_ptr + rows, sx, mask=row_mask)


ROWQUANT_ONE_PASS_MAX = 16384  # elements per program held in registers (64 per thread at 8 warps)


def quantize_rows_fp8(x: torch.Tensor, *, silu: bool = False, rows: Optional[int] = None,
                      num_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic fp8: x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) in one kernel, the
    same values as fp8_quantize_rows_ref (the torch kernels it replaces). Rows up to
    ROWQUANT_ONE_PASS_MAX channels are read once (several rows per program when they are short).
    silu: x is [M, 2K] = [gate | up] and the rows quantized are fused.silu_mul(x)'s. rows,
    num_warps: launch overrides for benchmarks (rows per program of the one-pass kernel)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D tensor with unit column stride, got {tuple(x.shape)}")
    M, K = x.shape
    if silu:
        if K % 2:
            raise ValueError(f"silu: x = [gate | up] needs an even width, got {K}")
        K //= 2
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    sx = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        consts = rowquant_constexprs(K)
        if rows and consts["ONE_PASS"]:
            consts["ROWS"] = rows
        launch_kernel(_quantize_rows_fp8_kernel, (triton.cdiv(M, consts["ROWS"]),),
            x, q, sx, M, K, x.stride(0), FP8_MAX_C=FP8_MAX, **consts, SILU=silu, DT=tl_dtype(x.dtype),
            INTERPRET=INTERPRET, num_warps=num_warps or rowquant_warps(K, silu))
    return q, sx


def rowquant_constexprs(K: int) -> dict:
    """ROWS, BLOCK, ONE_PASS of _quantize_rows_fp8_kernel for rows of K channels."""
    block = triton.next_power_of_2(K)
    if block <= ROWQUANT_ONE_PASS_MAX:
        # 8192 values per program: 4096-wide rows 25.8 us per 8K-token chunk at 2 rows, 27.7 at
        # 4 (floor 23.9)
        return dict(ROWS=max(1, min(8192 // block, 16)), BLOCK=block, ONE_PASS=True)
    return dict(ROWS=1, BLOCK=4096, ONE_PASS=False)


def rowquant_warps(K: int, silu: bool) -> int:
    """silu_mul fused in (two loads and an exp per value): 16 warps, 180 vs 194 us at 16384 wide;
    plain rows: 8."""
    return 16 if silu and triton.next_power_of_2(K) >= ROWQUANT_ONE_PASS_MAX else 8


fp8_quantize_rows_ref = quantize_rows_e4m3  # the torch twin of quantize_rows_fp8 (the format's definition)


def fp8_scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor, *, silu: bool = False) -> torch.Tensor:
    """w8a8 on cuBLAS: per-token dynamic activation scales x rowwise weight scales (CUDA only).
    silu: the input is fused.silu_mul(x) (x = [gate | up]), quantized in the same kernel."""
    x8, sx = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous(), silu=silu)
    return fp8_scaled_mm_quantized(x8, sx, w_fp8, scale, x.dtype)


def fp8_scaled_mm_quantized(x8: torch.Tensor, sx: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """fp8_scaled_mm of activations already quantized per token (x8 e4m3 [M, K], sx fp32 [M, 1])."""
    y = torch._scaled_mm(x8, w_fp8.t(), scale_a=sx, scale_b=scale.float().view(1, -1), out_dtype=torch.bfloat16)
    return y.to(dtype)
