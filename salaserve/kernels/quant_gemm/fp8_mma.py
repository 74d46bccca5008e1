"""fp8 decode GEMV on mma.sync tensor cores, straight from registers (gemv.gemv_fp8 with an `mma`
config).

Why: the FMA GEMV (`gemv._fp8_sums`) executes ~5.3 instructions per weight (cvt to f16, f16 ->
f32, an FMA, x's conversions) and is issue-bound at ~3.3 TB/s on the large shapes; the tl.dot
path (FP8_DOT_CONFIGS) sends the codes through shared memory a byte pair at a time. Here each
lane loads its W bytes with 16-byte global loads into registers, converts pairs of codes with one
cvt.rn.f16x2.e4m3x2 each (exact), and feeds them as the A fragment of an m16n8k16 f16 mma.sync
(fp32 accumulation) whose B fragment is x: 8 columns, one per token (M <= 8). No shared memory,
no layout conversion: sm_90 loop SASS ~1.6 instructions per weight (0.5 of them the code cvts; x
is converted once per K chunk for all of a lane's row tiles).

Measured (BENCHMARKS runs 74-79): correct, but at one row slower than the FMA GEMV at every shape
(gate_up 44.6 vs 38.9 us with W three chunks ahead), and within 1% of w8a16 over a step's linears
at 8 rows; hence opt-in (SALASERVE_FP8_MMA=1 adds its configs to the fp8 calibration).
docs/perf-notes.md has what bounds it (bytes in flight per warp, per-CTA fixed costs).

The K permutation that makes 16-byte loads possible: the mma's A fragment gives lane (g, t)
(g = lane / 4, t = lane % 4) the logical k pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of rows g and
g + 8. A dot product does not care about the order of k, so long as x is permuted the same way:
in each 64-channel chunk, lane t reads the 16 contiguous codes [16t, 16t + 16) of its two rows,
and step s (0..3) of the chunk takes codes 16t + 4s + (0, 1) as logical (2t, 2t + 1) and
16t + 4s + (2, 3) as logical (2t + 8, 2t + 9). The B fragment of lane (g, t) holds x[token g] at
the same logical k, i.e. at the same physical channels: lane (g, t) reads x[g, 16t : 16t + 16).

x goes in as f16 of x * 2^-8 (bf16 values stay exact for |x| < 2^24; only |x| < 2^-6 lose low
bits, as f16 subnormals), the 2^8 goes back on with the per-channel scales, as in the tl.dot
path. Tensors are laid out one element per thread ([RT, 32 * num_warps]: row tile r of the
thread's warp) so that the inline asm sees exactly the registers mma.sync expects. Under the
Triton interpreter (no inline asm) the same fragments go through a tensor emulation of the mma.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from salaserve.kernels import gemv as G
from salaserve.kernels._triton_utils import bf16_pair, round_to, silu_mul_rounded
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.quant_gemm._common import _split_k_fragments

MMA_TOKENS = 8  # the mma's N: one column per token
CHUNK = 64  # K channels per loop step (16 per lane, 4 lanes per row)


@triton.jit
def _f16x2(lo, hi, ASM: tl.constexpr):
    """Two fp32 tensors -> int32 words of f16 pairs (lo in the low half), rounded to nearest."""
    if ASM:
        words = tl.inline_asm_elementwise(asm="cvt.rn.f16x2.f32 $0, $2, $1;", constraints="=r,f,f", args=[lo, hi],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        words = (hi16 << 16) | lo16
    return words  # one return: the compiler checks every return's type, constexpr-dead ones too


@triton.jit
def _f16_halves(words):
    """Interpreter side of `_f16x2`: the two f16 halves of int32 words as fp32 (lo, hi)."""
    lo = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _four(v, SHAPE0: tl.constexpr, SHAPE1: tl.constexpr):
    """[S0, S1, 4] -> its four [S0, S1] slices along the last axis (in-thread: the last axis is one
    thread's 16-byte vector)."""
    a, b = tl.split(tl.reshape(v, [SHAPE0, SHAPE1, 2, 2]))  # a: elements 0, 2; b: 1, 3
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _mma_lanes(RT: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The mma fragments' coordinates of each thread, one element per thread: g = lane / 4 and t =
    lane % 4 ([32 * NUM_WARPS]), and tile [RT, 32 * NUM_WARPS], the program's 16-row tile that row
    tile r of the thread's warp covers (shared with w4_mma.py)."""
    lane_id = tl.arange(0, 32 * NUM_WARPS)
    warp = lane_id // 32
    g = (lane_id % 32) // 4
    t = lane_id % 4
    tile = (warp * RT)[None, :] + tl.arange(0, RT)[:, None]
    return g, t, tile


@triton.jit
def _fragment_masks(t, ok_lo, ok_hi, M, RT: tl.constexpr, NUM_WARPS: tl.constexpr):
    """The C fragment's columns and store masks: lane (g, t) holds rows (row_lo, row_hi) x tokens
    (tok0, tok1) = (2t, 2t + 1) as c0 (lo, tok0), c1 (lo, tok1), c2 (hi, tok0), c3 (hi, tok1), whose
    masks are m0, m1, n0, n1 (row in range, token < M). Shared with w4_mma.py."""
    tok0 = (2 * t)[None, :] + tl.zeros((RT, 32 * NUM_WARPS), dtype=tl.int32)
    tok1 = tok0 + 1
    return tok0, tok1, ok_lo & (tok0 < M), ok_lo & (tok1 < M), ok_hi & (tok0 < M), ok_hi & (tok1 < M)


@triton.jit
def _emu_cols(d, RT: tl.constexpr, NW: tl.constexpr):
    """Emulated mma output d [RT, NW, 8 rows, 8 tokens] -> the C fragment's (token 2t, token 2t + 1)
    values of lane (g, t), as [RT, 32 * NW] each."""
    even, odd = tl.split(tl.reshape(d, [RT, NW, 8, 4, 2]))
    return tl.reshape(even, [RT, NW * 32]), tl.reshape(odd, [RT, NW * 32])


@triton.jit
def _emu_contract(q0, q1, q2, q3, x0, x1, x2, x3, RT: tl.constexpr, NW: tl.constexpr):
    """Interpreter's mma for one 8-row half: D[g, n] = sum over t and j of A_j(lane g, t) * B_j(lane
    n, t), with the lane's four A values q_j [RT, 32 NW] and B values x_j [1, 32 NW] (fp32) at the
    same logical k. Returns [RT, NW, 8 rows, 8 columns] (shared with w4_mma.py's emulation)."""
    d = tl.reshape(q0, [RT, NW, 8, 1, 4]) * tl.reshape(x0, [1, NW, 1, 8, 4])
    d += tl.reshape(q1, [RT, NW, 8, 1, 4]) * tl.reshape(x1, [1, NW, 1, 8, 4])
    d += tl.reshape(q2, [RT, NW, 8, 1, 4]) * tl.reshape(x2, [1, NW, 1, 8, 4])
    d += tl.reshape(q3, [RT, NW, 8, 1, 4]) * tl.reshape(x3, [1, NW, 1, 8, 4])
    return tl.sum(d, axis=4)


@triton.jit
def _emu_rows(wa, b0, b1, RT: tl.constexpr, NW: tl.constexpr):
    """Interpreter: D[g, n] = sum_t sum_j code_j(lane g, t) * x_j(lane n, t) for one 16-row half."""
    x0, x1 = _f16_halves(b0)
    x2, x3 = _f16_halves(b1)
    return _emu_contract(G._e4m3_to_f32_bits(wa, 0), G._e4m3_to_f32_bits(wa, 1), G._e4m3_to_f32_bits(wa, 2),
                         G._e4m3_to_f32_bits(wa, 3), x0, x1, x2, x3, RT, NW)


@triton.jit
def _mma(c0, c1, c2, c3, wa, wb, b0, b1, RT: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr):
    """One m16n8k16 step: C += A B with A = the e4m3 codes of words wa (row g) and wb (row g + 8),
    low code pair as logical (2t, 2t + 1), high pair as (2t + 8, 2t + 9); B = f16 pairs b0, b1."""
    if ASM:
        # x is the same for all of the thread's row tiles
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 l0, h0, l1, h1;
            .reg .b32 a0, a1, a2, a3;
            mov.b32 {l0, h0}, $4;
            mov.b32 {l1, h1}, $5;
            cvt.rn.f16x2.e4m3x2 a0, l0;
            cvt.rn.f16x2.e4m3x2 a2, h0;
            cvt.rn.f16x2.e4m3x2 a1, l1;
            cvt.rn.f16x2.e4m3x2 a3, h1;
            mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$6, $7}, {$8, $9, $10, $11};
            }""",
            constraints="=f,=f,=f,=f,r,r,r,r,f,f,f,f",
            args=[wa, wb, tl.broadcast_to(b0, (RT, NW * 32)), tl.broadcast_to(b1, (RT, NW * 32)), c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo0, lo1 = _emu_cols(_emu_rows(wa, b0, b1, RT, NW), RT, NW)
        hi0, hi1 = _emu_cols(_emu_rows(wb, b0, b1, RT, NW), RT, NW)
        d0, d1, d2, d3 = c0 + lo0, c1 + lo1, c2 + hi0, c3 + hi1
    return d0, d1, d2, d3


@triton.jit
def _w_words(wp, row_lo, row_hi, ok_lo, ok_hi, kw, lane_kw, kw_end, stride_ww, GPU: tl.constexpr):
    """The lane's 16 codes of rows row_lo and row_hi in the chunk at word offset kw (the lane's part:
    words lane_kw + 0..3): two [RT, T, 4] int32 tiles, masked off past K's end or N."""
    j = tl.arange(0, 4)[None, None, :]
    if GPU:
        more = kw < kw_end
    else:  # the interpreter refuses a 0-d mask broadcast: a full-shape compare instead
        more = (kw + lane_kw[:, :, None] * 0 + j * 0) < kw_end
    offs = kw + lane_kw[:, :, None] + j
    lo = tl.load(wp + row_lo[:, :, None].to(tl.int64) * stride_ww + offs, mask=ok_lo[:, :, None] & more, other=0)
    hi = tl.load(wp + row_hi[:, :, None].to(tl.int64) * stride_ww + offs, mask=ok_hi[:, :, None] & more, other=0)
    return lo, hi


