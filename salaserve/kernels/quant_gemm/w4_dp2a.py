"""The int4 decode GEMV on integer dot products (`w4a16_gemv_dp2a`, M <= W4_DP2A_MAX_M): x is
rounded to int16, and each packed word of 8 nibbles costs a shift, two lop3 and four dp2a (a
16-bit x 8-bit two-way dot product into an int32) against the FMA kernel's ~28 instructions
(w4_fma.py, which ncu shows issue-bound at one row: 0.68 issued per scheduler and cycle). With
x's conversion the one-row loop runs 2.5-2.6 instructions per nibble on sm_90 (FMA: 3.3-3.7),
12-25% faster per shape.

Exactness. x is rounded per thread and K tile: the thread's 8 * SLABS channels of the tile share
one scale, v = round(x * 32767 / max|x|), so each x is off by at most max|x| / 65534 (2^-16 of
the largest, against bf16's own 2^-9 relative rounding of every weight in dequantize-then-matmul).
The integer sum over the thread's rows, sum (q - z) v, is exact (|.| < 2^25); one int->float
convert (fp32's 24 bits) and one fma per column and tile scale it by s * max|x| / 32767.
X_PREP configs round x once per CTA instead, into a scratch, one scale per K tile (the loop then
1.6-1.7 instructions per nibble, but the prologue costs more than it saves at one row; at two
rows it won 4 of 5 shapes). `w4a16_gemv_dp2a_rounded` runs that loop on x rounded by its producer
(the add + RMSNorm and silu_mul kernels write round_x_int16's layout through x_int16_tiles): at two
rows 1.08-1.19x the bf16-x pick at every shape, at one row level with it.

Layout: the GPTQ layout as stored (qweight [K/8, N]), no repacked copy, the same thread mapping
as the FMA kernel (w4_fma_layout's [VECS, RS, NV/4, 4] slabs, x read as 16-byte int32 pairs in
the weights' layout): a thread holds SLABS packed rows (1, 2 or 4, one load each) x VECS 16-byte
column vectors, one quantization group per K tile. x must be bf16 without act-order perm (the
engine's case); other inputs go to the FMA kernel.

Per word w (nibble i = channel 8r + i): lo = w & 0x0F0F0F0F holds q0, q2, q4, q6 as bytes and
hi = (w >> 4) & 0x0F0F0F0F holds q1, q3, q5, q7; dp2a.lo / .hi take bytes 0-1 / 2-3 of them, so
x goes in as the int16 pairs (v0, v2), (v4, v6), (v1, v3), (v5, v7). The zero point comes off once
per column and tile: the int32 accumulator starts at -z * sum v over the thread's rows.

ASM=False (the Triton interpreter) computes the same integers with plain shifts and products.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import bf16_pair, pdl_launch_kwargs, tl_dtype
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.device_buffers import Want, persistent_buffers
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.quant_gemm._common import (_check_x, _default_split_k, _store_output,
                                                  _store_silu_output, _workspace)
from salaserve.quant.formats import QuantizedLinearWeights

W4_DP2A_MAX_M = 2  # rows of x per launch (each its own int16 x and accumulators)
# SZ_AHEAD: a tile's group scales and zero points are loaded with the tile, PREFETCH tiles ahead, the
# first ones before the PDL wait, instead of at the step that consumes them (a DRAM round trip after the
# wait that nothing hid in the short splits of the decode step). Same values, same arithmetic: the
# results are bit-identical either way. One-row launches take it (the w4a16 step at 4K, batch 1: 2.432
# -> 2.397 ms); two-row ones do not: the PREFETCH-2 rounded config would spill on sm_90.
X_MAX = tl.constexpr(32767.0)  # x's int16 range: v = round(x * X_MAX / max|x|)
X_TILE = 128  # channels per x scale of w4a16_gemv_dp2a_rounded's input (BLOCK_R * 8 of its configs)
_X_TILE = tl.constexpr(X_TILE)  # the same, for the kernels


@triton.jit
def _pack16(a_bits, b_bits, ASM: tl.constexpr):
    """The low 16 bits of a, and those of b above them: one prmt."""
    if ASM:
        return tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, $2, 0x5410;", constraints="=r,r,r",
                                         args=[a_bits, b_bits], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (a_bits & 0xFFFF) | (b_bits << 16)


@triton.jit
def _emu_dp2a(pair, quad, HI: tl.constexpr):
    """dp2a.lo / .hi s32.u32 without the accumulator: pair's signed int16 halves times quad's bytes 0, 1
    (or 2, 3)."""
    h0 = (pair << 16) >> 16
    h1 = pair >> 16
    if HI:
        return h0 * ((quad >> 16) & 0xFF) + h1 * ((quad >> 24) & 0xFF)
    else:
        return h0 * (quad & 0xFF) + h1 * ((quad >> 8) & 0xFF)


@triton.jit
def _word_dot(w, xa, xb, xc, xd, acc, ASM: tl.constexpr):
    """acc + sum over the 8 nibbles of w of q_i v_i, with x as the int16 pairs xa = (v0, v2), xb = (v4, v6),
    xc = (v1, v3), xd = (v5, v7)."""
    lo = w & 0x0F0F0F0F
    hi = (w >> 4) & 0x0F0F0F0F
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .s32 t;
            dp2a.lo.s32.u32 t, $1, $5, $7;
            dp2a.hi.s32.u32 t, $2, $5, t;
            dp2a.lo.s32.u32 t, $3, $6, t;
            dp2a.hi.s32.u32 $0, $4, $6, t;
            }""",
            constraints="=r,r,r,r,r,r,r,r", args=[xa, xb, xc, xd, lo, hi, acc], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (acc + _emu_dp2a(xa, lo, False) + _emu_dp2a(xb, lo, True) + _emu_dp2a(xc, hi, False)
                + _emu_dp2a(xd, hi, True))


