"""Triton kernels for quantized linear layers (bf16 activations) and the dispatch by M
(`quant_linear`; the table is in docs/quantization.md).

  w4a16 (GPTQ int4, v2 zeros, group scales, optional act-order g_idx / channel perm):
      - M <= W4_FMA_MAX_M (decode): `w4a16_gemv_fma`, each nibble read into an fp32 mantissa as
        16 + q/16 or 1 + q/16 (a shift per two nibbles, a lop3 and an fma per nibble); config
        and split-K per shape from `calibrate_w4` at start-up.
      - M <= GEMV_MAX_M: `w4a16_gemv`, split-K, tl.dot with BLOCK_M 16..64 on a [BK, BN] tile
        unpacked in registers (or fp32 FMAs at M = 1: the older decode kernel).
      - prefill: `w4a16_dense_mm`, W dequantized into a shared bf16 scratch, then cuBLAS
        (`w4a16_gemm`, the dequantize-in-tile GEMM, stays for act-order without reordering).
  fp8 (e4m3 weights, fp32 per-channel scale):
      - M <= GEMV_MAX_M: `w8a16_gemv`, split-K on tensor cores (x padded to 16 rows) with the
        weights converted to bf16 and x exact; by default (SALASERVE_FP8_DECODE=gemv, M <= 8)
        gemv.py's FMA GEMV on the fp8 codes where `calibrate_fp8_gemv` measured it faster; or with
        SALASERVE_FP8_DECODE=w8a8 (and K a
        multiple of 128) `w8a8_gemv`: x quantized to e4m3 per (token, 128 channels) inside the
        kernel and an fp8 x fp8 tensor-core dot.
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
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import (bf16_pair, fp8_codes, fp8_row_scale, pdl_launch_kwargs, pdl_supported,
                                             pdl_wait_first, round_to_e4m3, silu_mul_rounded, tl_dtype)
from salaserve.quant.formats import FP8_MAX, QuantizedLinearWeights, is_trivial_g_idx
from salaserve.quant.matmul import fp8_matmul_ref, linear_ref

GEMV_MAX_M = 64  # split-K GEMV kernels up to here; prefill paths above
SPLIT_K_CTAS_PER_SM = 4  # split-K aims at this many CTAs per SM (enough loads in flight)
SPLIT_K_MIN_CHANNELS = 256  # ...but never splits K finer than this
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# fp8 weights at decode sizes: "gemv" (default: gemv.py's FMA GEMV on the fp8 codes, per shape
# where the start-up calibration measures it faster than w8a16, M <= 8; with PDL and the silu_mul
# epilogue on gate_up), "w8a16" (tensor cores, weights converted to bf16; x exact) or "w8a8" (x
# quantized per 128 channels, fp8 tensor cores). Measured (BENCHMARKS run 36): batch-1 decode at
# 4K 3.637 ms with w8a16, 3.351 ms with gemv.
FP8_DECODE = os.environ.get("SALASERVE_FP8_DECODE", "gemv")
if FP8_DECODE not in ("w8a8", "w8a16", "gemv"):
    raise ValueError(f"SALASERVE_FP8_DECODE must be w8a8, w8a16 or gemv, got {FP8_DECODE!r}")
# SALASERVE_FP8_DOT=1 adds gemv.FP8_DOT_CONFIGS (fp8 on tensor cores with f16 operands) to the fp8
# GEMV calibration's candidates. Off: correct on the GPU but slower than the FMA GEMV at every
# shape (BENCHMARKS run 44).
FP8_DOT = os.environ.get("SALASERVE_FP8_DOT", "0") == "1"


def _configs(configs: list) -> list:
    # the interpreter cannot benchmark; one config means the autotuner never times anything
    return configs[:1] if _INTERPRET else configs


# ---------------------------------------------------------------- shared jit helpers


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (pid_m, pid_n, tile), grouped so GROUP_M row tiles reuse a column tile in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n, pid


@triton.jit
def _store_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K: tl.constexpr):
    """Write acc [BLOCK_M, BLOCK_N] (fp32) to out; with split-K, the last split reduces."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # workspace [SPLIT_K, M, N] fp32
        tl.store(part + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # all threads' partials are written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last split of this tile: sum all partials in a fixed order
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # re-armed for the next launch: no memset needed


@triton.jit
def _split_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_begin, k_end) of this split; split lengths are whole BLOCK_K tiles (groups stay aligned)."""
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_len
    return k_begin, tl.minimum(k_begin + k_len, K)


@triton.jit
def _int4_magic(qw):
    """qw int32 [R, BN] -> fp32 [R, 8, BN] = 2**23 + nibble; nibble j of row r is k = 8r + j."""
    shifts = tl.arange(0, 8) * 4
    nib = (qw[:, None, :] >> shifts[None, :, None]) & 0xF
    return (nib | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _zeros_magic(qzeros_ptr, g, offs_n, mask, stride_zg):
    """2**23 + true zero point of groups g at columns offs_n (shapes broadcast), fp32."""
    packed = tl.load(qzeros_ptr + g * stride_zg + offs_n // 8, mask=mask, other=0)
    return (((packed >> ((offs_n % 8) * 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- w4a16


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, perm_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, stride_zg, m_bucket,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,  # g_idx is not k // GROUP_SIZE: look the group up per input channel
    X_PERM: tl.constexpr,  # qweight row k holds input channel perm[k]: gather x through perm
    GROUP_PER_TILE: tl.constexpr,  # (heuristic) every K tile lies in one group: one scale row per tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n, tile = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin, k_end = _split_range(K, SPLIT_K, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    r = tl.arange(0, BLOCK_K // 8)  # packed rows of a K tile
    j = tl.arange(0, 8)  # nibble within a packed row

    if BLOCK_M == 1:
        # GEMV: one pass per nibble j over the packed tile [BK/8, BN] (row r holds k = 8r + j), so
        # qweight keeps its coalesced 2D layout; fp32 FMAs; the cross-thread reduction over K
        # happens once, after the loop
        offs_m = pid_m + tl.arange(0, 1)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            rows = k0 // 8 + r
            qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :],
                         mask=(rows[:, None] < K // 8) & n_mask[None, :], other=0)
            if GROUP_PER_TILE:
                g = k0 // GROUP_SIZE
                z = _zeros_magic(qzeros_ptr, g, offs_n, n_mask, stride_zg)[None, :]
                part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            for jj in tl.static_range(8):
                kk = rows * 8 + jj  # [BK/8] input channels of nibble jj
                k_mask = kk < K
                if X_PERM:
                    xk = tl.load(perm_ptr + kk, mask=k_mask, other=0)
                else:
                    xk = kk
                xj = tl.load(x_row + xk, mask=k_mask, other=0.0).to(tl.float32)[:, None]
                wj = (((qw >> (4 * jj)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
                if GROUP_PER_TILE:
                    part += xj * (wj - z)
                else:
                    if ACT_ORDER:
                        g = tl.load(g_idx_ptr + kk, mask=k_mask, other=0)[:, None]
                    else:
                        g = (kk // GROUP_SIZE)[:, None]
                    mask2 = k_mask[:, None] & n_mask[None, :]
                    zj = _zeros_magic(qzeros_ptr, g, offs_n[None, :], mask2, stride_zg)
                    sj = tl.load(scales_ptr + g * N + offs_n[None, :], mask=mask2, other=0.0).to(tl.float32)
                    acc2 += xj * ((wj - zj) * sj)
            if GROUP_PER_TILE:
                s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                acc2 += part * s[None, :]
        acc = tl.sum(acc2, axis=0)[None, :]
    else:
        # tensor cores: x tile [BM, BK] @ dequantized weight tile [BK, BN]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            if X_PERM:
                xk = tl.load(perm_ptr + kk, mask=k_mask, other=0)
            else:
                xk = kk
            xt = tl.load(x_rows + xk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            rows = k0 // 8 + r
            qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :],
                         mask=(rows[:, None] < K // 8) & n_mask[None, :], other=0)
            wq = _int4_magic(qw)
            if GROUP_PER_TILE:
                # q - zero is a small integer, exact in bf16: scale after the dot, in fp32
                g = k0 // GROUP_SIZE
                z = _zeros_magic(qzeros_ptr, g, offs_n, n_mask, stride_zg)
                s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                w = tl.reshape(wq - z[None, None, :], (BLOCK_K, BLOCK_N)).to(xt.dtype)
                acc += tl.dot(xt, w) * s[None, :]
            else:
                k3 = k0 + r[:, None] * 8 + j[None, :]
                k3_mask = k3 < K
                if ACT_ORDER:
                    g = tl.load(g_idx_ptr + k3, mask=k3_mask, other=0)[:, :, None]
                else:
                    g = (k3 // GROUP_SIZE)[:, :, None]
                mask3 = k3_mask[:, :, None] & n_mask[None, None, :]
                z = _zeros_magic(qzeros_ptr, g, offs_n[None, None, :], mask3, stride_zg)
                s = tl.load(scales_ptr + g * N + offs_n[None, None, :], mask=mask3, other=0.0).to(tl.float32)
                w = tl.reshape((wq - z) * s, (BLOCK_K, BLOCK_N)).to(xt.dtype)
                acc = tl.dot(xt, w, acc)
    _store_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K)


_w4a16_heur = triton.heuristics(
    {"GROUP_PER_TILE": lambda a: (not a["ACT_ORDER"]) and a["GROUP_SIZE"] % a["BLOCK_K"] == 0}
)(_w4a16_kernel)

# Config lists were checked by compiling for sm_90 (no spills, shared memory fits); timing is the
# autotuner's job. GEMV keys on the M-tile kind: the FMA path (BLOCK_M 1) and the tl.dot path differ.
_W4_GEMV_FMA = [
    triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_K": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 256}, num_warps=8, num_stages=2),
]
_W4_GEMV_DOT = [
    triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128}, num_warps=8, num_stages=3),
]
_W4_GEMM = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]
_GEMV_KEY = ["BLOCK_M", "BLOCK_N", "N", "K", "SPLIT_K", "ACT_ORDER"]
_w4a16_gemv_fma_tuned = triton.autotune(configs=_configs(_W4_GEMV_FMA), key=_GEMV_KEY)(_w4a16_heur)
_w4a16_gemv_dot_tuned = triton.autotune(configs=_configs(_W4_GEMV_DOT), key=_GEMV_KEY)(_w4a16_heur)
_w4a16_gemm_tuned = triton.autotune(configs=_configs(_W4_GEMM), key=["m_bucket", "N", "K", "ACT_ORDER"])(_w4a16_heur)


# ---------------------------------------------------------------- w4a16 decode GEMV (FMA)
#
# At M = 1 the int4 GEMV is bound by instruction issue, not only by bytes: 8.9 G nibbles per
# decode step against ~33 T lane-instructions/s (4 schedulers x 32 lanes x 132 SMs x ~2 GHz)
# leaves ~4 instructions per nibble for a 1 ms step. So each nibble goes straight into an fp32
# mantissa, with no int->float convert and no zero subtraction per weight. A packed word is
# shifted 4 times (by 8t - 15 bits, t = 0..3) so that nibbles 2t and 2t + 1 land on bits 15..18
# and 19..22; one lop3 each then makes
#     lo = 16 + q/16 = (bits & 0x00078000) | 0x41800000,   hi = 1 + q/16 = (bits & 0x00780000) | 0x3F800000
# and one fma multiplies it into the accumulator: ~2.5 instructions per nibble. The constant
# parts come out once per group and column: a thread's accumulator starts each group at
#     -(16 sum x_lo + sum x_hi) - z sum x / 16      (x summed over the thread's own rows)
# and ends at sum x (q - z) / 16, which one fma scales into the sum (x 16 after the loop). The
# cancellation costs ~9 of fp32's 24 bits (terms up to ~256x the result), far below the bf16
# output's 8. The zero point comes from its packed word the same way as the weights (lo or hi).
#
# Everything else is spread over as many nibbles as the registers allow (w4_fma_layout): a
# thread holds SLABS packed rows x VECS 16-byte vectors (4 columns each) of a tile. Per row (x
# load, unpack and sums) is shared by its 4 * VECS columns, per column (zero, scale, start value,
# scale fma) by its SLABS rows, whose fmas chain into one accumulator. Triton's default layout of
# a [VECS, BLOCK_R / SLABS, BLOCK_N / VECS / 4, 4] tensor puts one row of it on each thread with
# its VECS vectors in registers (dimension 0 gets threads last); the SLABS row slabs are separate
# loads, joined. bf16 x: one 16-byte load per packed row, whose int32 pairs x[k], x[k+1] are the
# lo and hi of one shift (two bit operations per pair). EVEN (N, K whole tiles): no masks, the
# prefetch past a split's end re-reads its last tile. The loop is unrolled twice so that the
# prefetched tile's registers alternate instead of being copied. sm_90 loop SASS at M = 1
# (scripts/w4_sass_count.py): (64, 16, 4) 4.97 -> 3.70 instructions per nibble, (128, 16, 4)
# 4.77 -> 3.28. GPTQ layout as stored (qweight [K/8, N]), one group per K tile (BLOCK_R * 8
# divides the group size), x read through perm for act-order.


@triton.jit
def _x_pair(x_row, rows, t: tl.constexpr, perm_ptr, mask, X_PERM: tl.constexpr):
    """x[8r + 2t], x[8r + 2t + 1] of packed rows r as fp32, one value per load (through perm when X_PERM)."""
    ka = rows * 8 + 2 * t
    kb = ka + 1
    if X_PERM:
        ka = tl.load(perm_ptr + ka, mask=mask, other=0)
        kb = tl.load(perm_ptr + kb, mask=mask, other=0)
    xa = tl.load(x_row + ka, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_row + kb, mask=mask, other=0.0).to(tl.float32)
    return xa, xb


@triton.jit
def _x_row(x_row, rows, x_quads, perm_ptr, mask, X_PAIRS: tl.constexpr, X_PERM: tl.constexpr):
    """((x[8r + 2t], x[8r + 2t + 1]) for t = 0..3) of packed rows r as fp32. X_PAIRS: x_quads points
    at the rows' 4 int32 pairs in the last dimension (one 16-byte load); mask None: all rows exist."""
    if X_PAIRS:
        if mask is None:
            u = tl.load(x_quads)
        else:
            u = tl.load(x_quads, mask=mask, other=0)
        u02, u13 = tl.split(tl.reshape(u, u.shape[:-1] + (2, 2)))
        u0, u2 = tl.split(u02)
        u1, u3 = tl.split(u13)
        xp = (bf16_pair(u0[:, :, :, None]), bf16_pair(u1[:, :, :, None]), bf16_pair(u2[:, :, :, None]),
              bf16_pair(u3[:, :, :, None]))
    else:
        if mask is None:
            mask = rows >= 0
        xp = (_x_pair(x_row, rows, 0, perm_ptr, mask, X_PERM), _x_pair(x_row, rows, 1, perm_ptr, mask, X_PERM),
              _x_pair(x_row, rows, 2, perm_ptr, mask, X_PERM), _x_pair(x_row, rows, 3, perm_ptr, mask, X_PERM))
    return xp  # one return: the compiler checks every return's type, constexpr-dead ones included