@triton.jit
def _x_words(x_ptr, g, t, M, kw, kw_end, stride_xl, X_BF16: tl.constexpr, GPU: tl.constexpr):
    """x[token g, 16t .. 16t + 16) of the chunk at word offset kw (W's words: 4 channels each) as
    raw data: bf16 x, two [1, T, 4] int32 tiles (8 bf16 pairs); fp32 x, four [1, T, 4] fp32 tiles.
    stride_xl: x's row stride in those loads' units (int32 words for bf16)."""
    j = tl.arange(0, 4)[None, None, :]
    row_ok = (g < M)[None, :, None]
    if GPU:
        mask = row_ok & (kw < kw_end)
    else:
        mask = row_ok & ((kw + t[None, :, None] * 0 + j * 0) < kw_end)
    if X_BF16:
        # bf16 pairs as int32 words: channels 4 kw + 16 t + 2 i, 2 i + 1 in word i (8 per lane)
        base = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + g[None, :, None].to(tl.int64) * stride_xl
        base += 2 * kw + 8 * t[None, :, None] + j
        xa = tl.load(base, mask=mask, other=0)
        xb = tl.load(base + 4, mask=mask, other=0)
        xc = 0
        xd = 0
    else:
        base = x_ptr + g[None, :, None].to(tl.int64) * stride_xl + 4 * kw + 16 * t[None, :, None] + j
        xa = tl.load(base, mask=mask, other=0.0)
        xb = tl.load(base + 4, mask=mask, other=0.0)
        xc = tl.load(base + 8, mask=mask, other=0.0)
        xd = tl.load(base + 12, mask=mask, other=0.0)
    return xa, xb, xc, xd  # one return: the compiler checks every return's type, constexpr-dead ones too


