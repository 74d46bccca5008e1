"""Small helpers shared by the Triton kernels (dtype mapping, exact roundings)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
