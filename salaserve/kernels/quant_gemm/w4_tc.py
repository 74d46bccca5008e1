"""The int4 decode GEMV on tensor cores (`w4a16_gemv_tc`, M <= 16): the start-up calibration's
candidate for 5-16 rows (decode batches, speculative verify), where the FMA kernel (w4_fma.py)
does not go. At 1-4 rows the FMA kernel is 1.5-1.7x faster at every shape (BENCHMARKS runs
63-64): this kernel runs at ~0.8-1.4 TB/s of weights whatever M is, its four sub-dots per tile
each waiting for the previous wgmma (Triton serialises dots whose A operand is in registers).

The weight tile is the dot's left operand, [BLOCK_N, K'] (BLOCK_N >= 64 rows: Hopper's wgmma
minimum), and x^T the right one ([K', 16]: x's rows clamped to the last real one, never stored).
Triton copies the packed tile (int32, GPTQ layout) into shared memory with cp.async, several
tiles ahead, and loads it from there straight into the registers of the dot's A operand; the
weights never pass through shared memory as bf16 (which would move 4 bytes per nibble there).

Dequantization, per packed word and per pair of nibbles: a 32-bit lop3 puts nibbles j and j + 4
(bits 4j.. and 4j + 16.. after a shift by 4j) into the mantissas of two bf16s, 128 + q each, and
one bf16x2 subtraction of (128 + z, 128 + z) leaves q - z, exact. So a register holds a pair of
A-operand elements, as the wgmma fragment wants them, if the dot's K index pairs the two nibbles:
sub-dot j (j = 0..3) covers nibbles j and j + 4 of the tile's packed rows, its K' index 2r + h
being input channel 8 (r0 + r) + j + 4h; x^T is gathered in that order. The group scale goes on
each tile's fp32 partial (one group per K tile). ~1.4 instructions per nibble for the unpacking
(shift, lop3, sub over two nibbles) against ~2.5 on the FMA kernel (its shift, lop3, fma).

Under the interpreter (no inline PTX) the same arithmetic runs in plain Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_launch_kwargs
from salaserve.kernels.quant_gemm._common import _INTERPRET, _check_x, _default_split_k, _store_output, _workspace
from salaserve.quant.formats import QuantizedLinearWeights

W4_TC_MAX_M = 16  # x^T is padded to the dot's 16 columns
BF16_128 = tl.constexpr(0x4300)  # bf16 bits of 128.0: OR-ed over a nibble at bits 0..3 it reads 128 + q


@triton.jit
def _nibble_pairs_minus_zero(qs, zz, z, USE_ASM: tl.constexpr):
    """(nibble 0 - z, nibble 4 - z) of every packed word qs as two bf16 tensors (exact). zz: the
    bf16x2 pair (128 + z, 128 + z) per column as int32; z: the zero point itself (interpreter)."""
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t;
            lop3.b32 t, $2, 0x000f000f, 0x43004300, 0xea;
            sub.rn.bf16x2 t, t, $3;
            mov.b32 {$0, $1}, t;
            }""",
            constraints="=h,=h,r,r", args=[qs, zz], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo = ((qs & 0xF) - z).to(tl.float32).to(tl.bfloat16)
        hi = (((qs >> 16) & 0xF) - z).to(tl.float32).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _w4_tc_subdot(qw, j: tl.constexpr, zz, z, xj, part, BLOCK_R: tl.constexpr, USE_ASM: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """part += (nibbles j and j + 4 of the packed tile, minus the zero) @ xj, xj being x^T in the
    sub-dot's K' order."""
    lo, hi = _nibble_pairs_minus_zero(qw >> (4 * j), zz, z[:, None], USE_ASM)
    w = tl.reshape(tl.join(lo, hi), (qw.shape[0], 2 * BLOCK_R))
    if DOT_FP32:
        return tl.dot(w.to(tl.float32), xj.to(tl.float32), part, input_precision="ieee")
    return tl.dot(w, xj, part)


@triton.jit
def _w4_gemv_tc_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, stride_zg,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # output columns; packed rows (8 channels each) per K tile
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,  # inline PTX dequantization (GPU); False: plain Triton (interpreter)
    DOT_FP32: tl.constexpr = False,  # interpreter runs: its tl.dot misreads bf16 operands
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    # Requires N % BLOCK_N == 0, K % (8 * BLOCK_R) == 0 and GROUP_SIZE % (8 * BLOCK_R) == 0 (the
    # launcher checks): no masks on weights or x, so that Triton pipelines both loads.
    BLOCK_M: tl.constexpr = 16
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    K8 = K // 8
    r_len = tl.cdiv(K8, SPLIT_K * BLOCK_R) * BLOCK_R  # whole tiles per split: groups stay aligned
    r_begin = tl.program_id(1) * r_len
    r_end = tl.minimum(r_begin + r_len, K8)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    r2 = tl.arange(0, 2 * BLOCK_R)
    m = tl.arange(0, BLOCK_M)
    w_tile = qweight_ptr + r[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_R] of the packed rows
    # x^T in the sub-dots' K order: row 2r + h of sub-dot j is channel 8r + j + 4h of the tile
    x_tile = x_ptr + tl.minimum(m, M - 1)[None, :].to(tl.int64) * stride_xm + (8 * (r2 // 2) + 4 * (r2 % 2))[:, None]
    z_shift = (offs_n % 8) * 4
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # x^T of the next tile is loaded while this one is consumed (by hand: Triton's pipeliner leaves
    # these gathers alone, and each sub-dot would otherwise wait out an L2 round trip); past the
    # split's end it re-reads the last tile (never used)
    r_last = tl.maximum(r_end - BLOCK_R, r_begin)
    x0 = tl.load(x_tile + r_begin * 8)
    x1 = tl.load(x_tile + r_begin * 8 + 1)
    x2 = tl.load(x_tile + r_begin * 8 + 2)
    x3 = tl.load(x_tile + r_begin * 8 + 3)
    for r0 in range(r_begin, r_end, BLOCK_R):
        qw = tl.load(w_tile + r0 * N)
        g = (r0 * 8) // GROUP_SIZE
        s = tl.load(scales_ptr + g * N + offs_n).to(tl.float32)
        z = (tl.load(qzeros_ptr + g * stride_zg + offs_n // 8) >> z_shift) & 0xF
        zb = z | BF16_128
        zz = (zb | (zb << 16))[:, None]
        x_next = x_tile + tl.minimum(r0 + BLOCK_R, r_last) * 8
        n0 = tl.load(x_next)
        n1 = tl.load(x_next + 1)
        n2 = tl.load(x_next + 2)
        n3 = tl.load(x_next + 3)
        part = _w4_tc_subdot(qw, 0, zz, z, x0, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), BLOCK_R, USE_ASM, DOT_FP32)
        part = _w4_tc_subdot(qw, 1, zz, z, x1, part, BLOCK_R, USE_ASM, DOT_FP32)
        part = _w4_tc_subdot(qw, 2, zz, z, x2, part, BLOCK_R, USE_ASM, DOT_FP32)
        part = _w4_tc_subdot(qw, 3, zz, z, x3, part, BLOCK_R, USE_ASM, DOT_FP32)
        acc += part * s[:, None]
        x0, x1, x2, x3 = n0, n1, n2, n3
    _store_output(tl.trans(acc), m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, pid_n, SPLIT_K)


# (BLOCK_N, BLOCK_R, num_warps, num_stages): checked by an sm_90 compile (no spills). Runs 63-64
# timed (128, 16, 4, 3|4) and (256, 16, 8, 3|4): the first won or tied at every shape (4 stages
# within 3%, 256 columns 1.2-1.5x slower). (64, 16, 4, 4) put a bf16 weight tile in shared memory.
W4_TC_CONFIGS = ((128, 16, 4, 3),)


def w4_tc_usable(w: QuantizedLinearWeights, config: tuple) -> bool:
    """Whether w4a16_gemv_tc takes these weights with this config (whole tiles, one group per
    K tile, trivial g_idx and no channel permutation)."""
    block_n, block_r = config[0], config[1]
    return (w.format == "w4a16" and w.g_idx_trivial and w.perm is None and w.out_features % block_n == 0
            and w.in_features % (8 * block_r) == 0 and w.group_size % (8 * block_r) == 0
            and w.qweight.numel() < 2**31)


def w4a16_gemv_tc(x: torch.Tensor, w: QuantizedLinearWeights, *, config: tuple = W4_TC_CONFIGS[0],
                  split_k: Optional[int] = None) -> torch.Tensor:
    """Decode-sized x [M <= 16, K] (bf16) @ int4 weights -> [M, N] on tensor cores. config:
    (BLOCK_N, BLOCK_R, num_warps, num_stages)."""
    K, N = w.in_features, w.out_features
    x = _check_x(x, K)
    M = x.shape[0]
    if not 1 <= M <= W4_TC_MAX_M:
        raise ValueError(f"w4a16_gemv_tc takes 1 <= M <= {W4_TC_MAX_M}, got {M}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"w4a16_gemv_tc takes bf16 x, got {x.dtype}")
    if not w4_tc_usable(w, config):
        raise ValueError(f"w4a16_gemv_tc: weights [{N}, {K}] group {w.group_size} (perm {w.perm is not None}) "
                         f"do not fit config {config}")
    block_n, block_r, warps, stages = config
    tiles = N // block_n
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    _w4_gemv_tc_kernel[(tiles, split)](
        x, w.qweight, w.qzeros, w.scales, out, ws, cnt, M, N, K, x.stride(0), out.stride(0), w.qzeros.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=split, USE_ASM=not _INTERPRET,
        DOT_FP32=_INTERPRET, num_warps=warps, num_stages=stages, **pdl_launch_kwargs(x.device))
    return out