@triton.jit
def _w4_part_start(xp, xq, zf, z_lo, SLABS: tl.constexpr):
    """A group's accumulator start -(16 sum x_lo + sum x_hi) - z sum x / 16 over the thread's rows (xp,
    and xq when SLABS == 2); zf = 16 + z/16 where z_lo, else 1 + z/16 (one fma per column)."""
    a = xp[0][0] + xp[1][0] + xp[2][0] + xp[3][0]
    b = xp[0][1] + xp[1][1] + xp[2][1] + xp[3][1]
    if SLABS == 2:
        a += xq[0][0] + xq[1][0] + xq[2][0] + xq[3][0]
        b += xq[0][1] + xq[1][1] + xq[2][1] + xq[3][1]
    return zf * -(a + b) + tl.where(z_lo, 15.0 * b, -15.0 * a)


@triton.jit
def _w4_slab_fmas(w, part0, part1, part2, part3, xp0, xp1, xp2, xp3, magic_lo, magic_hi, BLOCK_M: tl.constexpr):
    """part_m += sum over the 8 nibbles of x_m * (16 + q/16 or 1 + q/16) for one slab w of packed rows
    (x rows m < BLOCK_M): a shift per two nibbles, then a lop3 and an fma per nibble and row."""
    for t in tl.static_range(4):
        if t < 2:
            bits = w << (15 - 8 * t)
        else:
            bits = w >> (8 * t - 15)
        w_lo = ((bits & 0x00078000) | magic_lo).to(tl.float32, bitcast=True)  # 16 + q/16, q = nibble 2t
        w_hi = ((bits & 0x00780000) | magic_hi).to(tl.float32, bitcast=True)  # 1 + q/16, q = nibble 2t+1
        part0 += xp0[t][0] * w_lo
        part0 += xp0[t][1] * w_hi  # two fmas (a sum of products would add an fadd)
        if BLOCK_M >= 2:
            part1 += xp1[t][0] * w_lo
            part1 += xp1[t][1] * w_hi
        if BLOCK_M >= 4:
            part2 += xp2[t][0] * w_lo
            part2 += xp2[t][1] * w_hi
            part3 += xp3[t][0] * w_lo
            part3 += xp3[t][1] * w_hi
    return part0, part1, part2, part3