@triton.jit
def _x_pairs(xa, xb, xc, xd, X_BF16: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """`_x_words`' data -> the 8 B-fragment words of the chunk (f16 pairs of x * 2^-8; word i holds
    the lane's channels 2i, 2i + 1), each [1, T]."""
    if X_BF16:
        w0, w1, w2, w3 = _four(xa, 1, T)
        w4, w5, w6, w7 = _four(xb, 1, T)
        a0, a1 = bf16_pair(w0)
        b0, b1 = bf16_pair(w1)
        c0, c1 = bf16_pair(w2)
        d0, d1 = bf16_pair(w3)
        e0, e1 = bf16_pair(w4)
        f0, f1 = bf16_pair(w5)
        g0, g1 = bf16_pair(w6)
        h0, h1 = bf16_pair(w7)
    else:
        a0, a1, b0, b1 = _four(xa, 1, T)
        c0, c1, d0, d1 = _four(xb, 1, T)
        e0, e1, f0, f1 = _four(xc, 1, T)
        g0, g1, h0, h1 = _four(xd, 1, T)
    s = 0.00390625  # 2^-8: f16's range would cap x at 65504
    return (_f16x2(a0 * s, a1 * s, ASM), _f16x2(b0 * s, b1 * s, ASM), _f16x2(c0 * s, c1 * s, ASM),
            _f16x2(d0 * s, d1 * s, ASM), _f16x2(e0 * s, e1 * s, ASM), _f16x2(f0 * s, f1 * s, ASM),
            _f16x2(g0 * s, g1 * s, ASM), _f16x2(h0 * s, h1 * s, ASM))


@triton.jit
def _fp8_mma_gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K_WORDS, SPLIT_WORDS, stride_xl, stride_ww, stride_om,
    RT: tl.constexpr,  # row tiles of 16 per warp (x's conversion is shared by all of them)
    NUM_WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_OUT: tl.constexpr,  # W = [gate | up]: lane rows g and g + 8 are an output's gate and up rows
    X_BF16: tl.constexpr,
    Y_DT: tl.constexpr,
    OUT_DT: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,  # GPU: inline PTX; False: the interpreter's emulation
):
    T: tl.constexpr = 32 * NUM_WARPS
    BLOCK_N: tl.constexpr = 16 * RT * NUM_WARPS  # W rows per program
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g, t, tile = _mma_lanes(RT, NUM_WARPS)  # tile [RT, T]: the thread's row tiles
    if SILU_OUT:
        F = N // 2
        col = pid_n * (BLOCK_N // 2) + tile * 8 + g[None, :]  # 8 outputs per tile
        row_lo = col
        row_hi = col + F
        ok_lo = col < F
        ok_hi = ok_lo
    else:
        row_lo = pid_n * BLOCK_N + tile * 16 + g[None, :]
        row_hi = row_lo + 8
        ok_lo = row_lo < N
        ok_hi = row_hi < N
    wp = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    kw_begin = pid_k * SPLIT_WORDS
    kw_end = tl.minimum(kw_begin + SPLIT_WORDS, K_WORDS)
    lane_kw = (4 * t)[None, :] + tl.zeros((RT, T), dtype=tl.int32)  # the lane's words in a chunk
    # the first chunks' W before the dependency wait: weights never depend on the previous kernel.
    # W runs three chunks ahead of the one being multiplied: with one (run 74) the loop waited on
    # DRAM each step, two (run 75) still kept only ~2 KB per warp in flight (ncu, run 78)
    wa, wb = _w_words(wp, row_lo, row_hi, ok_lo, ok_hi, kw_begin, lane_kw, kw_end, stride_ww, ASM)
    wa1, wb1 = _w_words(wp, row_lo, row_hi, ok_lo, ok_hi, kw_begin + 16, lane_kw, kw_end, stride_ww, ASM)
    wa2, wb2 = _w_words(wp, row_lo, row_hi, ok_lo, ok_hi, kw_begin + 32, lane_kw, kw_end, stride_ww, ASM)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xa, xb, xc, xd = _x_words(x_ptr, g, t, M, kw_begin, kw_end, stride_xl, X_BF16, ASM)
    c0 = tl.zeros((RT, T), dtype=tl.float32)
    c1 = tl.zeros((RT, T), dtype=tl.float32)
    c2 = tl.zeros((RT, T), dtype=tl.float32)
    c3 = tl.zeros((RT, T), dtype=tl.float32)
    for kw in range(kw_begin, kw_end, 16):
        # chunk kw + 48's W and kw + 16's x issued before this one is consumed (masked off past the end)
        wa3, wb3 = _w_words(wp, row_lo, row_hi, ok_lo, ok_hi, kw + 48, lane_kw, kw_end, stride_ww, ASM)
        xa_next, xb_next, xc_next, xd_next = _x_words(x_ptr, g, t, M, kw + 16, kw_end, stride_xl, X_BF16, ASM)
        p0, p1, p2, p3, p4, p5, p6, p7 = _x_pairs(xa, xb, xc, xd, X_BF16, T, ASM)
        lo0, lo1, lo2, lo3 = _four(wa, RT, T)  # word s: the codes of mma step s
        hi0, hi1, hi2, hi3 = _four(wb, RT, T)
        c0, c1, c2, c3 = _mma(c0, c1, c2, c3, lo0, hi0, p0, p1, RT, NUM_WARPS, ASM)
        c0, c1, c2, c3 = _mma(c0, c1, c2, c3, lo1, hi1, p2, p3, RT, NUM_WARPS, ASM)
        c0, c1, c2, c3 = _mma(c0, c1, c2, c3, lo2, hi2, p4, p5, RT, NUM_WARPS, ASM)
        c0, c1, c2, c3 = _mma(c0, c1, c2, c3, lo3, hi3, p6, p7, RT, NUM_WARPS, ASM)
        wa = wa1
        wb = wb1
        wa1 = wa2
        wb1 = wb2
        wa2 = wa3
        wb2 = wb3
        xa = xa_next
        xb = xb_next
        xc = xc_next
        xd = xd_next

    tok0, tok1, m0, m1, n0, n1 = _fragment_masks(t, ok_lo, ok_hi, M, RT, NUM_WARPS)
    if SPLIT_K > 1:
        last, c0, c1, c2, c3 = _split_k_fragments(c0, c1, c2, c3, row_lo, row_hi, tok0, tok1, m0, m1, n0, n1, ws_ptr,
                                                  cnt_ptr, pid_n, M, N, SPLIT_K)
        if last:
            _epilogue(c0, c1, c2, c3, row_lo, row_hi, ok_lo, ok_hi, tok0, tok1, m0, m1, n0, n1, w_scale_ptr, out_ptr,
                      stride_om, SILU_OUT, Y_DT, OUT_DT)
    else:
        _epilogue(c0, c1, c2, c3, row_lo, row_hi, ok_lo, ok_hi, tok0, tok1, m0, m1, n0, n1, w_scale_ptr, out_ptr,
                  stride_om, SILU_OUT, Y_DT, OUT_DT)


@triton.jit
def _epilogue(c0, c1, c2, c3, row_lo, row_hi, ok_lo, ok_hi, tok0, tok1, m0, m1, n0, n1, w_scale_ptr, out_ptr,
              stride_om, SILU_OUT: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr):
    """Sums -> outputs: times 2^8 (x's scaling) and the per-channel scales, rounded to the linear's
    dtype as x @ w.t() stores it; SILU_OUT: silu(gate row) * up row with fused.silu_mul's roundings.
    m0, m1, n0, n1: the kernel's store masks of c0..c3 (row in range, token < M)."""
    s_lo = 256.0 * tl.load(w_scale_ptr + row_lo, mask=ok_lo, other=0.0)
    s_hi = 256.0 * tl.load(w_scale_ptr + row_hi, mask=ok_hi, other=0.0)
    y0 = round_to(c0 * s_lo, Y_DT)
    y1 = round_to(c1 * s_lo, Y_DT)
    y2 = round_to(c2 * s_hi, Y_DT)
    y3 = round_to(c3 * s_hi, Y_DT)
    ty = out_ptr.dtype.element_ty
    if SILU_OUT:  # row_lo is output column row_lo's gate row, row_hi its up row
        tl.store(out_ptr + tok0.to(tl.int64) * stride_om + row_lo, silu_mul_rounded(y0, y2, Y_DT, OUT_DT).to(ty),
                 mask=m0)
        tl.store(out_ptr + tok1.to(tl.int64) * stride_om + row_lo, silu_mul_rounded(y1, y3, Y_DT, OUT_DT).to(ty),
                 mask=m1)
    else:
        tl.store(out_ptr + tok0.to(tl.int64) * stride_om + row_lo, round_to(y0, OUT_DT).to(ty), mask=m0)
        tl.store(out_ptr + tok1.to(tl.int64) * stride_om + row_lo, round_to(y1, OUT_DT).to(ty), mask=m1)
        tl.store(out_ptr + tok0.to(tl.int64) * stride_om + row_hi, round_to(y2, OUT_DT).to(ty), mask=n0)
        tl.store(out_ptr + tok1.to(tl.int64) * stride_om + row_hi, round_to(y3, OUT_DT).to(ty), mask=n1)


def mma_usable(M: int, K: int) -> bool:
    """Shapes the kernel takes: up to 8 tokens (the mma's N), K in whole 64-channel chunks."""
    return 1 <= M <= MMA_TOKENS and K % CHUNK == 0


def w_aligned(w: torch.Tensor) -> bool:
    """Whether the kernel can read this e4m3 weight's rows in 16-byte vectors."""
    return w.stride(-1) == 1 and w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0


def launch(x, w, w_scale, out, cfg, *, silu_out: bool, use_pdl: bool, y_dt, out_dt, split: int) -> torch.Tensor:
    """Launch for gemv._launch (which has checked the operands and made `out`): cfg.block_n rows per
    program = 16 * row tiles per warp * num_warps."""
    M, K = x.shape
    N = w.shape[0]
    if not mma_usable(M, K):
        raise ValueError(f"the fp8 mma GEMV takes 1 <= M <= {MMA_TOKENS} and K % {CHUNK} == 0, got M = {M}, "
                         f"K = {K}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"the fp8 mma GEMV takes bf16 or fp32 x, got {x.dtype}")
    if (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # 16-byte rows for the vector loads (a fresh
        # allocation is aligned; decode rows are a few KB)
    if not w_aligned(w):
        raise ValueError("the fp8 mma GEMV reads W in 16-byte vectors: rows must be 16-byte aligned")
    rows_per_warp = cfg.block_n // cfg.num_warps
    if rows_per_warp % 16 or cfg.block_k != CHUNK:
        raise ValueError(f"an mma config has 16 rows per tile and BLOCK_K {CHUNK}, got {cfg}")
    split_words = triton.cdiv(K, split * CHUNK) * (CHUNK // 4)
    tiles = triton.cdiv(N // 2, cfg.block_n // 2) if silu_out else triton.cdiv(N, cfg.block_n)
    ws, cnt = G._workspace(x.device, split * M * N if split > 1 else 0, tiles)
    kw = dict(launch_pdl=True) if use_pdl else {}
    launch_kernel(_fp8_mma_gemv_kernel, (tiles, split),
        x, w, w_scale, out, ws, cnt, M, N, K // 4, split_words,
        x.stride(0) // 2 if x.dtype == torch.bfloat16 else x.stride(0), w.stride(0) // 4, out.stride(0),
        RT=rows_per_warp // 16, NUM_WARPS=cfg.num_warps, SPLIT_K=split, SILU_OUT=silu_out,
        X_BF16=x.dtype == torch.bfloat16, Y_DT=G.tl_dtype(y_dt), OUT_DT=G.tl_dtype(out_dt), PDL=use_pdl,
        ASM=not G._INTERPRET, num_warps=cfg.num_warps, num_stages=1, **kw)
    return out