@triton.jit
def _row_words(p, row, rr, r_end, EVEN: tl.constexpr):
    """One packed row's 4 int32 words of x (a 16-byte load in the weights' layout; the slab starts at
    packed row `row`, masked at r_end unless EVEN), each [1, RS, NV/4, 1]: bf16 pairs, or the int16
    pairs _x_prep stored."""
    if EVEN:
        u = tl.load(p)
    else:
        u = tl.load(p, mask=row + rr < r_end, other=0)
    u02, u13 = tl.split(tl.reshape(u, u.shape[:-1] + (2, 2)))
    u0, u2 = tl.split(u02)
    u1, u3 = tl.split(u13)
    return u0[:, :, :, None], u1[:, :, :, None], u2[:, :, :, None], u3[:, :, :, None]


@triton.jit
def _x_fp32(x_pairs, row, rr, r_end, EVEN: tl.constexpr):
    """One packed row's 8 bf16 x (_row_words) -> fp32 x0..x7."""
    u0, u1, u2, u3 = _row_words(x_pairs, row, rr, r_end, EVEN)
    x0, x1 = bf16_pair(u0)
    x2, x3 = bf16_pair(u1)
    x4, x5 = bf16_pair(u2)
    x6, x7 = bf16_pair(u3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax8(x0, x1, x2, x3, x4, x5, x6, x7):
    """max |x_i| over a packed row's 8 values; a NaN among them gives NaN (the tile's scale, then the
    output, NaN as in dequantize-then-matmul; the GPU's plain max would drop it)."""
    a = _max_nan(_max_nan(tl.abs(x0), tl.abs(x1)), _max_nan(tl.abs(x2), tl.abs(x3)))
    b = _max_nan(_max_nan(tl.abs(x4), tl.abs(x5)), _max_nan(tl.abs(x6), tl.abs(x7)))
    return _max_nan(a, b)


@triton.jit
def _round_bits(x, inv):
    """x * inv rounded to an integer, as the fp32 bits of 1.5 * 2^23 plus it: its two's complement
    fills the low 16 bits."""
    return (x * inv + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def _x_int16(x0, x1, x2, x3, x4, x5, x6, x7, inv, ASM: tl.constexpr):
    """A packed row's x as the int16 pairs of _word_dot, and the sum of its 8 integers."""
    b0 = _round_bits(x0, inv)
    b1 = _round_bits(x1, inv)
    b2 = _round_bits(x2, inv)
    b3 = _round_bits(x3, inv)
    b4 = _round_bits(x4, inv)
    b5 = _round_bits(x5, inv)
    b6 = _round_bits(x6, inv)
    b7 = _round_bits(x7, inv)
    # the sum of the 8 integers: the bits' sum less 8 magics (int32 arithmetic wraps; the result is small)
    total = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7)) - 0x5A000000  # 8 * 0x4B400000 mod 2^32
    return (_pack16(b0, b2, ASM), _pack16(b4, b6, ASM), _pack16(b1, b3, ASM), _pack16(b5, b7, ASM)), total


@triton.jit
def _w4_dp2a_tile(w_ptr, r0, r_end, N, rr, cols, RS: tl.constexpr, SLABS: tl.constexpr, EVEN: tl.constexpr):
    """The weight tile at packed row r0 as up to 4 slabs of RS rows (the unused ones alias slab 0).
    EVEN: past r_end the split's last tile again (a prefetch never consumed); else masked."""
    BLOCK_R: tl.constexpr = RS * SLABS
    if EVEN:
        base = w_ptr + tl.minimum(r0, r_end - BLOCK_R) * N
        w0 = tl.load(base)
        w1 = w0
        w2 = w0
        w3 = w0
        if SLABS >= 2:
            w1 = tl.load(base + RS * N)
        if SLABS >= 4:
            w2 = tl.load(base + 2 * RS * N)
            w3 = tl.load(base + 3 * RS * N)
    else:
        base = w_ptr + r0 * N
        ok = cols < N
        w0 = tl.load(base, mask=(r0 + rr < r_end) & ok, other=0)
        w1 = w0
        w2 = w0
        w3 = w0
        if SLABS >= 2:
            w1 = tl.load(base + RS * N, mask=(r0 + RS + rr < r_end) & ok, other=0)
        if SLABS >= 4:
            w2 = tl.load(base + 2 * RS * N, mask=(r0 + 2 * RS + rr < r_end) & ok, other=0)
            w3 = tl.load(base + 3 * RS * N, mask=(r0 + 3 * RS + rr < r_end) & ok, other=0)
    return w0, w1, w2, w3


