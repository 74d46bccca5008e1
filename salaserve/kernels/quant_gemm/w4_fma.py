"""The int4 decode GEMV on FMAs (`w4a16_gemv_fma`, M <= W4_FMA_MAX_M): at 1-2 rows where the dp2a
kernel cannot run (act-order weights, x not bf16), at 3-4 rows where the calibration (w4_decode.py)
picks it, and quant_linear's uncalibrated route."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import bf16_pair, pdl_launch_kwargs
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.kernels.quant_gemm._common import _check_x, _default_split_k, _store_output, _workspace

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
# prefetched tile's registers alternate instead of being copied. sm_90 loop SASS at M = 1:
# (64, 16, 4) 3.70 instructions per nibble (4.97 before the shifts and x pairs above), (128, 16, 4)
# 3.28. GPTQ layout as stored (qweight [K/8, N]), one group per K tile (BLOCK_R * 8
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
# (no spills). At M = 1 64-column tiles won at every shape but lm_head. 2 warps on 64
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
    config = config or W4_FMA_CONFIGS[block_m][0]  # the calibrated picks come through w4_decode.w4a16_decode
    block_n, block_r, warps, *more = config
    prefetch = more[0] if more else 1
    if w.group_size % (block_r * 8) or K % 8:
        raise ValueError(f"group size {w.group_size} must be a multiple of the K tile {block_r * 8}")
    tiles = triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    x_pairs = x.dtype == torch.bfloat16 and w.perm is None and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0
    launch_kernel(_w4_gemv_fma_kernel, (tiles, split),
        x, w.qweight, w.qzeros, w.scales, w.perm if w.perm is not None else w.qzeros, out, ws, cnt,
        M, N, K, x.stride(0), out.stride(0), w.qzeros.stride(0), W4_MAGIC_LO, W4_MAGIC_HI,
        GROUP_SIZE=w.group_size, X_PERM=w.perm is not None, X_PAIRS=x_pairs, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=block_r, SPLIT_K=split, **w4_fma_layout(block_n, block_r, warps),
        EVEN=N % block_n == 0 and K % (8 * block_r) == 0, PREFETCH=prefetch, num_warps=warps,
        **pdl_launch_kwargs(x.device))
    return out