@triton.jit
def _w4_tile(w_slab0, w_slab1, r0, r_end, N, rr, cols, BLOCK_R: tl.constexpr, SLABS: tl.constexpr,
             EVEN: tl.constexpr):
    """The weight tile at packed row r0: its SLABS row slabs joined in the last dimension. EVEN: past
    r_end the split's last tile again (a prefetch never consumed); else masked."""
    if EVEN:
        off = tl.minimum(r0, r_end - BLOCK_R) * N
        w = tl.load(w_slab0 + off)
        if SLABS == 2:
            w = tl.join(w, tl.load(w_slab1 + off))
    else:
        w = tl.load(w_slab0 + r0 * N, mask=(r0 + rr < r_end) & (cols < N), other=0)
        if SLABS == 2:
            w = tl.join(w, tl.load(w_slab1 + r0 * N, mask=(r0 + BLOCK_R // 2 + rr < r_end) & (cols < N), other=0))
    return w


@triton.jit
def _w4_out_row(acc, BLOCK_N: tl.constexpr):
    """[VECS, rows, BLOCK_N / VECS / 4, 4] accumulators -> the tile's [1, BLOCK_N] output row (x 16)."""
    return tl.reshape(tl.sum(acc, axis=1) * 16.0, (BLOCK_N,))[None, :]


@triton.jit
def _w4_gemv_fma_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, perm_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, stride_zg,
    magic_lo, magic_hi,  # W4_MAGIC_LO / W4_MAGIC_HI (runtime values so that they stay in registers)
    GROUP_SIZE: tl.constexpr, X_PERM: tl.constexpr,
    X_PAIRS: tl.constexpr,  # x is bf16 with even row stride and no perm: read it as int32 pairs
    BLOCK_M: tl.constexpr,  # 1, 2 or 4 rows of x, each with its own accumulators
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # BLOCK_R packed rows (BLOCK_R * 8 channels) per tile
    SPLIT_K: tl.constexpr,
    SLABS: tl.constexpr, VECS: tl.constexpr,  # w4_fma_layout: packed rows x 16-byte vectors per thread
    EVEN: tl.constexpr,  # N a multiple of BLOCK_N and K of BLOCK_R * 8: no masks
    PREFETCH: tl.constexpr = 1,  # weight tiles loaded ahead of the one being consumed: 1 or 2
    PDL: tl.constexpr = False,  # programmatic dependent launch (_triton_utils)
):
    # Everything stays in the weight slab's layout [VECS, RS, NV/4, 4] (RS rows of a slab, NV columns
    # of a vector's stripe), and x's values arrive as [1, RS, ., 1] slices of it: no layout
    # conversion (shared memory) inside the loop.
    RS: tl.constexpr = BLOCK_R // SLABS
    NV: tl.constexpr = BLOCK_N // VECS
    pid_n = tl.program_id(0)
    K8 = K // 8
    r_len = tl.cdiv(K8, SPLIT_K * BLOCK_R) * BLOCK_R  # whole tiles per split: groups stay aligned
    r_begin = tl.program_id(1) * r_len
    r_end = tl.minimum(r_begin + r_len, K8)
    rr = tl.arange(0, RS)[None, :, None, None]
    lane = tl.arange(0, NV // 4)[None, None, :, None]
    k4 = tl.arange(0, 4)[None, None, None, :]
    vec0 = pid_n * BLOCK_N + (tl.arange(0, VECS) * NV)[:, None, None, None] + lane * 4  # [V, 1, NV/4, 1]
    cols = vec0 + k4
    w_slab0 = qweight_ptr + rr * N + cols
    w_slab1 = w_slab0 + RS * N
    # per-column loads broadcast over the slab's rows: Triton then gives them the weights' layout
    # (the [V, 1, NV/4, 4] shape alone gets another, and a conversion in the loop)
    rows0 = rr * 0
    s_cols = scales_ptr + cols + rows0
    z_cols = qzeros_ptr + vec0 // 8 + rows0
    z_shift = (vec0 % 8) * 4 + rows0
    z_lo = k4 % 2 == 0  # even columns: zero point as lo (16 + z/16), odd: hi (1 + z/16)
    x_quads = rr * 4 + lane * 0 + k4  # int32 pairs of the slab's rows: [1, RS, NV/4, 4]
    x0_row = x_ptr
    x1_row = x_ptr + tl.minimum(1, M - 1) * stride_xm  # rows past M: a copy of the last, never stored
    x2_row = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x3_row = x_ptr + tl.minimum(3, M - 1) * stride_xm
    x0_pairs = x0_row.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    x1_pairs = x1_row.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    x2_pairs = x2_row.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    x3_pairs = x3_row.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    if PDL:  # the next PDL kernel may start launching now
        tl.extra.cuda.gdc_launch_dependents()
    # first weight tile before the dependency wait: weights never depend on the previous kernel
    w = _w4_tile(w_slab0, w_slab1, r_begin, r_end, N, rr, cols, BLOCK_R, SLABS, EVEN)
    if PREFETCH >= 2:
        w1 = _w4_tile(w_slab0, w_slab1, r_begin + BLOCK_R, r_end, N, rr, cols, BLOCK_R, SLABS, EVEN)
    else:
        w1 = w  # unused
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc0 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    acc1 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    acc2 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    acc3 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    for r0 in tl.range(r_begin, r_end, BLOCK_R, loop_unroll_factor=2):
        # the tile PREFETCH ahead is issued before this one is consumed: PREFETCH + 1 tiles in flight
        w_next = _w4_tile(w_slab0, w_slab1, r0 + PREFETCH * BLOCK_R, r_end, N, rr, cols, BLOCK_R, SLABS, EVEN)
        rows = r0 + rr
        if EVEN:
            x_mask = None
            x_mask1 = None
            s = tl.load(s_cols + (r0 * 8) // GROUP_SIZE * N).to(tl.float32)
            zq = tl.load(z_cols + (r0 * 8) // GROUP_SIZE * stride_zg)
        else:
            x_mask = rows < r_end
            x_mask1 = rows + RS < r_end
            s = tl.load(s_cols + (r0 * 8) // GROUP_SIZE * N, mask=cols < N, other=0.0).to(tl.float32)
            zq = tl.load(z_cols + (r0 * 8) // GROUP_SIZE * stride_zg, mask=vec0 + rows0 < N, other=0)
        zbits = (zq >> z_shift) << (15 - 8 * (k4 // 2))  # this column's zero on bits 15..18 (lo) or 19..22
        zf = ((zbits & tl.where(z_lo, 0x00078000, 0x00780000)) | tl.where(z_lo, magic_lo, magic_hi)).to(
            tl.float32, bitcast=True)
        xp0 = _x_row(x0_row, rows, x0_pairs + r0 * 4, perm_ptr, x_mask, X_PAIRS, X_PERM)
        xq0 = xp0
        if SLABS == 2:
            xq0 = _x_row(x0_row, rows + RS, x0_pairs + (r0 + RS) * 4, perm_ptr, x_mask1, X_PAIRS, X_PERM)
        part0 = _w4_part_start(xp0, xq0, zf, z_lo, SLABS)
        # rows 1..3 alias row 0 where BLOCK_M leaves them out (unused, no code)
        xp1, xq1, part1 = xp0, xq0, part0
        xp2, xq2, part2 = xp0, xq0, part0
        xp3, xq3, part3 = xp0, xq0, part0
        if BLOCK_M >= 2:
            xp1 = _x_row(x1_row, rows, x1_pairs + r0 * 4, perm_ptr, x_mask, X_PAIRS, X_PERM)
            xq1 = xp1
            if SLABS == 2:
                xq1 = _x_row(x1_row, rows + RS, x1_pairs + (r0 + RS) * 4, perm_ptr, x_mask1, X_PAIRS, X_PERM)
            part1 = _w4_part_start(xp1, xq1, zf, z_lo, SLABS)
        if BLOCK_M >= 4:
            xp2 = _x_row(x2_row, rows, x2_pairs + r0 * 4, perm_ptr, x_mask, X_PAIRS, X_PERM)
            xp3 = _x_row(x3_row, rows, x3_pairs + r0 * 4, perm_ptr, x_mask, X_PAIRS, X_PERM)
            xq2 = xp2
            xq3 = xp3
            if SLABS == 2:
                xq2 = _x_row(x2_row, rows + RS, x2_pairs + (r0 + RS) * 4, perm_ptr, x_mask1, X_PAIRS, X_PERM)
                xq3 = _x_row(x3_row, rows + RS, x3_pairs + (r0 + RS) * 4, perm_ptr, x_mask1, X_PAIRS, X_PERM)
            part2 = _w4_part_start(xp2, xq2, zf, z_lo, SLABS)
            part3 = _w4_part_start(xp3, xq3, zf, z_lo, SLABS)
        if SLABS == 2:
            wa, wb = tl.split(w)
            part0, part1, part2, part3 = _w4_slab_fmas(wa, part0, part1, part2, part3, xp0, xp1, xp2, xp3,
                                                       magic_lo, magic_hi, BLOCK_M)
            part0, part1, part2, part3 = _w4_slab_fmas(wb, part0, part1, part2, part3, xq0, xq1, xq2, xq3,
                                                       magic_lo, magic_hi, BLOCK_M)
        else:
            part0, part1, part2, part3 = _w4_slab_fmas(w, part0, part1, part2, part3, xp0, xp1, xp2, xp3,
                                                       magic_lo, magic_hi, BLOCK_M)
        acc0 += s * part0
        if BLOCK_M >= 2:
            acc1 += s * part1
        if BLOCK_M >= 4:
            acc2 += s * part2
            acc3 += s * part3
        if PREFETCH >= 2:
            w = w1
            w1 = w_next
        else:
            w = w_next
    # rows of the output tile: [BLOCK_M, BLOCK_N] from the per-row sums over K
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    sel = offs_m[:, None]
    y = tl.where(sel == 0, _w4_out_row(acc0, BLOCK_N), 0.0)
    if BLOCK_M >= 2:
        y = tl.where(sel == 1, _w4_out_row(acc1, BLOCK_N), y)
    if BLOCK_M >= 4:
        y = tl.where(sel == 2, _w4_out_row(acc2, BLOCK_N), y)
        y = tl.where(sel == 3, _w4_out_row(acc3, BLOCK_N), y)
    _store_output(y, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, pid_n, SPLIT_K)


# fp32 sign/exponent bits of 16 and 1: OR-ed over a nibble at mantissa bits 15..18 / 19..22 they
# read 16 + q/16 and 1 + q/16. Passed as kernel arguments, not literals: as literals ptxas
# re-materialises them with a MOV before every lop3 (one more instruction per nibble, sm_90 SASS)
W4_MAGIC_LO, W4_MAGIC_HI = 0x41800000, 0x3F800000
W4_FMA_MAX_M = 4  # above, the per-row accumulators crowd the registers: the tl.dot kernel
# (BLOCK_N, BLOCK_R, num_warps, tiles prefetched) per M bucket; each checked by an sm_90 compile
# (no spills). Run 14 (M = 1): 64-column tiles won at every shape but lm_head. 2 warps on 64
# columns: 2 rows x 8 columns per thread (3.28 loop instructions per nibble, 4 warps 3.70).
W4_FMA_CONFIGS = {
    1: ((64, 16, 4, 1), (64, 16, 4, 2), (64, 16, 2, 1), (64, 16, 2, 2), (64, 8, 4, 2), (128, 16, 4, 1),
        (128, 8, 4, 2), (256, 8, 8, 1)),
    2: ((128, 8, 4, 1), (64, 16, 4, 1)),
    4: ((64, 8, 4, 1), (128, 4, 4, 1)),
}
# the longest K tile of those configs: a group size it divides fits every config
W4_FMA_GROUP_MULTIPLE = 8 * max(cfg[1] for cfgs in W4_FMA_CONFIGS.values() for cfg in cfgs)


def w4_fma_layout(block_n: int, block_r: int, warps: int) -> dict:
    """SLABS, VECS of _w4_gemv_fma_kernel: a tile's 16-byte vectors per thread as SLABS packed rows
    (up to 2, chained into one accumulator) x VECS column vectors."""
    vecs = max(1, block_r * block_n // (128 * warps))
    slabs = min(2, vecs, block_r)
    return dict(SLABS=slabs, VECS=vecs // slabs)


def w4a16_gemv_fma(x: torch.Tensor, w: QuantizedLinearWeights, *, config: Optional[tuple] = None,
                   split_k: Optional[int] = None) -> torch.Tensor:
    """Decode-sized x [M <= W4_FMA_MAX_M, K] @ int4 weights (trivial g_idx, or reordered with perm)
    -> [M, N] in x.dtype. config: (BLOCK_N, BLOCK_R, num_warps[, tiles prefetched]), default the
    bucket's first."""
    K, N = w.in_features, w.out_features
    x = _check_x(x, K)
    M = x.shape[0]
    if not 1 <= M <= W4_FMA_MAX_M:
        raise ValueError(f"w4a16_gemv_fma takes 1 <= M <= {W4_FMA_MAX_M}, got {M}")
    if not w.g_idx_trivial:
        raise ValueError("act-order weights must be reordered first (formats.reorder_act_order)")
    if w.qweight.numel() >= 2**31:
        raise ValueError("qweight too large for the kernel's int32 offsets")
    block_m = triton.next_power_of_2(M)  # 1, 2 or 4
    if config is None:
        config, split_k = _W4_TABLE.get(_w4_key(block_m, w, x.device), (W4_FMA_CONFIGS[block_m][0], split_k))
    block_n, block_r, warps, *more = config
    prefetch = more[0] if more else 1
    if w.group_size % (block_r * 8) or K % 8:
        raise ValueError(f"group size {w.group_size} must be a multiple of the K tile {block_r * 8}")
    tiles = triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    x_pairs = x.dtype == torch.bfloat16 and w.perm is None and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
    _w4_gemv_fma_kernel[(tiles, split)](
        x, w.qweight, w.qzeros, w.scales, w.perm if w.perm is not None else w.qzeros, out, ws, cnt,
        M, N, K, x.stride(0), out.stride(0), w.qzeros.stride(0), W4_MAGIC_LO, W4_MAGIC_HI,
        GROUP_SIZE=w.group_size, X_PERM=w.perm is not None, X_PAIRS=x_pairs, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=block_r, SPLIT_K=split, **w4_fma_layout(block_n, block_r, warps),
        EVEN=N % block_n == 0 and K % (8 * block_r) == 0, PREFETCH=prefetch, num_warps=warps,
        **pdl_launch_kwargs(x.device))
    return out


# (bucket, N, K, group size, device) -> ((BLOCK_N, BLOCK_R, warps, prefetch), split), filled by calibrate_w4
_W4_TABLE: dict[tuple, tuple] = {}


def _device_key(device) -> str:
    """The calibration tables' device name: "cuda" (the runner's device) and x.device ("cuda:0")
    must meet."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def _to_calibrate(weights, device, m_values, usable, key, table):
    """The start-up calibrations' work list: (weight, its M values not yet in `table`) for each
    weight `usable` accepts; nothing off the GPU. key(m, w, device) is the table's key."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    for w in weights:
        if usable(w):
            todo = [m for m in m_values if key(m, w, device) not in table]
            if todo:
                yield w, todo


def _w4_key(bucket: int, w: QuantizedLinearWeights, device) -> tuple:
    return (bucket, w.out_features, w.in_features, w.group_size, _device_key(device))


def _w4_splits(N: int, K: int, block_n: int, block_r: int, device) -> list[int]:
    """Split-K candidates: ~4, 8 and 16 CTAs per SM, each split at least two K tiles long."""
    tiles = triton.cdiv(N, block_n)
    out = []
    for per_sm in (4, 8, 16):
        want = max(1, per_sm * _sm_count(torch.device(device)) // tiles)
        split = 1 << (want.bit_length() - 1)
        while split > 1 and K // 8 < split * 2 * block_r:
            split //= 2
        if split not in out:
            out.append(split)
    return out


def calibrate_w4(weights, device, m_values=(1, 2, 4), verbose: bool = False) -> dict:
    """Time every (config, split) of the decode FMA kernel per (M bucket, shape) in CUDA graphs of
    back-to-back calls over L2-busting random weights of the same layout, and keep the fastest
    for w4a16_gemv_fma (a few seconds at start-up, before graph capture; GPU only)."""
    from salaserve.kernels.timing import graph_time_us, l2_busting_count

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    result = {}

    def usable(w):
        return w.format == "w4a16" and w.g_idx_trivial and w.group_size % W4_FMA_GROUP_MULTIPLE == 0

    for w, todo in _to_calibrate(weights, device, m_values, usable, _w4_key, _W4_TABLE):
        N, K = w.out_features, w.in_features
        n_copies = l2_busting_count(w.qweight.nbytes)
        copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1))
                  for _ in range(n_copies)]
        for m in todo:
            x = torch.randn(m, K, device=device).to(torch.bfloat16)
            best = None
            for cfg in W4_FMA_CONFIGS[m]:
                for split in _w4_splits(N, K, cfg[0], cfg[1], device):
                    t = graph_time_us(lambda i: w4a16_gemv_fma(x, copies[i % n_copies], config=cfg, split_k=split),
                                      calls=max(8, n_copies))
                    if verbose:
                        print(f"  w4 M={m} N={N} K={K} {cfg} split {split}: {t:.1f} us")
                    if best is None or t < best[2]:
                        best = (cfg, split, t)
            _W4_TABLE[_w4_key(m, w, device)] = best[:2]
            result[(m, N, K)] = best
        del copies
    for w in weights:  # shapes calibrated before (or skipped above) report their recorded choice
        for m in m_values:
            hit = _W4_TABLE.get(_w4_key(m, w, device))
            if hit is not None:
                result.setdefault((m, w.out_features, w.in_features), (*hit, float("nan")))
    return result


# ---------------------------------------------------------------- w4a16 prefill: dequantize + cuBLAS
#
# At prefill sizes the GEMM is compute-bound and cuBLAS's bf16 tensor-core GEMM (~690 TFLOP/s)
# beats a dequantize-in-tile Triton GEMM by ~2x (micro: w4a16 32K prefill 0.50x bf16). So the
# weight is expanded once per call into a shared bf16 scratch [K, N] (4.5 bytes moved per weight,
# ~1% of an 8K-token chunk's GEMM time) and cuBLAS does the product.


@triton.jit
def _w4_dequant_kernel(qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N, K, stride_zg,
                       GROUP_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [K, N] (N contiguous, qweight's orientation) = (q - z) * s, rounded once to out's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < K // 8) & (offs_n[None, :] < N)
    w = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    g = (rows[:, None] * 8) // GROUP_SIZE  # the 8 channels of a packed row share a group (GROUP_SIZE % 8 == 0)
    s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = (tl.load(qzeros_ptr + g * stride_zg + offs_n[None, :] // 8, mask=mask, other=0)
         >> ((offs_n[None, :] % 8) * 4)) & 0xF
    for j in tl.static_range(8):
        kk = rows[:, None] * 8 + j
        q = (w >> (4 * j)) & 0xF
        tl.store(out_ptr + kk.to(tl.int64) * N + offs_n[None, :], ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty),
                 mask=mask)


_SCRATCH: dict[str, torch.Tensor] = {}


def w4a16_dequantize(w: QuantizedLinearWeights, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W^T [K, N] in `dtype` (rows in qweight's order: perm-ordered for reordered act-order weights)."""
    K, N = w.in_features, w.out_features
    if w.group_size % 8:
        raise ValueError(f"group size {w.group_size} must be a multiple of 8")
    if out is None:
        out = torch.empty(K, N, dtype=dtype, device=w.qweight.device)
    block_r, block_n = 8, 128
    _w4_dequant_kernel[(triton.cdiv(K // 8, block_r), triton.cdiv(N, block_n))](
        w.qweight, w.qzeros, w.scales, out, N, K, w.qzeros.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return out


def w4a16_dense_mm(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """Prefill-sized x [M, K] @ int4 weights via a bf16/fp16 scratch copy of W^T and torch.mm.
    One scratch per device, shared by every call (calls on one stream run in order)."""
    K, N = w.in_features, w.out_features
    x = _check_x(x, K)
    if not w.g_idx_trivial:
        raise ValueError("act-order weights must be reordered first (formats.reorder_act_order)")
    key = f"{x.device}-{x.dtype}"
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < K * N:
        _SCRATCH.pop(key, None)
        buf = torch.empty(K * N, dtype=x.dtype, device=x.device)
        _SCRATCH[key] = buf
    wt = w4a16_dequantize(w, x.dtype, out=buf[: K * N].view(K, N))
    if w.perm is not None:
        x = x[:, w.perm.long()]  # qweight row k holds input channel perm[k]
    return x @ wt


# ---------------------------------------------------------------- w8a16 (fp8 weights)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr = False,  # interpreter runs: its tl.dot misreads bf16 operands
    # programmatic dependent launch, waiting first; w8a16_gemv leaves it off: the large shapes
    # measured up to 30% slower with it (run 15's A/B, same config: gate_up 36.2 us plain, 47.1
    # with PDL). scripts/pdl_ab_quant.py times both.
    PDL: tl.constexpr = False,
):
    pdl_wait_first(PDL)
    pid_m, pid_n, tile = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin, k_end = _split_range(K, SPLIT_K, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # weight [N, K], K contiguous
    if BLOCK_M == 1:
        offs_m = pid_m + tl.arange(0, 1)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            xv = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
            wt = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc2 += wt.to(tl.float32) * xv[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            wt = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            # e4m3 -> fp16 is exact and native; fp16 -> bf16 is exact for e4m3 values
            if DOT_FP32:
                acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(wt.to(tl.float16).to(xt.dtype)), acc)
    s = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    acc = acc * s[None, :]  # per-channel scale is linear: fine to apply before the split reduction
    _store_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K)


_W8_GEMV_FMA = [
    triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 256}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128}, num_warps=8, num_stages=4),
]
_W8_GEMV_DOT = [
    triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 256}, num_warps=8, num_stages=3),
]
_w8a16_gemv_fma_tuned = triton.autotune(configs=_configs(_W8_GEMV_FMA), key=_GEMV_KEY[:-1])(_w8a16_kernel)
_w8a16_gemv_dot_tuned = triton.autotune(configs=_configs(_W8_GEMV_DOT), key=_GEMV_KEY[:-1])(_w8a16_kernel)

# ---------------------------------------------------------------- launch helpers

_WORKSPACE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


_WS_MIN_FLOATS = 8 << 20  # 32 MB: split * M * N of every GEMV launch up to M = 64 at the model's shapes
_WS_MIN_TILES = 1 << 14


def _workspace(device: torch.device, n_floats: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials and tile counters, one pair per device (kernels on one stream run in
    order, so sharing is safe). On a GPU they start large enough for every launch the model makes:
    a CUDA graph keeps the pointers it captured, so a later growth would leave it reading freed
    memory; growth during capture is refused."""
    key = str(device)
    ws, cnt = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < n_floats or cnt.numel() < n_tiles:
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("quantized GEMV workspace must grow during CUDA-graph capture: run the "
                                   "shape once before capturing")
            n_floats, n_tiles = max(n_floats, _WS_MIN_FLOATS), max(n_tiles, _WS_MIN_TILES)
        n_floats = max(n_floats, 0 if ws is None else ws.numel())
        n_tiles = max(n_tiles, 0 if cnt is None else cnt.numel())
        ws = torch.empty(max(n_floats, 1), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(n_tiles, 1), dtype=torch.int32, device=device)  # counters start at 0
        _WORKSPACE[key] = (ws, cnt)
    return ws, cnt


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: pretend H200


def _gemv_block_m(M: int) -> int:
    return 1 if M == 1 else min(64, max(16, triton.next_power_of_2(M)))


def _default_split_k(tiles: int, K: int, device: torch.device) -> int:
    """Enough splits for SPLIT_K_CTAS_PER_SM CTAs per SM, at most 32, power of two."""
    want = max(1, SPLIT_K_CTAS_PER_SM * _sm_count(device) // max(tiles, 1))
    split = max(1, min(want, K // SPLIT_K_MIN_CHANNELS, 32))
    return 1 << (split.bit_length() - 1)


def _check_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _act_order(g_idx: Optional[torch.Tensor], group_size: int, act_order: Optional[bool]) -> bool:
    if act_order is not None:
        return act_order
    return not is_trivial_g_idx(g_idx, group_size)  # syncs; the container caches this instead


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    perm: Optional[torch.Tensor] = None,
    *,
    act_order: Optional[bool] = None,
    split_k: Optional[int] = None,
    block_n: int = 128,
    block_k: Optional[int] = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Small-M x [M, K] @ int4 weights -> [M, N] in x.dtype. qzeros are v2 (true zeros).
    block_k given: that config, no autotuning (tests, benchmarks); split_k None: heuristic."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    x = _check_x(x, K)
    M = x.shape[0]
    gs = K if group_size <= 0 else group_size
    ao = _act_order(g_idx, gs, act_order)
    block_m = _gemv_block_m(M)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    args = (x, qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, perm if perm is not None else qzeros,
            out, ws, cnt, M, N, K, x.stride(0), out.stride(0), qzeros.stride(0), block_m)
    meta = dict(GROUP_SIZE=gs, ACT_ORDER=ao, X_PERM=perm is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                SPLIT_K=split, GROUP_M=1)
    grid = (tiles, split)
    if block_k is None:
        (_w4a16_gemv_fma_tuned if block_m == 1 else _w4a16_gemv_dot_tuned)[grid](*args, **meta)
    else:
        _w4a16_heur[grid](*args, **meta, BLOCK_K=block_k, num_warps=num_warps)
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    perm: Optional[torch.Tensor] = None,
    *,
    act_order: Optional[bool] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Large-M (prefill) x [M, K] @ int4 weights -> [M, N] in x.dtype, tiled tl.dot, no split-K.
    config (BLOCK_M/BLOCK_N/BLOCK_K[/num_warps]) given: no autotuning."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    x = _check_x(x, K)
    M = x.shape[0]
    gs = K if group_size <= 0 else group_size
    ao = _act_order(g_idx, gs, act_order)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, 0, 1)
    args = (x, qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, perm if perm is not None else qzeros,
            out, ws, cnt, M, N, K, x.stride(0), out.stride(0), qzeros.stride(0),
            min(triton.next_power_of_2(M), 4096))
    meta = dict(GROUP_SIZE=gs, ACT_ORDER=ao, X_PERM=perm is not None, SPLIT_K=1, GROUP_M=8)

    def grid(c):
        return (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]), 1)

    if config is None:
        _w4a16_gemm_tuned[grid](*args, **meta)
    else:
        cfg = dict(config)
        warps = cfg.pop("num_warps", 4)
        _w4a16_heur[grid(cfg)](*args, **meta, **cfg, num_warps=warps)
    return out


def w8a16_gemv(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    *,
    split_k: Optional[int] = None,
    block_n: int = 64,
    block_k: Optional[int] = None,
    num_warps: int = 4,
    block_m: Optional[int] = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Small-M x [M, K] @ (fp8 e4m3 W [N, K] * scale [N])^T -> [M, N] in x.dtype.
    block_m None: the tensor-core path (x padded to 16 rows) at every M, also M = 1, where it
    measured faster than the FMA path (block_m=1) on the H200: 3.02 vs 3.48 ms for all the decode
    step's linears (bench_quant, BENCHMARKS.md). pdl: launch with programmatic dependent launch
    (off by default, see the kernel; for A/B timing)."""
    N, K = w_fp8.shape
    x = _check_x(x, K)
    M = x.shape[0]
    if block_m is None:
        block_m = max(16, _gemv_block_m(M))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    args = (x, w_fp8, scale, out, ws, cnt, M, N, K, x.stride(0), w_fp8.stride(0), out.stride(0))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, GROUP_M=1, DOT_FP32=_INTERPRET and block_m > 1)
    grid = (tiles, split)
    if pdl and pdl_supported(x.device):
        meta.update(PDL=True, launch_pdl=True)
    if block_k is None:
        (_w8a16_gemv_fma_tuned if block_m == 1 else _w8a16_gemv_dot_tuned)[grid](*args, **meta)
    else:
        _w8a16_kernel[grid](*args, **meta, BLOCK_K=block_k, num_warps=num_warps)
    return out


# ---------------------------------------------------------------- w8a8 decode (fp8 tensor cores)
#
# The w8a16 GEMV converts every e4m3 weight to bf16 in registers before its dot (two converts per
# weight, and the tile goes through shared memory on its way to the tensor cores): it reads the
# weights at ~70% of the copy bandwidth. Here x is quantized instead (e4m3, one scale per token
# and ACT_BLOCK channels, computed in the kernel from the tile it already holds), and the weights
# go to an fp8 x fp8 dot untouched. The weight tile is the dot's left operand (BLOCK_N rows: the
# 64-row minimum of Hopper's wgmma), x^T the right one (16 columns, zero-padded rows).

ACT_BLOCK = 128  # channels per activation scale (= BLOCK_K); a K multiple of it takes this path


@triton.jit
def _w8a8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
    INTERPRET: tl.constexpr = False,  # round on the bits and dot in fp32 (the interpreter's fp8 is unreliable)
):
    pid_m, pid_n, tile = _tile_ids(M, N, BLOCK_M, BLOCK_N, 1)
    k_begin, k_end = _split_range(K, SPLIT_K, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # weight [N, K], K contiguous
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T tile
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        wt = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)  # K % BLOCK_K == 0
        xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        sx = tl.maximum(tl.max(tl.abs(xt), axis=1), 1e-12) * (1.0 / FP8_MAX_C)  # [BM]
        # one IEEE reciprocal per row, then products: an IEEE division per element (~40
        # instructions) made the first version ALU-bound, 2x slower than w8a16 on the H200
        inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), sx)
        v = tl.minimum(tl.maximum(xt * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
        if INTERPRET:
            part = tl.dot(wt.to(tl.float32), tl.trans(round_to_e4m3(v)), input_precision="ieee")
        else:
            part = tl.dot(wt, tl.trans(v.to(tl.float8e4nv)))
        acc += part * sx[None, :]  # a fresh dot per block: its scale, and fp32 promotion every 128
    acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    _store_output(tl.trans(acc), offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K)


_W8A8_GEMV = [
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=6),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=4),
]


def _w8a8_tiles(M: int, N: int, block_n: int) -> int:
    return triton.cdiv(M, 16) * triton.cdiv(N, block_n)


def _w8a8_launch(x, w_fp8, scale, out, block_n, split, num_warps, num_stages):
    M, K = x.shape
    N = w_fp8.shape[0]
    tiles = _w8a8_tiles(M, N, block_n)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    _w8a8_gemv_kernel[(tiles, split)](
        x, w_fp8, scale, out, ws, cnt, M, N, K, x.stride(0), w_fp8.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=ACT_BLOCK, SPLIT_K=split, FP8_MAX_C=FP8_MAX, INTERPRET=_INTERPRET,
        num_warps=num_warps, num_stages=num_stages)


# (M bucket, N, K, device) -> (BLOCK_N, split, warps, stages): the fastest config, timed once
_W8A8_TABLE: dict[tuple, tuple] = {}


def _w8a8_key(M: int, N: int, K: int, device) -> tuple:
    return (triton.cdiv(M, 16), N, K, _device_key(device))


def w8a8_gemv(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor, *, config: Optional[tuple] = None) -> torch.Tensor:
    """Decode-sized x [M <= GEMV_MAX_M, K] @ (e4m3 W [N, K] * scale [N])^T -> [M, N] in x.dtype,
    with x quantized to e4m3 per token and ACT_BLOCK channels on the fly (fp8 tensor cores).
    K must be a multiple of ACT_BLOCK. config: (BLOCK_N, split, warps, stages); default: the
    fastest of _W8A8_GEMV (timed at the first call of each shape; outside CUDA-graph capture)."""
    N, K = w_fp8.shape
    x = _check_x(x, K)
    M = x.shape[0]
    if K % ACT_BLOCK:
        raise ValueError(f"w8a8_gemv needs K % {ACT_BLOCK} == 0, got K = {K}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if config is None:
        key = _w8a8_key(M, N, K, x.device)
        config = _W8A8_TABLE.get(key)
        if config is None:
            config = _W8A8_TABLE[key] = _tune_w8a8(x, w_fp8, scale, out)
    _w8a8_launch(x, w_fp8, scale, out, *config)
    return out


def _w8a8_candidates(M: int, N: int, K: int, device) -> list[tuple]:
    """(BLOCK_N, split, warps, stages): each config at its default split and twice / half that."""
    cands = []
    for c in _configs(_W8A8_GEMV):
        bn = c.kwargs["BLOCK_N"]
        base = _default_split_k(_w8a8_tiles(M, N, bn), K, device)
        for split in sorted({base, max(1, base // 2), min(32, base * 2)}):
            if K // split >= ACT_BLOCK:
                cands.append((bn, split, c.num_warps, c.num_stages))
    return cands


def _tune_w8a8(x, w_fp8, scale, out) -> tuple:
    """Fallback for shapes calibrate_w8a8 did not see: the fastest candidate by
    triton.testing.do_bench on these weights (the interpreter takes the first)."""
    M, K = x.shape
    cands = _w8a8_candidates(M, w_fp8.shape[0], K, x.device)
    if _INTERPRET or x.device.type != "cuda" or len(cands) == 1:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("w8a8_gemv: run each shape once before CUDA-graph capture (it times its configs)")
    times = [triton.testing.do_bench(lambda c=c: _w8a8_launch(x, w_fp8, scale, out, *c), warmup=5, rep=20)
             for c in cands]
    return cands[min(range(len(cands)), key=times.__getitem__)]


def calibrate_w8a8(weights, device, m_values=(1, 32), verbose: bool = False) -> dict:
    """Start-up (GPU only): time w8a8_gemv's candidates per (16-row bucket of m, shape) in CUDA
    graphs of back-to-back calls over L2-busting copies of the fp8 weights, as calibrate_w4 does,
    and keep the fastest. Returns {(m, N, K): (config, us)}."""
    from salaserve.kernels.timing import graph_time_us, l2_busting_count

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    result = {}
    for w in weights:
        if w.format != "fp8" or w.in_features % ACT_BLOCK:
            continue
        N, K = w.out_features, w.in_features
        n_copies = l2_busting_count(w.weight.nbytes)
        copies = [torch.randn(N, K, device=device).to(torch.float8_e4m3fn) for _ in range(n_copies)]
        for m in m_values:
            key = _w8a8_key(m, N, K, device)
            if key in _W8A8_TABLE:
                continue
            x = torch.randn(m, K, device=device).to(torch.bfloat16)
            best = None
            for cfg in _w8a8_candidates(m, N, K, device):
                t = graph_time_us(lambda i: w8a8_gemv(x, copies[i % n_copies], w.scale, config=cfg),
                                  calls=max(8, n_copies))
                if verbose:
                    print(f"  w8a8 M={m} N={N} K={K} {cfg}: {t:.1f} us")
                if best is None or t < best[1]:
                    best = (cfg, t)
            _W8A8_TABLE[key] = best[0]
            result[(m, N, K)] = best
        del copies
    return result


# (M bucket, N, K, device) -> the gemv.FP8_FMA_CONFIGS config that beat w8a16_gemv at start-up,
# or None where w8a16 stayed faster; filled by calibrate_fp8_gemv (SALASERVE_FP8_DECODE=gemv)
_FP8_GEMV_TABLE: dict[tuple, object] = {}


def _fp8_gemv_key(M: int, w: QuantizedLinearWeights, device) -> tuple:
    from salaserve.kernels import gemv as G

    return (G._bucket(M), w.out_features, w.in_features, _device_key(device))


def fp8_gemv_choice(M: int, w: QuantizedLinearWeights, device):
    """The calibrated gemv_fp8 config for this decode size and shape, or None (w8a16)."""
    from salaserve.kernels import gemv as G

    if not 1 <= M <= G.FMA_MAX_M:
        return None
    return _FP8_GEMV_TABLE.get(_fp8_gemv_key(M, w, device))


def calibrate_fp8_gemv(weights, device, m_values=(1, 2, 4, 8), verbose: bool = False,
                       silu_shapes=frozenset()) -> dict:
    """Per (M bucket, fp8 shape): time w8a16_gemv and every gemv.FP8_FMA_CONFIGS config (CUDA graphs
    of back-to-back calls over L2-busting random weights) and record the faster for quant_linear.
    silu_shapes: (N, K) of [gate | up] weights, which one-row steps call through the silu_mul
    junction (TritonBackend.residual_norm_linear): at M = 1 those are timed as the junction runs
    them, w8a16 or an odd-BLOCK_N GEMV followed by the silu_mul kernel against the GEMV with its
    silu_mul epilogue. Returns {(M, N, K): (config or None, its us, w8a16 us)}. GPU only."""
    from salaserve.kernels import gemv as G
    from salaserve.kernels.fused import silu_mul
    from salaserve.kernels.timing import graph_time_us, l2_busting_count

    device = torch.device(device)
    result = {}
    # (the GEMV reads the codes as int32 words: K a multiple of 4; other shapes stay on w8a16)
    for w, todo in _to_calibrate(weights, device, m_values, lambda w: w.format == "fp8" and w.in_features % 4 == 0,
                                 _fp8_gemv_key, _FP8_GEMV_TABLE):
        N, K = w.out_features, w.in_features
        n = l2_busting_count(w.weight.nbytes)
        copies = [torch.randn(N, K, device=device).to(torch.float8_e4m3fn) for _ in range(n)]
        for m in todo:
            x = torch.randn(G._bucket(m), K, device=device).to(torch.bfloat16)
            junction = m == 1 and (N, K) in silu_shapes
            after = silu_mul if junction else (lambda y: y)
            t_ref = graph_time_us(lambda i: after(w8a16_gemv(x, copies[i % n], w.scale)), calls=max(8, n))
            best = (None, t_ref)
            for cfg in G.FP8_FMA_CONFIGS[G._bucket(m)] + (G.FP8_DOT_CONFIGS if FP8_DOT else ()):
                cfg = dataclasses.replace(cfg, split_k=G._auto_split(N, K, cfg, device))
                if junction and cfg.block_n % 2 == 0:
                    t = graph_time_us(lambda i: G.gemv_fp8(x, copies[i % n], w.scale, cfg, silu_out=True),
                                      calls=max(8, n))
                else:
                    t = graph_time_us(lambda i: after(G.gemv_fp8(x, copies[i % n], w.scale, cfg)), calls=max(8, n))
                if verbose:
                    print(f"  fp8 gemv M={m} N={N} K={K} {cfg}{' (silu_mul junction)' if junction else ''}: "
                          f"{t:.1f} us (w8a16 {t_ref:.1f})")
                if t < best[1]:
                    best = (cfg, t)
            _FP8_GEMV_TABLE[_fp8_gemv_key(m, w, device)] = best[0]
            result[(m, N, K)] = (best[0], best[1], t_ref)
        del copies
    return result


def w8a8_block_ref(x: torch.Tensor, w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin of w8a8_gemv: x quantized to e4m3 per (token, ACT_BLOCK channels), then
    (q * sx) @ (W * scale)^T in fp32, returned in x.dtype."""
    M, K = x.shape
    xf = x.float().view(M, K // ACT_BLOCK, ACT_BLOCK)
    sx = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)
    q = (xf * (1.0 / sx)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return ((q * sx).view(M, K) @ w_fp8.float().t() * scale.float()).to(x.dtype)


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
        _quantize_rows_fp8_kernel[(triton.cdiv(M, consts["ROWS"]),)](
            x, q, sx, M, K, x.stride(0), FP8_MAX_C=FP8_MAX, **consts, SILU=silu, DT=tl_dtype(x.dtype),
            INTERPRET=_INTERPRET, num_warps=num_warps or rowquant_warps(K, silu))
    return q, sx


def rowquant_constexprs(K: int) -> dict:
    """ROWS, BLOCK, ONE_PASS of _quantize_rows_fp8_kernel for rows of K channels."""
    block = triton.next_power_of_2(K)
    if block <= ROWQUANT_ONE_PASS_MAX:
        # 8192 values per program: 4096-wide rows 25.8 us per 8K-token chunk at 2 rows, 27.7 at
        # 4 (floor 23.9; scripts/rowquant_ab.py, BENCHMARKS run 47)
        return dict(ROWS=max(1, min(8192 // block, 16)), BLOCK=block, ONE_PASS=True)
    return dict(ROWS=1, BLOCK=4096, ONE_PASS=False)


def rowquant_warps(K: int, silu: bool) -> int:
    """silu_mul fused in (two loads and an exp per value): 16 warps, 180 vs 194 us at 16384 wide
    (run 47); plain rows: 8."""
    return 16 if silu and triton.next_power_of_2(K) >= ROWQUANT_ONE_PASS_MAX else 8


def fp8_quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of quantize_rows_fp8."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)  # [M, 1], as CUDA's / 448
    # times the rounded reciprocal, as the kernel (a division per element costs it ~10 instructions)
    return (xf * (1.0 / sx)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), sx


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


# ---------------------------------------------------------------- dispatch


def fp8_scaled_mm_takes(M: int, w: QuantizedLinearWeights) -> bool:
    """Whether quant_linear sends M rows through w8a8 on cuBLAS (prefill sizes; cuBLAS fp8
    needs K and N multiples of 16) rather than a decode kernel."""
    return w.format == "fp8" and M > GEMV_MAX_M and w.in_features % 16 == 0 and w.out_features % 16 == 0


def quant_linear(x: torch.Tensor, w: QuantizedLinearWeights, backend: str = "auto") -> torch.Tensor:
    """y = x @ W^T for x [..., K]. backend "auto": Triton/cuBLAS on CUDA, torch reference
    elsewhere; "triton" forces the kernels (CPU works under TRITON_INTERPRET=1); "torch" the reference."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}")
    K, N = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    use_kernels = backend == "triton" or (backend == "auto" and x.is_cuda)
    if M == 0:
        y = x2.new_empty(0, N)
    elif w.format == "bf16":
        y = F.linear(x2, w.weight.to(x2.dtype))
    elif not use_kernels:
        y = linear_ref(x2, w)
    elif w.format == "fp8":
        if M <= GEMV_MAX_M and FP8_DECODE == "w8a8" and K % ACT_BLOCK == 0:
            y = w8a8_gemv(x2, w.weight, w.scale)
        elif FP8_DECODE == "gemv" and (cfg := fp8_gemv_choice(M, w, x2.device)) is not None:
            from salaserve.kernels import gemv as G

            y = G.gemv_fp8(x2, w.weight, w.scale, cfg)
        elif not fp8_scaled_mm_takes(M, w):
            y = w8a16_gemv(x2, w.weight, w.scale)
        elif x2.is_cuda:
            y = fp8_scaled_mm(x2, w.weight, w.scale)
        else:  # interpreter: no cuBLAS fp8
            y = fp8_matmul_ref(x2, w.weight, w.scale)
    elif M <= W4_FMA_MAX_M and w.g_idx_trivial and w.group_size % W4_FMA_GROUP_MULTIPLE == 0:
        y = w4a16_gemv_fma(x2, w)  # decode: the 1 + q/16 FMA kernel
    elif M <= GEMV_MAX_M:
        y = w4a16_gemv(x2, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, w.perm, act_order=not w.g_idx_trivial)
    elif w.g_idx_trivial and w.group_size % 8 == 0:
        y = w4a16_dense_mm(x2, w)  # prefill: dequantize into scratch + cuBLAS
    else:
        y = w4a16_gemm(x2, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, w.perm, act_order=not w.g_idx_trivial)
    return y.reshape(*lead, N)