@triton.jit
def _w4_group_sz(s_cols, z_cols, z_shift, r0, r_end, cols, N, stride_zg, GROUP_SIZE: tl.constexpr,
                 EVEN: tl.constexpr):
    """The scales (fp32) and zero points of the group of packed row r0; r0 past the split's end (an
    SZ_AHEAD prefetch never consumed) reads its last row's group, which exists."""
    g = (tl.minimum(r0, r_end - 1) * 8) // GROUP_SIZE
    if EVEN:
        s = tl.load(s_cols + g * N).to(tl.float32)
        zq = (tl.load(z_cols + g * stride_zg) >> z_shift) & 0xF
    else:
        s = tl.load(s_cols + g * N, mask=cols < N, other=0.0).to(tl.float32)
        zq = (tl.load(z_cols + g * stride_zg, mask=cols < N, other=0) >> z_shift) & 0xF
    return s, zq


@triton.jit
def _w4_dp2a_row(x_pairs, r0, rr, r_end, w0, w1, w2, w3, zq, sz, RS: tl.constexpr, SLABS: tl.constexpr,
                 EVEN: tl.constexpr, ASM: tl.constexpr):
    """One x row's contribution of a tile to the float accumulator: sum (q - z) x * s per column,
    [VECS, RS, NV/4, 4] (summed over the rows later). zq: the columns' zero points; sz: their scales."""
    p = x_pairs + r0 * 4
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_fp32(p, r0, rr, r_end, EVEN)
    m = _absmax8(a0, a1, a2, a3, a4, a5, a6, a7)
    b0, b1, b2, b3, b4, b5, b6, b7 = a0, a1, a2, a3, a4, a5, a6, a7
    c0, c1, c2, c3, c4, c5, c6, c7 = a0, a1, a2, a3, a4, a5, a6, a7
    d0, d1, d2, d3, d4, d5, d6, d7 = a0, a1, a2, a3, a4, a5, a6, a7
    if SLABS >= 2:
        b0, b1, b2, b3, b4, b5, b6, b7 = _x_fp32(p + RS * 4, r0 + RS, rr, r_end, EVEN)
        m = _max_nan(m, _absmax8(b0, b1, b2, b3, b4, b5, b6, b7))
    if SLABS >= 4:
        c0, c1, c2, c3, c4, c5, c6, c7 = _x_fp32(p + 2 * RS * 4, r0 + 2 * RS, rr, r_end, EVEN)
        d0, d1, d2, d3, d4, d5, d6, d7 = _x_fp32(p + 3 * RS * 4, r0 + 3 * RS, rr, r_end, EVEN)
        m = _max_nan(m, _max_nan(_absmax8(c0, c1, c2, c3, c4, c5, c6, c7), _absmax8(d0, d1, d2, d3, d4, d5, d6, d7)))
    m = _max_nan(m, 1e-30)  # all-zero rows: inv stays finite, every v is 0
    inv = X_MAX / m
    xa, total = _x_int16(a0, a1, a2, a3, a4, a5, a6, a7, inv, ASM)
    xb = xa
    xc = xa
    xd = xa
    if SLABS >= 2:
        xb, tb = _x_int16(b0, b1, b2, b3, b4, b5, b6, b7, inv, ASM)
        total += tb
    if SLABS >= 4:
        xc, tc = _x_int16(c0, c1, c2, c3, c4, c5, c6, c7, inv, ASM)
        xd, td = _x_int16(d0, d1, d2, d3, d4, d5, d6, d7, inv, ASM)
        total += tc + td
    return _tile_dot(w0, w1, w2, w3, xa, xb, xc, xd, total, m * (1.0 / X_MAX), zq, sz, SLABS, ASM)


