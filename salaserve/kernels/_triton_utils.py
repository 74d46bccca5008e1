"""Small helpers shared by the Triton kernels (dtype mapping, exact roundings, the PDL switch)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from salaserve.kernels.options import INTERPRET

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch float dtype (fp32, bf16 or fp16)."""
    try:
        return _TL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype} (expected float32, bfloat16 or float16)") from None


def promote(*dtypes: torch.dtype) -> torch.dtype:
    """torch's result dtype of an elementwise op between tensors of these dtypes."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 x rounded to DT (round to nearest even) and returned as fp32: the rounding torch does
    whenever it stores an intermediate in DT. A no-op for DT = fp32."""
    if DT == tl.bfloat16:
        # bf16 = the top 16 bits of fp32; round to nearest even by integer arithmetic. (The Triton
        # interpreter's own fp32->bf16 cast truncates, so this keeps CPU tests exact; on the GPU it
        # equals cvt.rn.bf16.f32 for every finite value.)
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def rsqrt_rn(x):
    """1 / sqrt(x) with two correctly rounded steps (what torch computes on CPU), rather than the
    approximate rsqrt instruction: keeps the bf16 roundings that follow identical to torch's more often."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(x))


# Launch option for every kernel here: no fused multiply-adds, so each fp32 product and sum is
# rounded on its own as in torch's separate elementwise kernels (an FMA skips one rounding, which
# can tip a later bf16 rounding). The kernels are memory-bound; the extra instructions are free.
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def round_to_e4m3(x):
    """fp32 x with |x| <= 448 rounded to the nearest float8_e4m3fn value (ties to even), as fp32:
    the value torch's cast produces. Done on the bits so that the cast that follows is exact: the
    Triton interpreter's fp32 -> fp8 cast mis-rounds values that carry into the next binade
    (7.9 -> 4.0), the GPU's cvt.rn is right either way."""
    b = x.to(tl.uint32, bitcast=True)
    sign = b & 0x80000000
    mag = b & 0x7FFFFFFF
    # normal range (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, round half to even
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    # subnormal range: a fixed step of 2^-9; adding 1.5 * 2^14 puts fp32's ulp there
    a = tl.abs(x)
    sub = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    # the sign goes back on by its bit, so that values rounding to zero keep it (-0, as torch)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def silu_mul_rounded(gate, up, ACT_DT: tl.constexpr, OUT_DT: tl.constexpr):
    """silu(gate) * up on fp32 values as torch computes F.silu(gate) * up: the activation rounded
    to ACT_DT (F.silu's output dtype), the product to OUT_DT; returned as fp32. Every silu_mul
    in the kernels (the row kernel, the GEMV's prologue and epilogue, the fp8 quantizer) is this."""
    return round_to(round_to(gate / (1.0 + tl.exp(-gate)), ACT_DT) * up, OUT_DT)


@triton.jit
def write_silu_tile(y, offs_m, m_mask, pid_n, F, out_ptr, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr):
    """A GEMV's silu_mul epilogue: y [BM, BN] (fp32) holds the tile's BN/2 gate columns, then the same
    BN/2 columns' up values (the SILU_OUT column maps of gemv/kernel.py and the int4 dp2a GEMV) ->
    silu(gate) * up for outputs [pid_n * BN/2, +BN/2) of [M, F], with fused.silu_mul's roundings on
    the linear's output rounded to Y_DT."""
    y = round_to(y, Y_DT)  # gate_up as x @ w.t() stores it
    gate, up = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
    out = silu_mul_rounded(gate, up, Y_DT, OUT_DT)  # F.silu's output stored in Y_DT
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (cols < F)[None, :])


@triton.jit
def bf16_pair(u):
    """int32 words each holding two bf16 values (memory order: low half first) -> both as fp32:
    bf16 -> fp32 is a 16-bit shift, or a mask for the high half."""
    return (u << 16).to(tl.float32, bitcast=True), (u & -65536).to(tl.float32, bitcast=True)


@triton.jit
def fp8_row_scale(amax, FP8_MAX_C: tl.constexpr):
    """Per-token dynamic fp8 scale of rows with absolute maxima amax: s = max(amax, 1e-12) times
    fp32(1 / FP8_MAX_C) (torch's division by a Python scalar), and its IEEE reciprocal."""
    sx = tl.maximum(amax, 1e-12) * (1.0 / FP8_MAX_C)
    return sx, tl.math.div_rn(1.0, sx)


@triton.jit
def fp8_codes(v, inv, q_ptr, FP8_MAX_C: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 values times inv, clamped to +-FP8_MAX_C, as q_ptr's e4m3 codes, the way torch casts
    (the interpreter's own cast mis-rounds, so there the value is rounded first)."""
    v = tl.minimum(tl.maximum(v * inv, -FP8_MAX_C), FP8_MAX_C)
    if INTERPRET:
        v = round_to_e4m3(v)
    return v.to(q_ptr.dtype.element_ty)


# ---- programmatic dependent launch (PDL, sm_90+): on (set_pdl(False) turns it off, for profiles whose
# kernel times must not overlap). Measured on the H200: batch-1 decode at 4K 5.154 -> 4.970 ms with the
# GEMVs and row kernels, -> 4.846 ms with the rest of the decode chain.
#
# A kernel launched with PDL may start while the previous kernel in the stream is finishing: its
# programs signal at their start that the next PDL kernel may launch (griddepcontrol.
# launch_dependents) and wait (griddepcontrol.wait) before touching anything the previous kernels
# wrote. The bf16 and w4 GEMVs load their first weight tile before the wait; the other kernels
# (fused.py's row kernels, Lightning, attention, selection) wait first. Kernels launched without
# it (cuBLAS, torch, the w8a16 GEMV, which measured slower with it) keep plain stream order.

_PDL = True


def set_pdl(enabled: bool) -> None:
    """Launch the PDL-aware kernels (the GEMVs, fused.py's row kernels) with PDL where supported."""
    global _PDL
    _PDL = bool(enabled)


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: str) -> bool:
    if INTERPRET:
        return False
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """Whether this device can launch with PDL (sm_90+, not the interpreter)."""
    return _pdl_capable(str(device))


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches that do not say otherwise use PDL on this device."""
    return _PDL and pdl_supported(device)


def pdl_launch_kwargs(device: torch.device) -> dict:
    """Launch arguments of a kernel with a `PDL` constexpr that calls pdl_wait_first: PDL on where
    enabled, nothing otherwise (the constexpr defaults to off)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


@triton.jit
def pdl_wait_first(PDL: tl.constexpr):
    """At a PDL kernel's start: let the next PDL kernel launch, then wait until the previous
    kernels' writes are visible (for kernels whose every input may come from them)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    """The first half of pdl_wait_first: let the next PDL kernel launch. A kernel that splits the two
    loads what no kernel of the running forward writes (weights, norm weights; see pdl_wait) in
    between, so that its DRAM round trip overlaps the previous kernel instead of following it."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The second half of pdl_wait_first: wait until the previous kernels' writes are visible.
    Before it, a kernel may be running while ANY earlier PDL kernel still runs (each one lets the next
    launch at its start), so only data that no kernel of the forward writes may be read: weights,
    or state written by earlier forwards, each of which ends before the next one starts (a forward
    begins with plain-launched torch ops, which wait for all earlier work, or a graph launch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
