"""Row-parallel Triton kernels for the small elementwise ops around the GEMMs.

    rms_norm(x, w, eps)                                 TorchBackend.rms_norm
    add_rms_norm(residual, update, scale, w, eps)       TorchBackend.add_rms_norm
    silu_mul(gate_up)                                   TorchBackend.silu_mul
    sigmoid_mul(x, gate)                                x * torch.sigmoid(gate) (sparse o_gate)

Each is one kernel, fp32 math, with the same intermediate roundings to the tensor dtypes as the
torch expression it replaces (bf16 or fp32 inputs). They are launched with
programmatic dependent launch, like the GEMVs around them (_triton_utils: they wait for the
previous kernels before reading anything). Inputs are 2-D [N, D] (or anything that reshapes
to it without a copy for the norms) with a unit last-dim stride; rows may be strided (views into
fused projection outputs). Outputs are new contiguous tensors. No host syncs: graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import (NO_FMA, fp8_codes, fp8_row_scale, pdl_launch_kwargs, pdl_launch_next,
                                             pdl_wait, pdl_wait_first, promote, round_to, rsqrt_rn, silu_mul_rounded,
                                             tl_dtype)
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.quant_gemm.w4_dp2a import X_TILE, store_x_int16
from salaserve.quant.formats import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # a global the kernels may read
_X_TILE = tl.constexpr(X_TILE)


def _int16_x_buffers(n_rows: int, n_cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, xs) for rows of n_cols channels in round_x_int16's layout; n_cols a multiple of X_TILE."""
    if n_cols % X_TILE:
        raise ValueError(f"int16 x needs a width that is a multiple of {X_TILE}, got {n_cols}")
    return (torch.empty(n_rows, n_cols // 2, dtype=torch.int32, device=device),
            torch.empty(n_rows, n_cols // X_TILE, dtype=torch.float32, device=device))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride in its last dim")
    return x2


def _norm_warps(block: int) -> int:
    return 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


# ---------------------------------------------------------------------------------------------
# RMSNorm, with an optional fused residual add
# ---------------------------------------------------------------------------------------------


@triton.jit
def _normalize(h, w, n_cols, eps, H_DT: tl.constexpr, OUT_DT: tl.constexpr):
    """reference.rms_norm of a row h (fp32 values of H_DT) with weight values w (fp32): fp32 stats,
    normalised value rounded to H_DT, times the weight, rounded to OUT_DT = promote(H_DT, weight dtype)."""
    rstd = rsqrt_rn(tl.sum(h * h, axis=0) / n_cols + eps)
    return round_to(round_to(h * rstd, H_DT) * w, OUT_DT)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps,
                     BLOCK: tl.constexpr, X_DT: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # the norm weight before the dependency wait: no kernel writes it, and after the wait its DRAM
    # round trip would follow the row's (at batch 1 the layer's weights have left L2 since last step)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, w, n_cols, eps, X_DT, OUT_DT)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, w, eps, *, num_warps: int | None = None):
    """x [..., D] (unit last-dim stride), w [D] contiguous -> [..., D] of dtype promote(x, w):
    fp32 statistics, normalised value rounded to x.dtype, times w (reference.rms_norm). One program
    per row."""
    x2 = _rows(x, "x")
    n_rows, n_cols = x2.shape
    out_dt = promote(x.dtype, w.dtype)
    out = torch.empty(n_rows, n_cols, dtype=out_dt, device=x.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(n_rows,)](x2, w, out, x2.stride(0), out.stride(0), n_cols, float(eps),
                                    BLOCK=block, X_DT=tl_dtype(x.dtype), OUT_DT=tl_dtype(out_dt),
                                    num_warps=num_warps or _norm_warps(block), **NO_FMA,
                                    **pdl_launch_kwargs(x2.device))
    return out.view(*x.shape[:-1], n_cols)


@triton.jit
def _add_rms_norm_kernel(r_ptr, u_ptr, w_ptr, h_ptr, out_ptr, s_ptr, stride_r, stride_u, stride_h, stride_out,
                         n_cols, scale, eps,
                         BLOCK: tl.constexpr, U_DT: tl.constexpr, H_DT: tl.constexpr, OUT_DT: tl.constexpr,
                         PDL: tl.constexpr = False, FP8_OUT: tl.constexpr = False, INT16_OUT: tl.constexpr = False,
                         INTERPRET: tl.constexpr = False):
    """FP8_OUT: the normed row (its OUT_DT values) goes out as per-token fp8 codes and a scale
    (s_ptr), exactly quant_gemm.quantize_rows_fp8 of the OUT_DT output, for a w8a8 linear.
    INT16_OUT: as the dp2a GEMV's rounded x (out_ptr int32 words, s_ptr X_TILE scales per row,
    round_x_int16 of the OUT_DT output), for an int4 linear."""
    pdl_launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait, as _rms_norm_kernel
    pdl_wait(PDL)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # HF's two roundings: the branch times r in its own dtype, then the add in the residual dtype.
    h = round_to(r + round_to(u * scale, U_DT), H_DT)
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)
    y = _normalize(h, w, n_cols, eps, H_DT, OUT_DT)
    if FP8_OUT:
        sx, inv = fp8_row_scale(tl.max(tl.abs(y), axis=0), _FP8_MAX)
        tl.store(out_ptr + row * stride_out + cols, fp8_codes(y, inv, out_ptr, _FP8_MAX, INTERPRET), mask=mask)
        tl.store(s_ptr + row, sx)
    elif INT16_OUT:
        store_x_int16(y, 0, n_cols, out_ptr + row * stride_out, s_ptr + row * (n_cols // _X_TILE), BLOCK,
                      not INTERPRET)
    else:
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(residual, update, scale, w, eps, *, num_warps: int | None = None, fp8_out: bool = False,
                 int16_out: bool = False):
    """(residual + update*scale, its RMSNorm) in one pass, as TorchBackend.add_rms_norm:
    round(update*scale) in update.dtype, then round(residual + that) in promote(residual, update);
    the norm as rms_norm. residual, update [..., D] same shape (unit last-dim stride); scale: float;
    w [D]. Returns (new_residual, normed), new contiguous tensors; the inputs are not modified.
    fp8_out: normed comes back as (e4m3 codes [rows, D], fp32 scales [rows, 1]), the per-token
    quantization of the normed rows (quant_gemm.quantize_rows_fp8's values) for a w8a8 linear.
    int16_out: normed comes back as (xq, xs), quant_gemm.round_x_int16 of the normed rows, for the
    int4 dp2a GEMV (quant_gemm.w4a16_gemv_dp2a_rounded); D a multiple of X_TILE."""
    if fp8_out and int16_out:
        raise ValueError("add_rms_norm: fp8_out or int16_out, not both")
    r2, u2 = _rows(residual, "residual"), _rows(update, "update")
    if r2.shape != u2.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and update {tuple(update.shape)} differ")
    n_rows, n_cols = r2.shape
    h_dt = promote(residual.dtype, update.dtype)
    out_dt = promote(h_dt, w.dtype)
    h = torch.empty(n_rows, n_cols, dtype=h_dt, device=residual.device)
    if int16_out:
        out, sx = _int16_x_buffers(n_rows, n_cols, residual.device)
    else:
        out = torch.empty(n_rows, n_cols, dtype=torch.float8_e4m3fn if fp8_out else out_dt, device=residual.device)
        sx = torch.empty(n_rows if fp8_out else 0, 1, dtype=torch.float32, device=residual.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        _add_rms_norm_kernel[(n_rows,)](
            r2, u2, w, h, out, sx, r2.stride(0), u2.stride(0), h.stride(0), out.stride(0), n_cols,
            float(scale), float(eps), BLOCK=block, U_DT=tl_dtype(update.dtype), H_DT=tl_dtype(h_dt),
            OUT_DT=tl_dtype(out_dt), FP8_OUT=fp8_out, INT16_OUT=int16_out, INTERPRET=INTERPRET,
            num_warps=num_warps or _norm_warps(block), **NO_FMA, **pdl_launch_kwargs(r2.device))
    shape = (*residual.shape[:-1], n_cols)
    if fp8_out or int16_out:
        return h.view(shape), (out, sx)
    return h.view(shape), out.view(shape)


# ---------------------------------------------------------------------------------------------
# Gated activations
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, s_ptr, stride_x, stride_out, n_cols,
                     BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False,
                     INT16_OUT: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    """INT16_OUT: the DT-rounded activation goes out as the dp2a GEMV's rounded x (out_ptr int32
    words, s_ptr X_TILE scales per row; BLOCK a multiple of X_TILE)."""
    pdl_wait_first(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul_rounded(gate, up, DT, DT)
    if INT16_OUT:
        store_x_int16(out, tl.program_id(1) * BLOCK, n_cols, out_ptr + row * stride_out,
                       s_ptr + row * (n_cols // _X_TILE), BLOCK, not INTERPRET)
    else:
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up, *, block: int = 1024, num_warps: int = 4, int16_out: bool = False):
    """gate_up [N, 2F] (gate = first F columns, up = last F; unit last-dim stride) ->
    silu(gate) * up [N, F] in gate_up.dtype, rounding after silu and after the product, as
    TorchBackend.silu_mul. Grid (N, F / block). int16_out: (xq, xs), quant_gemm.round_x_int16 of
    that activation ([N, F] rows only), for the int4 dp2a GEMV; F a multiple of X_TILE."""
    x2 = _rows(gate_up, "gate_up")
    n_rows, two_f = x2.shape
    if two_f % 2:
        raise ValueError(f"gate_up's last dim must be even, got {two_f}")
    f = two_f // 2
    if int16_out:
        out, sx = _int16_x_buffers(n_rows, f, gate_up.device)
        block = max(block, X_TILE)
    else:
        out, sx = torch.empty(n_rows, f, dtype=gate_up.dtype, device=gate_up.device), None
    if n_rows:
        block = min(block, triton.next_power_of_2(f))
        _silu_mul_kernel[(n_rows, triton.cdiv(f, block))](
            x2, out, out if sx is None else sx, x2.stride(0), out.stride(0), f, BLOCK=block, DT=tl_dtype(gate_up.dtype),
            INT16_OUT=int16_out, INTERPRET=INTERPRET, num_warps=num_warps, **NO_FMA, **pdl_launch_kwargs(x2.device))
    if int16_out:
        return out, sx
    return out.view(*gate_up.shape[:-1], f)


@triton.jit
def _sigmoid_mul_kernel(x_ptr, g_ptr, out_ptr, stride_x, stride_g, stride_out, n_cols,
                        BLOCK: tl.constexpr, G_DT: tl.constexpr, OUT_DT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait_first(PDL)
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(x * round_to(tl.sigmoid(g), G_DT), OUT_DT)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_mul(x, gate, *, block: int = 1024, num_warps: int = 4):
    """x * torch.sigmoid(gate): x, gate [N, D] (or [..., D] reshapable without copy; unit last-dim
    stride, rows may be strided, e.g. gate as a view into the fused projection). sigmoid rounded to
    gate.dtype, product to promote(x, gate). Returns a new contiguous tensor shaped like x."""
    x2, g2 = _rows(x, "x"), _rows(gate, "gate")
    if x2.shape != g2.shape:
        raise ValueError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    n_rows, n_cols = x2.shape
    out_dt = promote(x.dtype, gate.dtype)
    out = torch.empty(n_rows, n_cols, dtype=out_dt, device=x.device)
    if n_rows:
        block = min(block, triton.next_power_of_2(n_cols))
        _sigmoid_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
            x2, g2, out, x2.stride(0), g2.stride(0), out.stride(0), n_cols, BLOCK=block,
            G_DT=tl_dtype(gate.dtype), OUT_DT=tl_dtype(out_dt), num_warps=num_warps, **NO_FMA,
            **pdl_launch_kwargs(x2.device))
    return out.view(*x.shape[:-1], n_cols)


class TritonFusedOps:
    """Mixin with TorchBackend's method names for the ops above (for TritonBackend)."""

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, residual, update, scale, weight, eps):
        return add_rms_norm(residual, update, scale, weight, eps)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up)

    def sigmoid_mul(self, x, gate):
        return sigmoid_mul(x, gate)
