"""The int4 decode GEMV on warpgroup MMAs that overlap the next tile's unpacking
(`w4a16_gemv_wgmma`, 4 <= M <= 16), on a repacked copy of the weights (`repack_w4_for_wgmma`,
attached at start-up by TritonBackend.prepare_weights).

What keeps the wgmmas in flight: Triton's pipeliner lets a dot run on while the loop goes on only
if its result feeds nothing in the loop but the next dot's accumulator, and its shared-memory
operand is multi-buffered. So the group scale is folded into the weights as they are unpacked
(the dot accumulates straight into the loop-carried sum), and x^T is read in natural channel
order, which Triton's cp.async pipeline can stage. (The first tensor-core version scaled each
tile's partial after its dots and gathered x^T by hand: every wgmma was waited for, and it ran at
~1 TB/s whatever M was.)

Unpacking, per register (two bf16 weights): a lop3 puts two nibbles into the mantissas of a
bf16x2 (128 + q each), a bf16x2 subtraction of (128 + z) leaves q - z (exact), a bf16x2 multiply
by the group scale rounds (q - z) * s to bf16: the weight that dequantize-then-matmul uses.

The repacked layout ([N, K/8] int32: a column's words contiguous) puts into each word the 8
channels one lane of a warpgroup MMA holds for one output column, so that the unpacked pairs are
already the A fragment's registers and no layout conversion (shared memory) is needed. In each
block of 16 words (128 channels, one K tile), word 4 t + c (t: lane within its quad, c: pair of
16-channel chunks) holds at nibble position 4 p + 16 h (p = 2 s + e) the channel
32 c + 16 s + 8 e + 2 t + h: lane t's pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of chunks 2c and
2c + 1. A lane's four words are adjacent (one 16-byte shared-memory load), and a column's tile is
64 contiguous bytes (16-byte cp.async copies).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs, round_to
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.quant_gemm._common import (_check_decode_x, _default_split_k, _store_output,
                                                  _workspace)
from salaserve.quant.formats import (GPTQ_V2, QuantizedLinearWeights, dequantize_gptq, to_int32, unpack_int4,
                                     unpack_zeros)
from salaserve.quant.formats.w4a16 import W4A16

W4_WGMMA_MAX_M = 16  # x^T is padded to the dot's 16 columns
W4_WGMMA_MIN_M = 4  # from here the calibration times it against the FMA kernel (w4_fma.py), which was
# 1.25-1.5x faster at one row for every shape; two rows were not timed. At four rows it won four
# of five shapes.
W4_WGMMA_BLOCK_R = 16  # words per K tile (128 channels): the repacked layout's block


# ---------------------------------------------------------------- the repacked layout (host)


def _tile_channel_order(device=None) -> torch.Tensor:
    """[16, 4, 2]: the channel (of a 128-channel K tile) that word 4 t + c holds at nibble
    position 4 p + 16 h (p = 2 s + e), indexed [word, p, h]: 32 c + 16 s + 8 e + 2 t + h."""
    word = torch.arange(W4_WGMMA_BLOCK_R, device=device).view(-1, 1, 1)
    t, c = word // 4, word % 4
    p = torch.arange(4, device=device).view(1, 4, 1)
    s, e = p // 2, p % 2
    h = torch.arange(2, device=device).view(1, 1, 2)
    return 32 * c + 16 * s + 8 * e + 2 * t + h


@dataclasses.dataclass(frozen=True)
class W4WgmmaWeights:
    """What w4a16_gemv_wgmma reads: qweight [N, K/8] int32 in the layout above, and zs [G, 2, N]
    int32, per group and column the bf16x2 words (128 + z, 128 + z) and (s, s) (s rounded to
    bf16). Both are whole 32-bit words so that Triton's pipeline copies them with cp.async (the
    fp16 scales alone, 2 bytes per column, would be a plain load the loop waits for)."""

    qweight: torch.Tensor
    zs: torch.Tensor


def _bf16x2_words(v: torch.Tensor) -> torch.Tensor:
    """bf16 values -> int32 words holding the value twice."""
    b = v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    return to_int32(b | (b << 16))


def repack_w4_for_wgmma(w: QuantizedLinearWeights) -> W4WgmmaWeights:
    """GPTQ-layout int4 weights (K a multiple of 128) -> the wgmma kernel's copy of them."""
    if w.format != W4A16.name:
        raise ValueError(f"repack_w4_for_wgmma takes w4a16 weights, got {w.format}")
    K8, N = w.qweight.shape
    if K8 % W4_WGMMA_BLOCK_R:
        raise ValueError(f"repack_w4_for_wgmma needs K a multiple of {8 * W4_WGMMA_BLOCK_R}, got {8 * K8}")
    dev = w.qweight.device
    q = unpack_int4(w.qweight).view(K8 // W4_WGMMA_BLOCK_R, 8 * W4_WGMMA_BLOCK_R, N)  # [K tile, channel, N]
    picked = q[:, _tile_channel_order(dev).reshape(-1), :].view(K8 // W4_WGMMA_BLOCK_R, W4_WGMMA_BLOCK_R, 4, 2, N)
    shift = 4 * torch.arange(4, device=dev).view(4, 1) + 16 * torch.arange(2, device=dev).view(1, 2)  # [p, h]
    words = (picked.to(torch.int64) << shift[None, None, :, :, None]).sum(dim=(2, 3))  # [K tile, word, N]
    zeros = unpack_zeros(w.qzeros, N, GPTQ_V2)  # [G, N] true zero points
    zz = _bf16x2_words(zeros.float() + 128.0)
    s2 = _bf16x2_words(w.scales)
    return W4WgmmaWeights(to_int32(words).reshape(K8, N).t().contiguous(), torch.stack([zz, s2], dim=1).contiguous())


def w4a16_wgmma_ref(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """The torch twin of w4a16_gemv_wgmma: x @ W^T in fp32 with W = bf16((q - z) * bf16(s)), the
    weights the kernel multiplies (dequantize-then-matmul with bf16 weights)."""
    wd = dequantize_gptq(w.qweight, w.qzeros, w.scales.to(torch.bfloat16).float(), w.g_idx, w.group_size, GPTQ_V2)
    return x.float() @ wd.to(torch.bfloat16).float().t()


# ---------------------------------------------------------------- kernel


@triton.jit
def _pair_dequant(words, zz, s2, p: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibble pair p (bits 4p.. and 16 + 4p..) of every word as two bf16 tensors: (q - z) * s
    rounded to bf16. zz, s2: the bf16x2 words (128 + z, 128 + z) and (s, s) per column."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            lop3.b32 t, $2, 0x000f000f, 0x43004300, 0xea;
            sub.rn.bf16x2 t, t, $3;
            mul.rn.bf16x2 t, t, $4;
            mov.b32 {$0, $1}, t;
            }""",
            constraints="=h,=h,r,r,r", args=[words >> (4 * p), zz, s2], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=1)
    else:
        # the same arithmetic on fp32 values, rounded by integer arithmetic (the interpreter's own
        # casts to bf16 truncate); q + 128 - (128 + z) is exact
        zf = (zz << 16).to(tl.float32, bitcast=True)
        sf = (s2 << 16).to(tl.float32, bitcast=True)
        lo = round_to((((words >> (4 * p)) & 0xF).to(tl.float32) + 128.0 - zf) * sf, tl.bfloat16)
        hi = round_to((((words >> (16 + 4 * p)) & 0xF).to(tl.float32) + 128.0 - zf) * sf, tl.bfloat16)
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _w4_gemv_wgmma_kernel(
    x_ptr, qweight_ptr, zs_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # output columns; word rows (8 channels each) per K tile
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,  # inline PTX dequantization (GPU); False: plain Triton (interpreter)
    DOT_FP32: tl.constexpr = False,  # interpreter runs: its tl.dot misreads bf16 operands
    PDL: tl.constexpr = False,
):
    # Requires N % BLOCK_N == 0, K % (8 * BLOCK_R) == 0, GROUP_SIZE % (8 * BLOCK_R) == 0 and
    # BLOCK_R == 16, the layout's block (the launcher checks): no masks, so that Triton pipelines
    # the loads.
    BLOCK_M: tl.constexpr = 16
    BLOCK_K: tl.constexpr = 8 * BLOCK_R
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    K8 = K // 8
    r_len = tl.cdiv(K8, SPLIT_K * BLOCK_R) * BLOCK_R  # whole tiles per split: groups stay aligned
    r_begin = tl.program_id(1) * r_len
    r_end = tl.minimum(r_begin + r_len, K8)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    w_tile = qweight_ptr + offs_n[:, None] * K8 + r[None, :]  # [BLOCK_N, BLOCK_R] words (qweight is [N, K/8])
    x_tile = x_ptr + tl.minimum(m, M - 1)[None, :].to(tl.int64) * stride_xm + k[:, None]  # x^T [BLOCK_K, 16]
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for r0 in range(r_begin, r_end, BLOCK_R):
        words = tl.load(w_tile + r0)
        xt = tl.load(x_tile + r0 * 8)
        g = (r0 * 8) // GROUP_SIZE
        zz = tl.load(zs_ptr + g * 2 * N + offs_n)[:, None]
        s2 = tl.load(zs_ptr + g * 2 * N + N + offs_n)[:, None]
        l0, h0 = _pair_dequant(words, zz, s2, 0, USE_ASM)
        l1, h1 = _pair_dequant(words, zz, s2, 1, USE_ASM)
        l2, h2 = _pair_dequant(words, zz, s2, 2, USE_ASM)
        l3, h3 = _pair_dequant(words, zz, s2, 3, USE_ASM)
        # [BN, R, h] per pair p = 2 s + e -> [BN, R, h, e, s]
        chunk0 = tl.join(tl.join(l0, h0), tl.join(l1, h1))  # s = 0: [BN, R, h, e]
        chunk1 = tl.join(tl.join(l2, h2), tl.join(l3, h3))  # s = 1
        w5 = tl.join(chunk0, chunk1)  # [BN, R, h, e, s]
        w6 = tl.reshape(w5, (BLOCK_N, 4, BLOCK_R // 4, 2, 2, 2))  # [BN, t, c, h, e, s]
        w = tl.reshape(tl.permute(w6, (0, 2, 5, 4, 1, 3)), (BLOCK_N, BLOCK_K))  # [BN, c, s, e, t, h]
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    _store_output(tl.trans(acc), m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, pid_n, SPLIT_K)


# (BLOCK_N, BLOCK_R, num_warps, num_stages): sm_90 compiles with the A operand straight from the
# unpacking (no layout conversion); (64, 16, 4, *) and (128, 16, 8, *) convert it through shared memory.
# Of seven configs timed (on the GPTQ row order, 4-byte copies), (128, 16, 4, 3) was the fastest at 8-16
# rows for every shape, 4 stages within 2-7%, 256 columns and 64-channel tiles only won at one row
# (where the FMA kernel is faster still).
W4_WGMMA_CONFIGS = ((128, 16, 4, 3), (128, 16, 4, 4))


def w4_wgmma_usable(w: QuantizedLinearWeights, config: tuple) -> bool:
    """Whether w4a16_gemv_wgmma takes these weights with this config (whole tiles, one group per
    K tile, trivial g_idx and no channel permutation)."""
    block_n, block_r = config[0], config[1]
    return (w.format == W4A16.name and w.g_idx_trivial and w.perm is None and w.out_features % block_n == 0
            and block_r == W4_WGMMA_BLOCK_R and w.in_features % (8 * block_r) == 0
            and w.group_size % (8 * block_r) == 0
            and w.qweight.numel() < 2**31)


def w4a16_gemv_wgmma(x: torch.Tensor, w: QuantizedLinearWeights, packed: W4WgmmaWeights, *,
                     config: tuple = W4_WGMMA_CONFIGS[0], split_k: Optional[int] = None) -> torch.Tensor:
    """Decode-sized x [M <= 16, K] (bf16) @ int4 weights -> [M, N], reading packed
    (repack_w4_for_wgmma(w)); w gives the shape and checks. config: (BLOCK_N, BLOCK_R, num_warps,
    num_stages)."""
    K, N = w.in_features, w.out_features
    x = _check_decode_x(x, K, W4_WGMMA_MAX_M, "w4a16_gemv_wgmma")
    M = x.shape[0]
    if not w4_wgmma_usable(w, config):
        raise ValueError(f"w4a16_gemv_wgmma: weights [{N}, {K}] group {w.group_size} (perm {w.perm is not None}) "
                         f"do not fit config {config}")
    if packed.qweight.shape != (N, K // 8) or packed.zs.shape != (w.scales.shape[0], 2, N):
        raise ValueError("packed must be repack_w4_for_wgmma(w)")
    block_n, block_r, warps, stages = config
    tiles = N // block_n
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    launch_kernel(_w4_gemv_wgmma_kernel, (tiles, split),
        x, packed.qweight, packed.zs, out, ws, cnt, M, N, K, x.stride(0), out.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=split, USE_ASM=not INTERPRET,
        DOT_FP32=INTERPRET, num_warps=warps, num_stages=stages, **pdl_launch_kwargs(x.device))
    return out