@triton.jit
def _w4_dp2a_row_prepped(xq_pairs, xs_row, r0, rr, r_end, w0, w1, w2, w3, zq, sz, RS: tl.constexpr,
                         SLABS: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """_w4_dp2a_row with x already in int16 pairs and one scale per tile (_x_prep)."""
    p = xq_pairs + r0 * 4
    ones = tl.full(rr.shape, 0x11111111, tl.int32)  # a word of 8 codes 1: _word_dot then sums the 8 integers
    zero = tl.full(rr.shape, 0, tl.int32)
    xa = _row_words(p, r0, rr, r_end, EVEN)
    total = _word_dot(ones, xa[0], xa[1], xa[2], xa[3], zero, ASM)
    xb = xa
    xc = xa
    xd = xa
    if SLABS >= 2:
        xb = _row_words(p + RS * 4, r0 + RS, rr, r_end, EVEN)
        total = _word_dot(ones, xb[0], xb[1], xb[2], xb[3], total, ASM)
    if SLABS >= 4:
        xc = _row_words(p + 2 * RS * 4, r0 + 2 * RS, rr, r_end, EVEN)
        xd = _row_words(p + 3 * RS * 4, r0 + 3 * RS, rr, r_end, EVEN)
        total = _word_dot(ones, xc[0], xc[1], xc[2], xc[3], total, ASM)
        total = _word_dot(ones, xd[0], xd[1], xd[2], xd[3], total, ASM)
    sx = tl.load(xs_row + r0 // (RS * SLABS))
    return _tile_dot(w0, w1, w2, w3, xa, xb, xc, xd, total, sx, zq, sz, SLABS, ASM)


@triton.jit
def _tile_dot(w0, w1, w2, w3, xa, xb, xc, xd, total, sx, zq, sz, SLABS: tl.constexpr, ASM: tl.constexpr):
    """sum over the thread's rows of (q - z) v per column, times s * sx: the slabs' words against their
    rows' int16 pairs (xa.. for slabs 0..3), the zero point once per column through total = sum v."""
    acc = _word_dot(w0, xa[0], xa[1], xa[2], xa[3], -zq * total, ASM)
    if SLABS >= 2:
        acc = _word_dot(w1, xb[0], xb[1], xb[2], xb[3], acc, ASM)
    if SLABS >= 4:
        acc = _word_dot(w2, xc[0], xc[1], xc[2], xc[3], acc, ASM)
        acc = _word_dot(w3, xd[0], xd[1], xd[2], xd[3], acc, ASM)
    return acc.to(tl.float32) * (sz * sx)


@triton.jit
def x_int16_tiles(x, TILES: tl.constexpr, TILE: tl.constexpr, ASM: tl.constexpr):
    """x [TILES, TILE] fp32 (TILE channels a multiple of 8, whole packed rows) -> (the int16 pairs of
    _word_dot, [TILES * TILE / 2] int32 in channel order, and one scale per tile, max|x| / 32767):
    round_x_int16's values. The X_PREP prologue and x's producers (add + RMSNorm, silu_mul) both
    round through this."""
    m = _max_nan(tl.reduce(tl.abs(x), 1, _max_nan), 1e-30)
    bits = _round_bits(x, X_MAX / m[:, None])
    # channel 4a + 2b + c of a packed row goes to pair 2c + a, half b
    v = tl.permute(tl.reshape(bits, (TILES * TILE // 8, 2, 2, 2)), (0, 3, 1, 2))
    lo, hi = tl.split(v)
    return tl.reshape(_pack16(lo, hi, ASM), (TILES * TILE // 2,)), m * (1.0 / X_MAX)


@triton.jit
def store_x_int16(y, col0, n_cols, xq_row, xs_row, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """A row's fp32 values y of channels [col0, col0 + BLOCK) (col0 and BLOCK multiples of X_TILE,
    zeros past n_cols) as the dp2a GEMV's rounded x: X_TILE channels per scale (xs_row, one fp32
    each), int16 pairs (xq_row, int32 words); round_x_int16's layout and values. x's producers (the add
    + RMSNorm and silu_mul kernels) write it through this."""
    words, scales = x_int16_tiles(tl.reshape(y, (BLOCK // _X_TILE, _X_TILE)), BLOCK // _X_TILE, _X_TILE, ASM)
    w = col0 // 2 + tl.arange(0, BLOCK // 2)
    tl.store(xq_row + w, words, mask=w < n_cols // 2)
    t = col0 // _X_TILE + tl.arange(0, BLOCK // _X_TILE)
    tl.store(xs_row + t, scales, mask=t < n_cols // _X_TILE)


@triton.jit
def _x_prep(x_row, xq_row, xs_row, r_begin, r_end, BLOCK_R: tl.constexpr, PREP_TILES: tl.constexpr,
            ASM: tl.constexpr):
    """x's channels of packed rows [r_begin, r_end) as int16 pairs in _word_dot's order (4 int32 per
    packed row, at xq_row) with one scale per K tile (max|x| / 32767, at xs_row), PREP_TILES tiles
    at a time."""
    TILE: tl.constexpr = BLOCK_R * 8
    for t0 in range(r_begin // BLOCK_R, tl.cdiv(r_end, BLOCK_R), PREP_TILES):
        tiles = t0 + tl.arange(0, PREP_TILES)
        ch = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(x_row + ch, mask=ch < r_end * 8, other=0.0).to(tl.float32)
        words_v, scales = x_int16_tiles(x, PREP_TILES, TILE, ASM)
        words = t0 * BLOCK_R * 4 + tl.arange(0, PREP_TILES * BLOCK_R * 4)
        tl.store(xq_row + words, words_v, mask=words < r_end * 4)
        tl.store(xs_row + tiles, scales, mask=tiles * BLOCK_R < r_end)


@triton.jit
def _w4_gemv_dp2a_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, ws_ptr, cnt_ptr, xq_ptr, xs_ptr,
    M, N, K, stride_xm, stride_om, stride_zg,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1 or 2 rows of x
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,  # BLOCK_R packed rows (BLOCK_R * 8 channels) per tile
    SPLIT_K: tl.constexpr,
    SLABS: tl.constexpr, VECS: tl.constexpr,  # packed rows x 16-byte column vectors per thread
    EVEN: tl.constexpr,  # N a multiple of BLOCK_N and K of BLOCK_R * 8: no masks
    ASM: tl.constexpr,  # inline PTX (prmt, dp2a); False: the same integers in plain Triton (interpreter)
    PREFETCH: tl.constexpr = 1,  # weight tiles loaded ahead of the one being consumed: 1 or 2
    X_PREP: tl.constexpr = False,  # x rounded once per CTA into the xq/xs scratch (_x_prep), not per thread
    PREP_TILES: tl.constexpr = 8,  # _x_prep's tiles per step
    X_GIVEN: tl.constexpr = False,  # xq/xs already hold x in _x_prep's layout (written by x's producer)
    PDL: tl.constexpr = False,
    SZ_AHEAD: tl.constexpr = False,  # a tile's group scales and zero points loaded with it (W4_SZ_AHEAD)
    SILU_OUT: tl.constexpr = False,  # W = [gate | up] (N = 2F): write silu_mul of the output, [M, F]
    Y_DT: tl.constexpr = None,  # SILU_OUT: the linear's output dtype (its rounding before silu_mul)
):
    # the FMA kernel's split and slab coordinates (w4_fma.py), written out again: a shared helper
    # reorders the code and ptxas then schedules the measured loops differently
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
    jv = (tl.arange(0, VECS) * NV)[:, None, None, None] + lane * 4  # column vectors in the tile: [V, 1, NV/4, 1]
    if SILU_OUT:
        # tile pid_n owns outputs [pid_n * BN/2, +BN/2): its first BN/2 columns are those gate columns,
        # the rest the matching up columns F + n, so its epilogue has both halves of every output
        # (as arithmetic, not a select, and with F = N/2 a multiple of 4, which the launch checks: so the
        # compiler still sees 16-byte aligned column vectors and keeps the weights' vector loads)
        HALF_N: tl.constexpr = BLOCK_N // 2
        F = tl.multiple_of(N // 2, 4)
        vec0 = pid_n * HALF_N + jv + (jv >= HALF_N).to(tl.int32) * (F - HALF_N)
    else:
        vec0 = pid_n * BLOCK_N + jv
    cols = vec0 + k4
    w_ptr = qweight_ptr + rr * N + cols
    rows0 = rr * 0  # per-column loads broadcast over the rows keep the weights' layout (w4_fma.py)
    s_cols = scales_ptr + cols + rows0
    z_cols = qzeros_ptr + cols // 8 + rows0
    z_shift = (cols % 8) * 4
    x_quads = rr * 4 + lane * 0 + k4  # int32 pairs of a slab's rows: [1, RS, NV/4, 4]
    x0_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    x1_pairs = (x_ptr + tl.minimum(1, M - 1) * stride_xm).to(tl.pointer_type(tl.int32), bitcast=True) + x_quads
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # the first tiles before the dependency wait: weights never depend on the previous kernel
    w0, w1, w2, w3 = _w4_dp2a_tile(w_ptr, r_begin, r_end, N, rr, cols, RS, SLABS, EVEN)
    p0, p1, p2, p3 = w0, w1, w2, w3  # PREFETCH 2: the tile after the next
    if PREFETCH >= 2:
        p0, p1, p2, p3 = _w4_dp2a_tile(w_ptr, r_begin + BLOCK_R, r_end, N, rr, cols, RS, SLABS, EVEN)
    # SZ_AHEAD: each tile's scales and zero points travel with it (ws, wz; ps, pz for PREFETCH 2), so the
    # first tile's arrive before the wait too, and no step waits on a DRAM round trip of its own for them
    if SZ_AHEAD:
        ws, wz = _w4_group_sz(s_cols, z_cols, z_shift, r_begin, r_end, cols, N, stride_zg, GROUP_SIZE, EVEN)
        ps, pz = ws, wz
        if PREFETCH >= 2:
            ps, pz = _w4_group_sz(s_cols, z_cols, z_shift, r_begin + BLOCK_R, r_end, cols, N, stride_zg,
                                  GROUP_SIZE, EVEN)
    if PDL:
        tl.extra.cuda.gdc_wait()
    n_tiles = tl.cdiv(K8, BLOCK_R)
    xq0_pairs = xq_ptr + x_quads
    xq1_pairs = xq_ptr + K8 * 4 + x_quads
    if X_PREP and not X_GIVEN:
        # every CTA of a split writes the same values to the scratch (of this split's channels), so a
        # thread reads its own CTA's writes or identical ones; PDL's wait orders launches
        _x_prep(x_ptr, xq_ptr, xs_ptr, r_begin, r_end, BLOCK_R, PREP_TILES, ASM)
        if BLOCK_M >= 2:
            _x_prep(x_ptr + stride_xm, xq_ptr + K8 * 4, xs_ptr + n_tiles, r_begin, r_end, BLOCK_R, PREP_TILES, ASM)
        tl.debug_barrier()
    acc0 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    acc1 = tl.zeros((VECS, RS, NV // 4, 4), dtype=tl.float32)
    for r0 in tl.range(r_begin, r_end, BLOCK_R, loop_unroll_factor=2):
        # the tile PREFETCH ahead is issued before this one is consumed
        n0, n1, n2, n3 = _w4_dp2a_tile(w_ptr, r0 + PREFETCH * BLOCK_R, r_end, N, rr, cols, RS, SLABS, EVEN)
        if SZ_AHEAD:
            ns, nz = _w4_group_sz(s_cols, z_cols, z_shift, r0 + PREFETCH * BLOCK_R, r_end, cols, N, stride_zg,
                                  GROUP_SIZE, EVEN)
            s = ws
            zq = wz
        else:  # loaded at the step that uses them
            s, zq = _w4_group_sz(s_cols, z_cols, z_shift, r0, r_end, cols, N, stride_zg, GROUP_SIZE, EVEN)
        if X_PREP or X_GIVEN:
            acc0 += _w4_dp2a_row_prepped(xq0_pairs, xs_ptr, r0, rr, r_end, w0, w1, w2, w3, zq, s, RS, SLABS, EVEN, ASM)
            if BLOCK_M >= 2:
                acc1 += _w4_dp2a_row_prepped(xq1_pairs, xs_ptr + n_tiles, r0, rr, r_end, w0, w1, w2, w3, zq, s, RS,
                                             SLABS, EVEN, ASM)
        else:
            acc0 += _w4_dp2a_row(x0_pairs, r0, rr, r_end, w0, w1, w2, w3, zq, s, RS, SLABS, EVEN, ASM)
            if BLOCK_M >= 2:
                acc1 += _w4_dp2a_row(x1_pairs, r0, rr, r_end, w0, w1, w2, w3, zq, s, RS, SLABS, EVEN, ASM)
        if PREFETCH >= 2:
            w0, w1, w2, w3 = p0, p1, p2, p3
            p0, p1, p2, p3 = n0, n1, n2, n3
            if SZ_AHEAD:
                ws, wz = ps, pz
                ps, pz = ns, nz
        else:
            w0, w1, w2, w3 = n0, n1, n2, n3
            if SZ_AHEAD:
                ws, wz = ns, nz
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y = tl.where(offs_m[:, None] == 0, tl.reshape(tl.sum(acc0, axis=1), (BLOCK_N,))[None, :], 0.0)
    if BLOCK_M >= 2:
        y = tl.where(offs_m[:, None] == 1, tl.reshape(tl.sum(acc1, axis=1), (BLOCK_N,))[None, :], y)
    if SILU_OUT:
        _store_silu_output(y, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, pid_n, SPLIT_K, BLOCK_M,
                           BLOCK_N, Y_DT)
    else:
        _store_output(y, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, pid_n, SPLIT_K)


# (BLOCK_N, BLOCK_R, num_warps, SLABS, tiles prefetched, x prepared once per CTA) per M bucket: a thread
# holds SLABS packed rows x VECS column vectors (w4_dp2a_layout), one quantization group per K tile.
# Kept from a sweep of every config per shape: at one row SLABS 4 with x converted in the loop won every
# shape (X_PREP lost by 4-15%; two column vectors per thread, 128+ registers, ran 1.8x slower); at two
# rows X_PREP won 4 of 5 shapes.
W4_DP2A_CONFIGS = {
    1: ((64, 16, 2, 4, 2, False), (32, 16, 1, 4, 2, False), (128, 16, 4, 4, 1, False), (64, 16, 2, 4, 1, False)),
    2: ((128, 16, 4, 4, 1, True), (64, 16, 2, 4, 1, False), (128, 16, 4, 4, 1, False)),
}
# w4a16_gemv_dp2a_rounded's configs (x rounded by its producer; the X_PREP field unused); BLOCK_R * 8 = X_TILE.
# Kept from a sweep of 12 configs: at two rows the rounded loop is 1.08-1.19x the
# bf16-x pick at every shape; at one row 0.98-1.04x (the one-row kernel is not issue-bound), so one config
# is left there (qkvg's 1.04x).
W4_DP2A_ROUNDED_CONFIGS = {
    1: ((128, 16, 4, 4, 1, False),),
    2: ((128, 16, 4, 4, 1, False), (64, 16, 2, 4, 1, False), (64, 16, 2, 4, 2, False)),
}
W4_DP2A_GROUP_MULTIPLE = 8 * max(cfg[1] for cfgs in W4_DP2A_CONFIGS.values() for cfg in cfgs)


_X_SCRATCH: dict = {}
_X_SCRATCH_MIN = 1 << 16  # int32 words: x of 2 rows up to K = 65536


def _x_scratch(device: torch.device, n_words: int, n_scales: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 pairs and tile scales of x (X_PREP), one pair of buffers per device (device_buffers:
    sized for every launch the model makes at first use, grown outside graph capture only)."""
    return persistent_buffers(_X_SCRATCH, device, (Want(n_words, _X_SCRATCH_MIN, torch.int32),
                                                   Want(n_scales, _X_SCRATCH_MIN // 64, torch.float32)),
                              "the dp2a GEMV's x scratch")


def w4_dp2a_layout(block_n: int, block_r: int, warps: int, slabs: int) -> dict:
    """SLABS, VECS of _w4_gemv_dp2a_kernel: the tile's 16-byte vectors per thread (block_n * block_r /
    (128 warps)) as slabs packed rows x VECS column vectors; raises where the config cannot map so."""
    per_thread = block_n * block_r // (128 * warps)
    if per_thread < slabs or per_thread % slabs or block_r % slabs:
        raise ValueError(f"config ({block_n}, {block_r}, {warps}, {slabs}) does not give whole slabs per thread")
    return dict(SLABS=slabs, VECS=per_thread // slabs)


def w4_dp2a_usable(w: QuantizedLinearWeights) -> bool:
    """Whether the dp2a kernel takes these weights (its x must be bf16, read as int32 pairs): no
    act-order perm or g_idx, group sizes that its K tiles divide."""
    return (w.perm is None and w.g_idx_trivial and w.in_features % 8 == 0
            and w.group_size % W4_DP2A_GROUP_MULTIPLE == 0)


def w4a16_gemv_dp2a(x: torch.Tensor, w: QuantizedLinearWeights, *, config: Optional[tuple] = None,
                    split_k: Optional[int] = None, sz_ahead: Optional[bool] = None,
                    silu_out: bool = False) -> torch.Tensor:
    """Decode-sized bf16 x [M <= W4_DP2A_MAX_M, K] @ int4 weights (GPTQ layout, trivial g_idx) -> [M, N]
    bf16. config: (BLOCK_N, BLOCK_R, num_warps, SLABS, tiles prefetched, x prepared once per CTA),
    default the bucket's first. sz_ahead: the SZ_AHEAD loop (default: at one row; same results).
    silu_out: w is a [gate | up] weight (N = 2F) and the result is silu_mul of the output, [M, F]:
    fused.silu_mul's values on the bf16 output, written by the GEMV's epilogue (no silu_mul kernel)."""
    K = w.in_features
    x = _check_x(x, K)
    M = x.shape[0]
    _check_dp2a(M, w)
    if x.dtype != torch.bfloat16:
        raise ValueError("w4a16_gemv_dp2a takes bf16 x")
    if x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.clone(memory_format=torch.contiguous_format)  # x's packed rows are read as int32 pairs
    block_m = 1 if M == 1 else 2
    cfg = config or W4_DP2A_CONFIGS[block_m][0]
    xq, xs = _x_scratch(x.device, block_m * (K // 2), block_m * triton.cdiv(K // 8, cfg[1]))
    return _launch(x, xq, xs, M, w, cfg, split_k, x_given=False, out_dtype=x.dtype, sz_ahead=sz_ahead,
                   silu_out=silu_out)


def w4a16_gemv_dp2a_rounded(xq: torch.Tensor, xs: torch.Tensor, w: QuantizedLinearWeights, *,
                            config: Optional[tuple] = None, split_k: Optional[int] = None,
                            out_dtype: torch.dtype = torch.bfloat16, sz_ahead: Optional[bool] = None,
                            silu_out: bool = False) -> torch.Tensor:
    """The dp2a GEMV on x already rounded by its producer (round_x_int16's layout: xq int32 [M, K / 2],
    xs fp32 [M, K / X_TILE], contiguous): the loop of the X_PREP configs without their prologue.
    config as w4a16_gemv_dp2a's (its X_PREP field is ignored; BLOCK_R * 8 must be X_TILE); sz_ahead and
    silu_out as there."""
    K = w.in_features
    if K % X_TILE:  # one scale per whole tile: a partial last tile would read a scale past xs
        raise ValueError(f"w4a16_gemv_dp2a_rounded takes K a multiple of {X_TILE}, got {K}")
    M = xq.shape[0] if xq.dim() == 2 else 0
    if xq.shape != (M, K // 2) or xq.dtype != torch.int32 or xs.shape != (M, K // X_TILE) or xs.dtype != torch.float32:
        raise ValueError(f"w4a16_gemv_dp2a_rounded takes xq int32 [M, {K // 2}] and xs fp32 [M, {K // X_TILE}], "
                         f"got {tuple(xq.shape)} {xq.dtype} and {tuple(xs.shape)} {xs.dtype}")
    if not (xq.is_contiguous() and xs.is_contiguous()) or xq.device != w.qweight.device or xs.device != xq.device:
        raise ValueError("w4a16_gemv_dp2a_rounded takes contiguous xq and xs on the weights' device")
    _check_dp2a(M, w)
    cfg = config or W4_DP2A_ROUNDED_CONFIGS[1 if M == 1 else 2][0]
    if cfg[1] * 8 != X_TILE:
        raise ValueError(f"config {cfg}: its K tile must be X_TILE = {X_TILE} channels")
    return _launch(xq, xq, xs, M, w, cfg, split_k, x_given=True, out_dtype=out_dtype, sz_ahead=sz_ahead,
                   silu_out=silu_out)


def _check_dp2a(M: int, w: QuantizedLinearWeights) -> None:
    if not 1 <= M <= W4_DP2A_MAX_M:
        raise ValueError(f"the dp2a GEMV takes 1 <= M <= {W4_DP2A_MAX_M} rows, got {M}")
    if not w4_dp2a_usable(w):
        raise ValueError("the dp2a GEMV takes int4 weights without act-order, group size a multiple of "
                         f"{W4_DP2A_GROUP_MULTIPLE}")
    if w.qweight.numel() >= 2**31:
        raise ValueError("qweight too large for the kernel's int32 offsets")


def _launch(x, xq, xs, M, w, cfg, split_k, x_given: bool, out_dtype, sz_ahead: Optional[bool],
            silu_out: bool) -> torch.Tensor:
    K, N = w.in_features, w.out_features
    block_m = 1 if M == 1 else 2
    block_n, block_r, warps, slabs, prefetch, prep = cfg
    if silu_out and (N % 8 or block_n % 8):
        # each tile's halves are whole 4-column vectors of gate and of up columns, aligned to 16 bytes
        raise ValueError(f"silu_out takes N = 2F ([gate | up]) with F a multiple of 4 and BLOCK_N a multiple of 8, "
                         f"got N={N}, {cfg}")
    tiles = triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N // 2 if silu_out else N, dtype=out_dtype, device=x.device)
    # the split partials [split, M, tiles * block_n] and a counter per tile
    ws, cnt = _workspace(x.device, split * M * tiles * block_n if split > 1 else 0, tiles)
    launch_kernel(_w4_gemv_dp2a_kernel, (tiles, split),
        x, w.qweight, w.qzeros, w.scales, out, ws, cnt, xq, xs,
        M, N, K, x.stride(0), out.stride(0), w.qzeros.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=split,
        **w4_dp2a_layout(block_n, block_r, warps, slabs), EVEN=N % block_n == 0 and K % (8 * block_r) == 0,
        ASM=not INTERPRET, PREFETCH=prefetch, X_PREP=prep and not x_given, X_GIVEN=x_given,
        SZ_AHEAD=block_m == 1 if sz_ahead is None else bool(sz_ahead), SILU_OUT=silu_out,
        Y_DT=tl_dtype(out_dtype) if silu_out else None, num_warps=warps, **pdl_launch_kwargs(x.device))
    return out


def round_x_int16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of X_TILE) -> (xq, xs) for w4a16_gemv_dp2a_rounded: per X_TILE channels one
    scale xs = m / 32767 (m = their max |x|; NaN if one is NaN), codes v = round(x * 32767 / m) stored as
    _word_dot's int16 pairs (channel 4a + 2b + c of a packed row in pair 2c + a, half b). The torch
    twin of the producer kernels' int16 epilogue."""
    M, K = x.shape
    if K % X_TILE:
        raise ValueError(f"round_x_int16 takes K a multiple of {X_TILE}, got {K}")
    t = x.float().reshape(M, K // X_TILE, X_TILE)
    m = t.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    v = torch.round(t * (X_MAX.value / m)).to(torch.int32).reshape(M, K // 8, 2, 2, 2)  # (a, b, c)
    v = v.permute(0, 1, 4, 2, 3).reshape(M, K // 8, 4, 2)  # (pair 2c + a, half b)
    xq = (v[..., 0] & 0xFFFF) | (v[..., 1] << 16)
    return xq.reshape(M, K // 2).contiguous(), (m.reshape(M, K // X_TILE) * (1.0 / X_MAX.value)).contiguous()
