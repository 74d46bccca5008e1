"""The int4 decode GEMV on mma.sync tensor cores, behind Triton's cp.async pipeline
(`w4a16_gemv_mma`, 1 <= M <= 8), on a repacked copy of the weights (`repack_w4_for_mma`).

Opt-in (SALASERVE_W4_MMA=1 attaches the copy and adds the configs to the w4 calibration): correct
on the H200, but measured slower than the FMA kernel at one row and than the wgmma kernel at 8 rows
at every shape (BENCHMARKS runs 86-88; gate_up at one row 48.3 vs 29.5 us). ncu (run 88): the
pipeline's stages hold each lane's own copy of x and of the group words, 50-119 KB of shared
memory per CTA, so 4-8 warps per SM issue; docs/perf-notes.md has the attempts and what is open.

Why it was built: the FMA kernel (w4_fma.py) executes 3.3-3.7 instructions per nibble and reads
the weights at ~40-55% of the floor at one row (BENCHMARKS runs 50, 84, 86); its loads come from a
register prefetch one or two tiles deep. The fp8 GEMV's stream form showed that Triton's software
pipeliner (cp.async into shared memory, several steps ahead) reaches 90-98% of the floor on the
large shapes, once the loop is cheap enough to keep up. Here the loop is ~1.5-2.5 instructions per
nibble:

- a lop3 turns two nibbles into a bf16x2 of (128 + q) (a shift first for every second pair): 7
  instructions per 8-nibble word;
- the pairs are the A fragment of an m16n8k16 bf16 mma.sync (fp32 accumulation); x, as bf16 pairs
  straight from memory, is the B fragment: one column per token, so up to 8 tokens cost the same;
- the constant and the zero point come off once per 128-channel group and row: the group's
  partial is sum (128 + q) x, and sum (128 + z) x = (128 + z) X with X = sum x over the group,
  which one more mma per chunk (A = ones) gives for all of a warp's rows at once:
      acc += s * (partial - (128 + z) X).
  The cancellation costs ~7 bits of fp32's 24 (terms ~128x the result): far below bf16's 8.

Its own layout (`repack_w4_for_mma`, attached at start-up as w.mma), so that every step is a few
wide copies (Triton commits each load of the loop as its own cp.async group; the wgmma kernel's
layout, which gives each lane every fourth x word, took 22 per step and ran at half the FMA
kernel's speed, run 86):
- qweight [N, K/8] int32, a row's words in channel order (word w: channels 8w .. 8w + 7), each
  word's nibble position 4p + 16h holding channel 8w + 2p + h. In a 128-channel tile lane t of a
  quad reads the row's words 4t .. 4t + 3 (one 16-byte copy per row), and pair p of word c (its
  positions 4p and 16 + 4p) is the x pair word 16t + 4c + p: chunk 2c + s takes pairs 2s (logical
  k 2t, 2t + 1) and 2s + 1 (2t + 8, 2t + 9), and lane t reads x's words 16t .. 16t + 15 of the
  tile (four 16-byte copies).
- gz [G, N/16, 8, 4] fp32: per group, 16-row tile and g, (128 + z, s) of rows g and g + 8: one
  16-byte copy per lane and row tile per step; the scales exact (fp16 -> fp32).

Tensors are one element per thread ([RT, 32 * warps]: row tile r of the thread's warp) so that the
inline asm sees exactly the mma's registers; under the Triton interpreter (no inline asm) the same
fragments go through a tensor emulation.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import bf16_pair, pdl_launch_kwargs
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.quant_gemm._common import (_INTERPRET, _check_decode_x, _default_split_k, _split_k_fragments,
                                                  _workspace)
from salaserve.kernels.quant_gemm.fp8_mma import _emu_cols, _emu_contract, _four, _fragment_masks, _mma_lanes
from salaserve.quant.formats import GPTQ_V2, QuantizedLinearWeights, _to_int32, unpack_int4, unpack_zeros

W4_MMA_MAX_M = 8  # the mma's N: one column per token
TILE_WORDS = 16  # words (128 channels) per loop step


# ---------------------------------------------------------------- the repacked layout (host)


@dataclasses.dataclass(frozen=True)
class W4MmaWeights:
    """What w4a16_gemv_mma reads (see the module's docstring): qweight [N, K/8] int32 and gz
    [G, N/16, 8, 4] fp32."""

    qweight: torch.Tensor
    gz: torch.Tensor


def repack_w4_for_mma(w: QuantizedLinearWeights) -> W4MmaWeights:
    """GPTQ-layout int4 weights (N a multiple of 16) -> the mma kernel's copy of them."""
    if w.format != "w4a16":
        raise ValueError(f"repack_w4_for_mma takes w4a16 weights, got {w.format}")
    K8, N = w.qweight.shape
    if N % 16:
        raise ValueError(f"repack_w4_for_mma needs N a multiple of 16, got {N}")
    dev = w.qweight.device
    q = unpack_int4(w.qweight).view(K8, 4, 2, N)  # [word, p, h, N]: channel 8 word + 2p + h
    shift = 4 * torch.arange(4, device=dev).view(4, 1) + 16 * torch.arange(2, device=dev).view(1, 2)  # [p, h]
    words = (q.to(torch.int64) << shift[None, :, :, None]).sum(dim=(1, 2))  # [K/8, N]
    zeros = unpack_zeros(w.qzeros, N, GPTQ_V2).float() + 128.0  # [G, N]
    G = zeros.shape[0]
    scales = w.scales.float()
    gz = torch.stack([zeros.view(G, N // 16, 2, 8), scales.view(G, N // 16, 2, 8)], dim=-1)  # [G, tile, half, g, 2]
    gz = gz.permute(0, 1, 3, 2, 4).reshape(G, N // 16, 8, 4)  # (128 + z_lo, s_lo, 128 + z_hi, s_hi)
    return W4MmaWeights(_to_int32(words).t().contiguous(), gz.contiguous())


@triton.jit
def _emu_pairs(words):
    """Interpreter: the (128 + q) values of nibble pair 0 of words (positions 0 and 16) as fp32."""
    return (words & 0xF).to(tl.float32) + 128.0, ((words >> 16) & 0xF).to(tl.float32) + 128.0


@triton.jit
def _emu_rows(a_e0, a_e1, b0, b1, RT: tl.constexpr, NW: tl.constexpr):
    """Interpreter: D[g, n] = sum over t and the lane's 4 k of A(lane g, t) * B(lane n, t), for one
    8-row half (a_e0, a_e1: the words whose pair 0 gives logical k (2t, 2t + 1), (2t + 8, 2t + 9))."""
    q0, q1 = _emu_pairs(a_e0)
    q2, q3 = _emu_pairs(a_e1)
    x0, x1 = bf16_pair(b0)
    x2, x3 = bf16_pair(b1)
    return _emu_contract(q0, q1, q2, q3, x0, x1, x2, x3, RT, NW)


@triton.jit
def _mma_w4(c0, c1, c2, c3, wa, wb, b0, b1, RT: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    """One m16n8k16 step: C += A B with A = (128 + q) of words wa (row g) and wb (row g + 8), nibble
    pair 0 as logical k (2t, 2t + 1) and pair 1 as (2t + 8, 2t + 9); B = x's bf16 pair words b0, b1."""
    if ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a0, a1, a2, a3, u0, u1;
            lop3.b32 a0, $4, 0x000f000f, 0x43004300, 0xea;
            lop3.b32 a1, $5, 0x000f000f, 0x43004300, 0xea;
            shr.u32 u0, $4, 4;
            shr.u32 u1, $5, 4;
            lop3.b32 a2, u0, 0x000f000f, 0x43004300, 0xea;
            lop3.b32 a3, u1, 0x000f000f, 0x43004300, 0xea;
            mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, {$8, $9, $10, $11};
            }""",
            constraints="=f,=f,=f,=f,r,r,r,r,f,f,f,f",
            args=[wa, wb, tl.broadcast_to(b0, (RT, NW * 32)), tl.broadcast_to(b1, (RT, NW * 32)), c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo0, lo1 = _emu_cols(_emu_rows(wa, wa >> 4, b0, b1, RT, NW), RT, NW)
        hi0, hi1 = _emu_cols(_emu_rows(wb, wb >> 4, b0, b1, RT, NW), RT, NW)
        d0, d1, d2, d3 = c0 + lo0, c1 + lo1, c2 + hi0, c3 + hi1
    return d0, d1, d2, d3


@triton.jit
def _mma_ones(c0, c1, b0, b1, NW: tl.constexpr, ASM: tl.constexpr):
    """C += ones(16 x 16) B: every row of D holds each token's sum of the chunk's 16 x values. Returns
    lane (g, t)'s (token 2t, token 2t + 1) sums, [1, 32 * NW] each (rows g and g + 8 are equal)."""
    if ASM:
        d0, d1 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 one;
            .reg .f32 e2, e3;
            mov.b32 one, 0x3f803f80;
            mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, e2, e3}, {one, one, one, one}, {$2, $3}, {$4, $5, $4, $5};
            }""",
            constraints="=f,=f,r,r,f,f", args=[b0, b1, c0, c1], dtype=(tl.float32, tl.float32), is_pure=True,
            pack=1)
    else:
        x0, x1 = bf16_pair(b0)
        x2, x3 = bf16_pair(b1)
        per_lane = tl.reshape(x0 + x1 + x2 + x3, [1, NW, 8, 4])  # token n = lane's g, summed over t below
        per_token = tl.sum(per_lane, axis=3)  # [1, NW, 8 tokens]
        d = tl.broadcast_to(tl.reshape(per_token, [1, NW, 1, 8]), [1, NW, 8, 8])  # D[g, n]
        e0, e1 = _emu_cols(d, 1, NW)
        d0, d1 = c0 + e0, c1 + e1
    return d0, d1


@triton.jit
def _w4_mma_gemv_kernel(
    x_ptr, qw_ptr, gz_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K_WORDS, SPLIT_WORDS, stride_xw, stride_om,
    GROUP_WORDS: tl.constexpr,  # the quantization group in words (8 channels each): a multiple of 16
    RT: tl.constexpr,  # 16-row tiles per warp (x's loads and sums are shared by all of them)
    NUM_WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr,  # N a multiple of the program's rows: no row masks
    STAGES: tl.constexpr,  # tiles in Triton's cp.async pipeline
    ASM: tl.constexpr,  # GPU: inline PTX; False: the interpreter's emulation
    PDL: tl.constexpr = False,
):
    T: tl.constexpr = 32 * NUM_WARPS
    BLOCK_N: tl.constexpr = 16 * RT * NUM_WARPS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g, t, tile = _mma_lanes(RT, NUM_WARPS)  # tile [RT, T]: the thread's row tiles
    row_lo = pid_n * BLOCK_N + tile * 16 + g[None, :]
    row_hi = row_lo + 8
    ok_lo = row_lo < N
    ok_hi = row_hi < N
    kw_begin = pid_k * SPLIT_WORDS
    kw_end = tl.minimum(kw_begin + SPLIT_WORDS, K_WORDS)
    j4 = tl.arange(0, 4)[None, None, :]
    w_lo = qw_ptr + row_lo[:, :, None].to(tl.int64) * K_WORDS + (4 * t)[None, :, None] + j4  # [RT, T, 4]
    w_hi = qw_ptr + row_hi[:, :, None].to(tl.int64) * K_WORDS + (4 * t)[None, :, None] + j4
    # token g's x pair words 16t .. 16t + 15 of a tile. Tokens past M read nothing (zeros; their
    # columns are dropped): run 87 had them read token 0, and at one row every lane of a quad
    # column asked for the same bytes, twice as slow as at eight rows
    x_row = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + tl.where(g < M, g, 0)[None, :, None].to(tl.int64) * stride_xw
    x_lane = x_row + (16 * t)[None, :, None] + j4  # [1, T, 4]
    x_ok = (g < M)[None, :, None] & (j4 >= 0)
    # the lane's (128 + z, s) of rows g, g + 8 in a group: [RT, T, 4]
    gz_lane = gz_ptr + ((pid_n * BLOCK_N) // 16 + tile)[:, :, None] * 32 + (4 * g)[None, :, None] + j4
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc0 = tl.zeros((RT, T), dtype=tl.float32)
    acc1 = tl.zeros((RT, T), dtype=tl.float32)
    acc2 = tl.zeros((RT, T), dtype=tl.float32)
    acc3 = tl.zeros((RT, T), dtype=tl.float32)
    for kw in tl.range(kw_begin, kw_end, 16, num_stages=STAGES):
        if EVEN_N:
            wa = tl.load(w_lo + kw)
            wb = tl.load(w_hi + kw)
        else:
            wa = tl.load(w_lo + kw, mask=ok_lo[:, :, None], other=0)
            wb = tl.load(w_hi + kw, mask=ok_hi[:, :, None], other=0)
        xt = x_lane + 4 * kw  # the tile's first x pair words (8 channels per W word)
        xa = tl.load(xt, mask=x_ok, other=0)  # words 16t + 4c + (0..3) for c = 0..3: W word c's four pairs
        xb = tl.load(xt + 4, mask=x_ok, other=0)
        xc = tl.load(xt + 8, mask=x_ok, other=0)
        xd = tl.load(xt + 12, mask=x_ok, other=0)
        gz = gz_lane + (kw // GROUP_WORDS) * 2 * N  # gz [G, N/16, 8, 4]: 2N floats per group
        if EVEN_N:
            zs = tl.load(gz)
        else:
            zs = tl.load(gz, mask=ok_lo[:, :, None], other=0.0)
        a0, a1, a2, a3 = _four(wa, RT, T)  # word c of row g: chunks 2c (pairs 0, 1) and 2c + 1 (pairs 2, 3)
        b0, b1, b2, b3 = _four(wb, RT, T)  # row g + 8
        x0, x1, x2, x3 = _four(xa, 1, T)
        x4, x5, x6, x7 = _four(xb, 1, T)
        x8, x9, x10, x11 = _four(xc, 1, T)
        x12, x13, x14, x15 = _four(xd, 1, T)
        z_lo, sc_lo, z_hi, sc_hi = _four(zs, RT, T)
        p0 = tl.zeros((RT, T), dtype=tl.float32)
        p1 = tl.zeros((RT, T), dtype=tl.float32)
        p2 = tl.zeros((RT, T), dtype=tl.float32)
        p3 = tl.zeros((RT, T), dtype=tl.float32)
        s0 = tl.zeros((1, T), dtype=tl.float32)
        s1 = tl.zeros((1, T), dtype=tl.float32)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a0, b0, x0, x1, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a0 >> 8, b0 >> 8, x2, x3, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a1, b1, x4, x5, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a1 >> 8, b1 >> 8, x6, x7, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a2, b2, x8, x9, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a2 >> 8, b2 >> 8, x10, x11, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a3, b3, x12, x13, RT, NUM_WARPS, ASM)
        p0, p1, p2, p3 = _mma_w4(p0, p1, p2, p3, a3 >> 8, b3 >> 8, x14, x15, RT, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x0, x1, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x2, x3, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x4, x5, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x6, x7, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x8, x9, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x10, x11, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x12, x13, NUM_WARPS, ASM)
        s0, s1 = _mma_ones(s0, s1, x14, x15, NUM_WARPS, ASM)
        acc0 += sc_lo * (p0 - z_lo * s0)
        acc1 += sc_lo * (p1 - z_lo * s1)
        acc2 += sc_hi * (p2 - z_hi * s0)
        acc3 += sc_hi * (p3 - z_hi * s1)

    # acc0 (row_lo, token 2t), acc1 (row_lo, 2t + 1), acc2 (row_hi, 2t), acc3 (row_hi, 2t + 1)
    tok0, tok1, m0, m1, n0, n1 = _fragment_masks(t, ok_lo, ok_hi, M, RT, NUM_WARPS)
    if SPLIT_K > 1:
        last, acc0, acc1, acc2, acc3 = _split_k_fragments(acc0, acc1, acc2, acc3, row_lo, row_hi, tok0, tok1, m0, m1,
                                                          n0, n1, ws_ptr, cnt_ptr, pid_n, M, N, SPLIT_K)
        if last:
            _store(acc0, acc1, acc2, acc3, row_lo, row_hi, tok0, tok1, m0, m1, n0, n1, out_ptr, stride_om)
    else:
        _store(acc0, acc1, acc2, acc3, row_lo, row_hi, tok0, tok1, m0, m1, n0, n1, out_ptr, stride_om)


@triton.jit
def _store(c0, c1, c2, c3, row_lo, row_hi, tok0, tok1, m0, m1, n0, n1, out_ptr, stride_om):
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + tok0.to(tl.int64) * stride_om + row_lo, c0.to(ty), mask=m0)
    tl.store(out_ptr + tok1.to(tl.int64) * stride_om + row_lo, c1.to(ty), mask=m1)
    tl.store(out_ptr + tok0.to(tl.int64) * stride_om + row_hi, c2.to(ty), mask=n0)
    tl.store(out_ptr + tok1.to(tl.int64) * stride_om + row_hi, c3.to(ty), mask=n1)


# (row tiles per warp, warps, pipeline stages): BLOCK_N = 16 * RT * warps rows per program. Each
# compiles for sm_90 without spills (2 row tiles at 4 warps or fewer used 32 bytes of stack) and
# was checked on the H200 against dequantize-then-matmul at 1 and 8 rows (run 88). SASS loop
# instructions per nibble: 2.48 at one row tile, 1.94 at two, 1.55-1.58 at four, 1.42 at eight.
W4_MMA_CONFIGS = ((1, 4, 4), (2, 8, 4), (4, 4, 3), (4, 2, 4), (8, 4, 3))
W4_MMA_SPLITS = (1, 2, 4, 8, 16)  # split-K candidates (each split at least two 128-channel tiles)


def w4_mma_usable(w: QuantizedLinearWeights) -> bool:
    """Whether w4a16_gemv_mma takes these weights: its repacked copy's layout (N in 16-row tiles, K
    and the group size in 128-channel tiles, trivial g_idx, no channel permutation)."""
    return (w.format == "w4a16" and w.g_idx_trivial and w.perm is None and w.out_features % 16 == 0
            and w.in_features % (8 * TILE_WORDS) == 0 and w.group_size % (8 * TILE_WORDS) == 0
            and w.qweight.numel() < 2**31)


def w4a16_gemv_mma(x: torch.Tensor, w: QuantizedLinearWeights, packed: W4MmaWeights, *,
                   config: tuple = W4_MMA_CONFIGS[0], split_k: Optional[int] = None) -> torch.Tensor:
    """Decode-sized x [M <= 8, K] (bf16) @ int4 weights -> [M, N] bf16, reading packed
    (repack_w4_for_mma(w)); w gives the shape and checks. config: (row tiles per warp, warps,
    stages)."""
    K, N = w.in_features, w.out_features
    x = _check_decode_x(x, K, W4_MMA_MAX_M, "w4a16_gemv_mma")
    M = x.shape[0]
    if not w4_mma_usable(w):
        raise ValueError(f"w4a16_gemv_mma: weights [{N}, {K}] group {w.group_size} (perm {w.perm is not None}) "
                         f"are not in whole 128-channel tiles")
    if packed.qweight.shape != (N, K // 8) or packed.gz.shape != (w.scales.shape[0], N // 16, 8, 4):
        raise ValueError("packed must be repack_w4_for_mma(w)")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # read in 16-byte vectors
    rt, warps, stages = config
    block_n = 16 * rt * warps
    tiles = triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    k_words = K // 8
    split_words = triton.cdiv(k_words, split * TILE_WORDS) * TILE_WORDS
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    launch_kernel(_w4_mma_gemv_kernel, (tiles, split),
        x, packed.qweight, packed.gz, out, ws, cnt, M, N, k_words, split_words, x.stride(0) // 2, out.stride(0),
        GROUP_WORDS=w.group_size // 8, RT=rt, NUM_WARPS=warps, SPLIT_K=split, EVEN_N=N % block_n == 0,
        STAGES=stages, ASM=not _INTERPRET, num_warps=warps,
        **pdl_launch_kwargs(x.device))
    return out
