"""Weight-streaming GEMV for decode: y = x @ W^T at decode M (1..128), W [N, K] bf16 read once.

    gemv(x, w)                                  x [M, K] -> [M, N]
    gemv_residual(x, w, residual, scale)        residual + y * scale       (TorchBackend.add_rms_norm's add)
    gemv_rmsnorm(x, norm_w, eps, w)             rms_norm(x, norm_w, eps) @ W^T
    gemv_silu_mul(gate_up, w, residual=, scale=)  silu_mul(gate_up) @ W^T [then the residual epilogue]
    gemv_silu_out(x, w_gate_up)                 silu_mul(x @ W^T) (the silu_mul epilogue)
    linear(x, w)                                GEMV or cuBLAS, whichever `calibrate` measured faster
    calibrate(shapes, device)                   times both per (M bucket, N, K) inside CUDA graphs

Why not cuBLAS: at M <= 16 a linear layer is a pure weight stream (2*N*K bytes, ~1 FLOP/byte).
The whole decode step is 18.35 GB of bf16 weights, 4.30 ms at 4.27 TB/s; cuBLAS M=1 GEMMs take
4.99 ms in a graph, mostly lost on the 4096x4096 matrices (launch and tail bound) and in the gaps.

Batch 17..128 (`DOT_MAX_M`; tensor-core path only, plain GEMV and residual epilogue, the prologues
stop at GEMV_MAX_M = 16): still weight-bound (M FLOPs per weight byte, 128 against the H200's ~230
at the balance point), but cuBLAS tiles these as GEMMs: at M = 128 and N = 4096 it launches ~32
output tiles on 132 SMs (o_proj 15 us against a 7.9 us floor, down 39.6 us plus a separate split-K
reduce against 31.8). Here the DOT program takes BLOCK_M = M's power-of-two bucket (32, 64, 128)
and a small explicit split-K per config (1, 2, 4; the automatic split aims at 8 programs per SM,
far too many partials at 128 rows: they cost split * M * N * 4 bytes, 25% of W's bytes at M = 128,
K = 4096, split 4), reduced in the same launch as below. `calibrate` decides per (M bucket, N, K)
whether it beats cuBLAS; uncalibrated shapes above M = 8 stay on cuBLAS.

Kernel shape. One program owns BLOCK_N output columns (rows of W) for ALL M rows of x, so W is
read exactly once whatever M is, and one contiguous K range (split-K). The grid is sized for
several programs per SM (Little's law: 4.27 TB/s x ~1 us loaded latency wants ~32 KB of loads in
flight per SM); small N (4096) is split over K to get there. Inner paths, chosen by the config:
  - FMA (M <= FMA_MAX_M = 8): W tile [BN, BK] with BK = 256 * num_warps, so each thread holds exactly one
    16-byte vector (8 bf16 along K) per W row, and x's [BM, BK] slice lands in the same thread
    mapping (8 values per thread and row): no shuffles or shared memory inside the loop.
    acc[BM, BN, BK] += w * x in fp32 registers, reduced over K once after the loop. The next W
    tile is loaded before the current one is consumed (two tiles in flight per thread).
  - DOT (any M <= DOT_MAX_M = 128): tensor cores, acc[BN, BM] += W_tile @ x_tile^T with
    BM = max(16, M's bucket) (x padded with zero rows; W is the MMA's 64/128-row side, so Hopper's
    wgmma applies). Triton pipelines the W (and x) tiles into shared memory with 16-byte cp.async
    (num_stages deep): few registers, deep queues.
  - fp8 weights (`gemv_fp8`, M <= 8; quant_gemm's default decode kernel where its calibration
    measures it faster than w8a16): the FMA structure on e4m3 codes read as int32 words, each word
    converted by inline PTX (cvt.rn.f16x2.e4m3x2, then f16 -> f32), x read as int64 words of 4 bf16
    in the same thread mapping; a program walks its BLOCK_N rows one (or, BLOCK_N even, a pair)
    at a time in one pipelined loop, per-channel scales on the sums (`_fp8_sums`).
    Or (`stream` configs, one or two rows of x) all of a program's BLOCK_N rows per K step in one
    plain loop whose loads Triton's software pipeliner turns into cp.async copies 3-5 steps ahead
    in shared memory (`_fp8_stream_sums`): more bytes in flight per warp than registers allow,
    which wins the large shapes at one row.
fp32 accumulation everywhere (tensor cores accumulate in fp32 too).

Split-K reduction: "last program reduces", inside the same launch. Every split stores its fp32
partial [M, BN] in a workspace, bumps a per-column-tile counter (acq_rel atomic); the program
that arrives last sums the partials in split order (deterministic), applies the epilogue, writes
the output and re-arms the counter to 0. Chosen over the alternatives because inside a CUDA graph
every extra kernel costs ~4 us: a second reduction kernel would add one per linear, fp32 atomics
into a zeroed workspace would add a memset and a cast kernel (and be non-deterministic). The cost
here is split * M * N * 4 bytes of partials (0.4% of W's bytes at N = 4096, split 4) and one
small serial sum at the end of each column tile.

Workspace and counters: one pair per device, shared by every launch (kernels on one stream run in
order; with PDL every access happens after the grid-dependency wait, see below), allocated on the
first call outside graph capture. Run every shape once (or call `calibrate`) before capturing.
Graph capturable: no host syncs, no allocation except the output (or pass `out=`).

Fusions (each removes a whole ~4 us kernel per use, 32 layers):
  - residual epilogue: out = round(residual + round(round(y) * scale)) exactly as
    `residual + linear(x, w) * scale` in torch (y rounded to the linear's dtype first);
  - RMSNorm prologue: each program recomputes its rows' fp32 sum of squares over all of x (8 KB
    per row from L2) and normalises the x slices it uses: round(round(x * rstd) * norm_w), as
    reference.rms_norm; the statistics' summation order differs from torch's (as in fused.py);
  - silu_mul prologue (the down projection): x[k] = round(round(silu(gate[k])) * up[k]) from
    gate_up [M, 2K], computed only for the program's own K slice, as fused.silu_mul;
  - silu_mul epilogue (gemv_silu_out, the gate_up projection; one-row steps take it, where the
    prologue measured 0.41 ms slower per step): a column tile's W rows are its outputs' gate rows
    and the matching up rows, so it writes silu_mul of its own outputs, each computed once.
With these, a decode layer's linears chain as gemv_rmsnorm(qkv) | attention | gemv_residual(o) ->
gemv_rmsnorm(gate_up) -> gemv_silu_mul(down, residual): the add_rms_norm and silu_mul kernels
disappear (3 of the 7 linear-side kernels per layer).

PDL (programmatic dependent launch, sm_90, on by default; `_triton_utils.set_pdl(False)` turns it
off, for fused.py's row kernels too): the kernel is launched
so that it may start while the previous kernel in the stream is still finishing. The FMA path
loads its first W tile (weights never depend on the previous kernel) and then waits
(griddepcontrol.wait) before touching x, the residual, the output or the workspace; the DOT path
waits first. Each program also signals at its start that the next PDL kernel may launch, so
back-to-back GEMVs overlap one's ramp-up with the other's tail. The benchmark compares with and
without.

Numerics: fp32 accumulation (FMA, or the tensor cores' fp32 accumulate), one rounding to bf16 at
the end; the summation order differs from cuBLAS's, so results differ from `x @ w.t()` by about
one bf16 ulp on some elements (tests/test_kernels_gemv.py writes the bound down). Deterministic:
the same config gives the same bits on every run, split-K included.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import (bf16_pair, pdl_enabled, pdl_supported, promote, round_to, rsqrt_rn,
                                             silu_mul_rounded, tl_dtype, write_silu_tile)
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.device_buffers import Want, persistent_buffers
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.kernels.tuning import Family, PickTable, Stopwatch, Trial, m_bucket, tune

GEMV_MAX_M = 16  # largest M of the fused prologues (each program recomputes its rows' statistics)
# largest M of the plain GEMV / residual epilogue (tensor-core path, BLOCK_M <= 128, a power of two);
# the calibration decides per shape against cuBLAS (the GEMV won at 32 rows, cuBLAS at 128)
DOT_MAX_M = 128

# prologue kinds (constexpr PROLOGUE)
_NONE, _RMS, _SILU = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Kernel pieces
# ---------------------------------------------------------------------------------------------


@triton.jit
def _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per row [BLOCK_M], fp32 statistics over the whole row."""
    ss = tl.zeros((BLOCK_M, BLOCK), dtype=tl.float32)
    rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        x = tl.load(rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K), other=0.0).to(tl.float32)
        ss += x * x
    return rsqrt_rn(tl.math.div_rn(tl.sum(ss, axis=1), K.to(tl.float32)) + eps)


@triton.jit
def _x_tile(x_ptr, nw_ptr, rows, kk, row_mask, k_mask, rstd, stride_xm, K,
            PROLOGUE: tl.constexpr, X_DT: tl.constexpr, XN_DT: tl.constexpr):
    """GEMV input values (fp32) at rows x kk (broadcastable index tensors), after the prologue.
    k_mask None: every kk is in range. rstd broadcasts like rows (RMSNorm prologue only)."""
    base = x_ptr + rows.to(tl.int64) * stride_xm
    if k_mask is None:
        mask = row_mask
    else:
        mask = row_mask & k_mask
    if PROLOGUE == 2:
        # silu_mul: x = [gate | up] with K columns each; roundings as fused.silu_mul
        gate = tl.load(base + kk, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + K + kk, mask=mask, other=0.0).to(tl.float32)
        return silu_mul_rounded(gate, up, X_DT, X_DT)
    x = tl.load(base + kk, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        # reference.rms_norm: normalised value rounded to x's dtype, times the weight
        if k_mask is None:
            nw = tl.load(nw_ptr + kk).to(tl.float32)
        else:
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        x = round_to(round_to(x * rstd, X_DT) * nw, XN_DT)
    return x


@triton.jit
def _e4m3_to_f32_bits(words, byte: tl.constexpr):
    """Code `byte` of each int32 word as fp32, by integer operations (exact, subnormals included):
    the 7 magnitude bits placed at fp32's exponent/mantissa bits 26..20 read as |w| * 2^-120."""
    b = (words >> (8 * byte)) & 0xFF
    mag = ((b & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
    return tl.where(b >= 128, -mag, mag)


@triton.jit
def _e4m3_words_to_f32(words, ASM: tl.constexpr):
    """int32 words of 4 e4m3 codes -> 4 fp32 tensors of words' shape (codes 0..3, memory order).
    ASM: two cvt.rn.f16x2.e4m3x2 and four f16 -> f32 converts per word (1.5 instructions per
    weight, no byte shuffles). Triton's own cast of a byte tile spent ~7.5 loop instructions per
    weight on sm_90 (byte extracts and repacks around the same cvts) and capped the kernel near
    2 TB/s. The bit-op variant serves the interpreter, which has no inline asm."""
    if ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {a, b}, p;
            mov.b32 {c, d}, q;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True, pack=1)
        return (w0.to(tl.float32, bitcast=True), w1.to(tl.float32, bitcast=True),
                w2.to(tl.float32, bitcast=True), w3.to(tl.float32, bitcast=True))
    return (_e4m3_to_f32_bits(words, 0), _e4m3_to_f32_bits(words, 1), _e4m3_to_f32_bits(words, 2),
            _e4m3_to_f32_bits(words, 3))


@triton.jit
def _x_quads(x_ptr, rows, kw, mask, stride_xm, X_WORDS: tl.constexpr):
    """x[rows, 4 kw + j] for j = 0..3 as 4 fp32 tensors shaped like kw (the words' layout).
    X_WORDS (bf16 x, 8-byte aligned rows): one int64 per 4 values, so x arrives in the W words'
    thread mapping (no shared memory) and bf16 -> fp32 is a shift or a mask."""
    if X_WORDS:
        quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + rows.to(tl.int64) * (stride_xm // 4)
        v = tl.load(quads + kw, mask=mask, other=0)
        x0, x1 = bf16_pair(v.to(tl.int32))
        x2, x3 = bf16_pair((v >> 32).to(tl.int32))
        return x0, x1, x2, x3
    base = x_ptr + rows.to(tl.int64) * stride_xm + 4 * kw
    return (tl.load(base, mask=mask, other=0.0).to(tl.float32), tl.load(base + 1, mask=mask, other=0.0).to(tl.float32),
            tl.load(base + 2, mask=mask, other=0.0).to(tl.float32), tl.load(base + 3, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _fp8_row(pid_n, j, N, BLOCK_N: tl.constexpr, SILU_OUT: tl.constexpr):
    """(W row of the tile's j-th column, whether it exists): the kernel's offs_n and n_mask for
    one column, SILU_OUT's row map included; j = BLOCK_N (past the tile) does not exist."""
    if SILU_OUT:
        col = pid_n * (BLOCK_N // 2) + j % (BLOCK_N // 2)
        return col + (j // (BLOCK_N // 2)) * (N // 2), (j < BLOCK_N) & (col < N // 2)
    return pid_n * BLOCK_N + j, (j < BLOCK_N) & (pid_n * BLOCK_N + j < N)


@triton.jit
def _tile_mask(ok, kw, kw_end, EVEN_K: tl.constexpr, GPU: tl.constexpr):
    """Load mask of one row's W tile: the row's scalar `ok`, and K's end unless EVEN_K. (The
    interpreter's masked load wants a full-shape mask: there the scalar is widened by a compare.)"""
    if GPU:
        if EVEN_K:
            mask = ok
        else:
            mask = ok & (kw < kw_end)
    else:
        # the interpreter broadcasts a 0-d int1 tensor to int32, which its load refuses; where() does not
        mask = tl.where(ok, kw < kw_end, False)
    return mask  # one return: the compiler checks every return's type, constexpr-dead ones included


@triton.jit
def _fp8_tile(wp, pid_n, j, kn, kt, kw_end, N, stride_wn, N_COLS: tl.constexpr, BLOCK_N: tl.constexpr,
              EVEN_K: tl.constexpr, SILU_OUT: tl.constexpr, GPU: tl.constexpr):
    """The int32 W words [1, 1, BK / 4] of the tile's column j at word offset kn; all lanes masked
    off for a column past N_COLS (the loop's prefetch after its last step) or past N."""
    row, ok = _fp8_row(pid_n, j, N, BLOCK_N, SILU_OUT)
    nk = kn + kt
    return tl.load(wp + row.to(tl.int64) * (stride_wn // 4) + nk,
                   mask=_tile_mask(ok & (j < N_COLS), nk, kw_end, EVEN_K, GPU), other=0)


@triton.jit
def _fp8_step_tiles(wp, pid_n, j, kn, kt, kw_end, N, stride_wn, N_COLS: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_K: tl.constexpr, SILU_OUT: tl.constexpr, PAIRS: tl.constexpr, GPU: tl.constexpr):
    """One loop step's W tiles: column j's, and (PAIRS) column j + N_COLS's (else column j's again)."""
    wa = _fp8_tile(wp, pid_n, j, kn, kt, kw_end, N, stride_wn, N_COLS, BLOCK_N, EVEN_K, SILU_OUT, GPU)
    if PAIRS:
        wb = _fp8_tile(wp, pid_n, j + N_COLS, kn, kt, kw_end, N, stride_wn, BLOCK_N, BLOCK_N, EVEN_K, SILU_OUT, GPU)
    else:
        wb = wa
    return wa, wb


@triton.jit
def _fp8_acc(acc, words, x0, x1, x2, x3, ASM: tl.constexpr):
    """acc + the products of the words' 4 codes with x's 4 matching values (4 fp32 FMAs each)."""
    w0, w1, w2, w3 = _e4m3_words_to_f32(words, ASM)
    acc += w0 * x0
    acc += w1 * x1
    acc += w2 * x2
    acc += w3 * x3
    return acc


@triton.jit
def _fp8_sums(x_ptr, w_ptr, w_scale_ptr, offs_m, m_mask, offs_n, n_mask, pid_n, N, k_begin, k_end, stride_xm,
              stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              PDL: tl.constexpr, X_WORDS: tl.constexpr, ASM: tl.constexpr, SILU_OUT: tl.constexpr,
              PAIRS: tl.constexpr):
    """The FMA path for fp8 weights: w_scale[n] * sum_k x[m, k] w[n, k] over [k_begin, k_end) for
    the tile's BN columns -> [BM, BN] fp32. W is read as int32 words of 4 codes (BK = 512 * num_warps
    * vectors: whole 16-byte vectors per thread) and x as the matching 4 values per word, so every
    operand has the words' thread mapping. One pipelined loop walks (column, K tile), the next
    step's W tiles issued before this step's are consumed; PAIRS (BN even): each step takes
    columns j and j + BN/2 together, so x's loads and bf16 -> fp32 shifts serve two rows (SILU_OUT:
    an output's gate and up rows). W tiles of one row each ([1, 1, BK / 4]: a [BN, BK / 4] tile
    puts x through shared memory every iteration); a program streams BN rows, so the grid's launch
    and tail costs are paid once per BN rows."""
    N_COLS: tl.constexpr = BLOCK_N // 2 if PAIRS else BLOCK_N  # columns walked (the first of each pair)
    kt = tl.arange(0, BLOCK_K // 4)[None, None, :]
    wp = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rows = offs_m[:, None, None]
    row_mask = m_mask[:, None, None]
    kw_begin = k_begin // 4
    kw_end = k_end // 4  # K % 4 == 0 (the launcher checks)
    # first W tiles before the dependency wait: weights never depend on the previous kernel
    j0 = tl.full((), 0, tl.int32)  # a tensor: its compares are masks
    wa, wb = _fp8_step_tiles(wp, pid_n, j0, kw_begin, kt, kw_end, N, stride_wn, N_COLS, BLOCK_N, EVEN_K, SILU_OUT,
                             PAIRS, ASM)
    scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)  # off the tail's critical path
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc_a = tl.zeros((BLOCK_M, 1, BLOCK_K // 4), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, 1, BLOCK_K // 4), dtype=tl.float32)
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)[None, :]
    j = 0  # this step's column and word offset; jn, kn: the next step's (prefetched) tiles
    kq = kw_begin
    jn = j0
    kn = kw_begin
    n_steps = N_COLS * tl.cdiv(kw_end - kw_begin, BLOCK_K // 4)
    for _ in range(n_steps):
        kw = kq + kt
        x0, x1, x2, x3 = _x_quads(x_ptr, rows, kw, row_mask if EVEN_K else row_mask & (kw < kw_end), stride_xm,
                                  X_WORDS)
        kn += BLOCK_K // 4
        if kn >= kw_end:
            kn = kw_begin
            jn += 1
        # the next step's tiles (past the last column: masked off): two steps in flight
        wa_next, wb_next = _fp8_step_tiles(wp, pid_n, jn, kn, kt, kw_end, N, stride_wn, N_COLS, BLOCK_N, EVEN_K,
                                           SILU_OUT, PAIRS, ASM)
        acc_a = _fp8_acc(acc_a, wa, x0, x1, x2, x3, ASM)
        if PAIRS:
            acc_b = _fp8_acc(acc_b, wb, x0, x1, x2, x3, ASM)
        wa = wa_next
        wb = wb_next
        kq += BLOCK_K // 4
        if kq >= kw_end:  # column j's K range done: its sum (and its pair's) go to y
            y = tl.where(cols == j, tl.sum(acc_a, axis=2), y)
            acc_a = tl.zeros((BLOCK_M, 1, BLOCK_K // 4), dtype=tl.float32)
            if PAIRS:
                y = tl.where(cols == j + N_COLS, tl.sum(acc_b, axis=2), y)
                acc_b = tl.zeros((BLOCK_M, 1, BLOCK_K // 4), dtype=tl.float32)
            kq = kw_begin
            j += 1
    # per output channel; a split's scaled partial adds up like the unscaled ones
    return y * scale[None, :]


@triton.jit
def _fp8_stream_sums(x_ptr, w_ptr, w_scale_ptr, offs_m, m_mask, offs_n, n_mask, k_begin, k_end, stride_xm,
                     stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr, X_WORDS: tl.constexpr, ASM: tl.constexpr,
                     STAGES: tl.constexpr):
    """fp8 weights through a deep cp.async pipeline (a `stream` config): the same per-word math as
    `_fp8_sums` (int32 words of 4 codes, cvt-converted, fp32 FMAs against x's 4 matching values),
    but all BN rows' [BN, BK / 4] word tiles of a K step are one load that Triton's software
    pipeliner streams into shared memory STAGES - 1 steps ahead. Why: ncu put the
    register-prefetch loop at ~2 KB in flight per warp and 59% DRAM busy; queued copies in shared
    memory hold no registers, so a CTA keeps (STAGES - 1) * BN * BK bytes in flight. PDL: the
    pipeline's first copies carry x too, so they wait for the previous kernel (an L2 prefetch of
    the first stages before the wait measured 15-50% slower)."""
    kt = tl.arange(0, BLOCK_K // 4)[None, None, :]
    wp = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w_rows = wp + offs_n[None, :, None].to(tl.int64) * (stride_wn // 4)
    nm = n_mask[None, :, None]
    rows = offs_m[:, None, None]
    row_mask = m_mask[:, None, None]
    scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    kw_end = k_end // 4  # K % 4 == 0 (the launcher checks)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    for kq in tl.range(k_begin // 4, kw_end, BLOCK_K // 4, num_stages=STAGES):
        kw = kq + kt
        words = tl.load(w_rows + kw, mask=nm if EVEN_K else nm & (kw < kw_end), other=0)
        x0, x1, x2, x3 = _x_quads(x_ptr, rows, kw, row_mask if EVEN_K else row_mask & (kw < kw_end), stride_xm,
                                  X_WORDS)
        acc = _fp8_acc(acc, words, x0, x1, x2, x3, ASM)
    # per output channel; a split's scaled partial adds up like the unscaled ones
    return tl.sum(acc, axis=2) * scale[None, :]


@triton.jit
def _write(y, offs_m, offs_n, mask, out_ptr, res_ptr, stride_om, stride_rm, scale,
           RESIDUAL: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr):
    """Final fp32 sums [BM, BN] -> output, with the residual epilogue if asked."""
    y = round_to(y, Y_DT)  # the linear's own output, as stored by x @ w.t()
    if RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        # torch's `residual + y * scale`: the product rounded to y's dtype, the sum to the result's
        y = round_to(r + round_to(y * scale, Y_DT), OUT_DT)
    else:
        y = round_to(y, OUT_DT)
    # values are exactly representable in OUT_DT now, so the cast below cannot round (the
    # interpreter's cast truncates; the GPU's rounds to nearest: both exact here)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, ws_ptr, cnt_ptr, w_scale_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, scale, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K == SPLIT_K * (a multiple of BLOCK_K): no K masks at all
    DOT: tl.constexpr,  # tensor-core path (BLOCK_M = max(16, M's bucket)) instead of FMAs
    PROLOGUE: tl.constexpr,  # 0 none, 1 RMSNorm of x, 2 silu_mul of x = [gate | up]
    RESIDUAL: tl.constexpr,
    X_DT: tl.constexpr,  # x's dtype (prologue roundings)
    XN_DT: tl.constexpr,  # GEMV input dtype after the prologue
    Y_DT: tl.constexpr,  # the linear's output dtype
    OUT_DT: tl.constexpr,  # stored dtype (promote(residual, y) with the epilogue)
    PDL: tl.constexpr,
    DOT_FP32: tl.constexpr = False,  # interpreter runs only
    W_SCALE: tl.constexpr = False,  # fp8 weights: y[n] = w_scale[n] * sum_k w[n, k] x[k] (FMA paths)
    SILU_OUT: tl.constexpr = False,  # W = [gate | up] (N = 2F rows): write silu_mul(y) [M, F] (write_silu_tile)
    FP8_ASM: tl.constexpr = True,  # fp8 codes -> fp32 by cvt instructions (_e4m3_words_to_f32); False: bit ops
    X_WORDS: tl.constexpr = False,  # fp8 path: bf16 x read as int64 words of 4 values (_x_quads)
    FP8_STREAM: tl.constexpr = False,  # fp8 path: all rows' tiles through the cp.async pipeline (_fp8_stream_sums)
    STAGES: tl.constexpr = 1,  # FP8_STREAM's pipeline depth
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # whole BLOCK_K tiles per split; the product keeps k offsets provably 16-byte aligned
    k_len = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_len
    if EVEN_K:
        k_end = k_begin + k_len  # provably a multiple of BLOCK_K: K masks stay uniform per tile
    else:
        k_end = tl.minimum(k_begin + k_len, K)
    if SILU_OUT:
        # tile pid_n owns outputs [pid_n * BN/2, +BN/2): its W rows are those gate rows, then the
        # matching up rows F + n, so the epilogue has both halves of every output it writes
        jj = tl.arange(0, BLOCK_N)
        col = pid_n * (BLOCK_N // 2) + jj % (BLOCK_N // 2)
        offs_n = tl.where(jj < BLOCK_N // 2, col, col + N // 2)
        n_mask = col < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    if PDL:
        # let the next PDL kernel in the stream start launching while this grid runs its last wave
        tl.extra.cuda.gdc_launch_dependents()

    if DOT:
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PROLOGUE == 1:
            rstd = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, 2048 // BLOCK_M)[:, None]
        else:
            rstd = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
        kt = tl.arange(0, BLOCK_K)[None, :]
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + kt
            k_mask = None if EVEN_K else kk < k_end
            w = tl.load(w_rows + kk, mask=n_mask[:, None] if EVEN_K else n_mask[:, None] & k_mask, other=0.0)
            xt = _x_tile(x_ptr, nw_ptr, offs_m[:, None], kk, m_mask[:, None], k_mask, rstd, stride_xm, K,
                         PROLOGUE, X_DT, XN_DT)
            if DOT_FP32:
                # the interpreter's tl.dot misreads bf16 operands; fp32 gives the same exact products
                acc = tl.dot(w.to(tl.float32), tl.trans(xt), acc, input_precision="ieee")
            else:
                # x values are exact in W's dtype (bf16 inputs, or bf16-rounded prologue output)
                acc = tl.dot(w, tl.trans(xt.to(w.dtype)), acc, input_precision="ieee")
        y = tl.trans(acc)  # [BM, BN]
    elif W_SCALE and FP8_STREAM:
        y = _fp8_stream_sums(x_ptr, w_ptr, w_scale_ptr, offs_m, m_mask, offs_n, n_mask, k_begin, k_end, stride_xm,
                             stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, X_WORDS, FP8_ASM, STAGES)
    elif W_SCALE:
        y = _fp8_sums(x_ptr, w_ptr, w_scale_ptr, offs_m, m_mask, offs_n, n_mask, pid_n, N, k_begin, k_end,
                      stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL, X_WORDS, FP8_ASM, SILU_OUT,
                      BLOCK_N % 2 == 0)
    else:
        # x [BM, 1, BK] against W [1, BN, BK]: acc [BM, BN, BK] in registers, reduced over K once
        # after the loop (BK = 256 * num_warps: one 16-byte W vector per thread and row, x's
        # slice in the same thread mapping)
        kt = tl.arange(0, BLOCK_K)[None, None, :]
        w_rows = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn
        nm = n_mask[None, :, None]
        rows = offs_m[:, None, None]
        row_mask = m_mask[:, None, None]
        # first W tile before the dependency wait: weights never depend on the previous kernel
        kk = k_begin + kt
        w = tl.load(w_rows + kk, mask=nm if EVEN_K else nm & (kk < k_end), other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        if PROLOGUE == 1:
            rstd = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, 2048 // BLOCK_M)[:, None, None]
        else:
            rstd = tl.zeros((BLOCK_M, 1, 1), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + kt
            nk = kk + BLOCK_K
            k_mask = None if EVEN_K else kk < k_end
            x = _x_tile(x_ptr, nw_ptr, rows, kk, row_mask, k_mask, rstd, stride_xm, K, PROLOGUE, X_DT, XN_DT)
            # the next tile is issued before this one is consumed: two tiles in flight per thread
            w_next = tl.load(w_rows + nk, mask=nm & (nk < k_end), other=0.0)
            acc += w.to(tl.float32) * x  # x broadcasts over W's rows, W over x's rows
            w = w_next
        y = tl.sum(acc, axis=2)  # [BM, BN]

    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if SILU_OUT:
            write_silu_tile(y, offs_m, m_mask, pid_n, N // 2, out_ptr, stride_om, BLOCK_M, BLOCK_N, Y_DT, OUT_DT)
        else:
            _write(y, offs_m, offs_n, mask, out_ptr, res_ptr, stride_om, stride_rm, scale, RESIDUAL, Y_DT, OUT_DT)
    else:
        # workspace [SPLIT_K, M, N] fp32; the last split of this column tile reduces
        part = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part + pid_k * M * N, y, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(y)
            for s in range(SPLIT_K):  # fixed order: deterministic whichever split came last
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if SILU_OUT:
                write_silu_tile(total, offs_m, m_mask, pid_n, N // 2, out_ptr, stride_om, BLOCK_M, BLOCK_N, Y_DT,
                            OUT_DT)
            else:
                _write(total, offs_m, offs_n, mask, out_ptr, res_ptr, stride_om, stride_rm, scale, RESIDUAL,
                       Y_DT, OUT_DT)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # re-armed for the next launch: no memset kernel


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. split_k 0: chosen from the grid size (`_auto_split`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    dot: bool = False
    stream: bool = False  # fp8 weights only: FMAs behind a num_stages-deep cp.async pipeline (_fp8_stream_sums)

    def __str__(self):
        kind = "dot" if self.dot else "stream" if self.stream else "fma"
        s = f"{kind} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}"
        return s + (f" split{self.split_k}" if self.split_k else "")


# Candidate configs, each checked by an sm_90 ahead-of-time compile (no spills, 16-byte W loads,
# no shared-memory layout conversion in the FMA loop; tests/test_kernels_gemv.py). FMA tiles use
# BLOCK_K = 256 * num_warps: every thread holds exactly one 16-byte vector per W row, and x's
# [.., BLOCK_K] slice then gets the same thread mapping (8 values per thread), so x needs no
# reshuffle through shared memory; per thread: BLOCK_N vectors of W (x2, prefetch) and
# BLOCK_M * BLOCK_N * 8 fp32 accumulators.
FMA_CONFIGS = {  # M bucket -> configs; sm_90 registers per thread in the comments
    1: (GemvConfig(4, 1024, 4), GemvConfig(2, 1024, 4), GemvConfig(4, 2048, 8)),  # 64, 40, 80
    2: (GemvConfig(2, 1024, 4),),  # 64
    4: (GemvConfig(1, 1024, 4), GemvConfig(2, 1024, 4)),  # 56, 96
    8: (GemvConfig(1, 1024, 4),),  # 102
}
FMA_MAX_M = 8  # above, the register accumulators get too many: tensor cores only
# fp8 weights (gemv_fp8, `_fp8_sums`): 16 weights per 16-byte vector, BLOCK_K = 512 * num_warps *
# vectors per thread and row; an even BLOCK_N walks its columns in pairs (x shared by two rows).
# Loop SASS at one row (sm_90): ~100 instructions per 16 weights of one row, ~170 per pair of rows,
# plus a cross-warp sum at each column's end; 31-80 registers.
FP8_FMA_CONFIGS = {
    # (2, 4096, 4) and (4, 4096, 8) spill
    1: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4), GemvConfig(4, 2048, 4), GemvConfig(2, 4096, 8)),
    2: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4)),
    4: (GemvConfig(1, 2048, 4), GemvConfig(2, 2048, 4)),
    8: (GemvConfig(1, 2048, 4),),
}
# fp8 weights behind a cp.async pipeline (`_fp8_stream_sums`): a program's BN rows x BK codes per
# loop step, num_stages deep in shared memory (BN * BK + 2 * BM * BK bytes per stage). Loop SASS
# at one row: 2.5 instructions per weight for the math (one cvt per code pair, an f16 -> f32 and
# an FFMA per weight) plus the loads and x's shifts, 3.6 in all at (16, 512) and 4.3 at (8, 512).
# Explicit splits: a split shortens every program's pipelined loop, and each program pays the
# pipeline's fill and drain; at one row split 1 was the fastest at every shape but down, where 2
# came close. At 8 rows the FFMAs per weight make it 1.1 TB/s (w8a16: 2-3.6): none there.
FP8_STREAM_CONFIGS = {
    1: (GemvConfig(8, 512, 4, 4, split_k=1, stream=True),  # 56 registers, 15 KB shared memory
        GemvConfig(16, 512, 4, 6, split_k=1, stream=True),  # 64, 45 KB
        GemvConfig(32, 512, 8, 4, split_k=1, stream=True),  # 78, 51 KB
        GemvConfig(8, 1024, 4, 4, split_k=1, stream=True),  # 72, 30 KB
        GemvConfig(8, 512, 4, 4, split_k=2, stream=True)),
    2: (GemvConfig(8, 512, 4, 4, split_k=1, stream=True),),  # 80 (split 2 spills 8 bytes here)
}
DOT_CONFIGS = (  # any M <= 16 (padded to 16); W pipelined through shared memory by cp.async
    GemvConfig(64, 128, 4, 4, dot=True),  # 48 registers, 80 KB shared memory
    GemvConfig(64, 256, 4, 3, dot=True),  # 80, 120 KB
    GemvConfig(128, 128, 4, 3, dot=True),  # 90, 108 KB
)
# M buckets 32..128 (BLOCK_M = the bucket): explicit splits (1, 2, 4), since the automatic one
# (8 programs per SM) would write split * M * N * 4 bytes of partials; W and x both pipelined
# (shared memory (BN + BM) * BK * 2 bytes per stage, <= 227 KB per block on sm_90). At N = 4096,
# BN 128 split 4 and BN 64 split 2 give 128 programs, BN 64 split 4 256 (two blocks fit per SM);
# split 1 for the wide N. sm_90 registers per thread (plain GEMV, its split; the residual
# epilogue and PDL add up to ~50, 218 at most) and shared memory in the comments. Rejected at
# M = 128: (128, 64, 4, 4) and (128, 128, 4, 3) spill with split 4, (64, 256, 4, 3) needs 288 KB.
DOT_LARGE_M_CONFIGS = {
    32: (GemvConfig(128, 128, 8, 3, split_k=1, dot=True),  # 56, 120 KB
         GemvConfig(128, 128, 8, 3, split_k=4, dot=True),  # 77
         GemvConfig(64, 128, 4, 4, split_k=1, dot=True),  # 64, 96 KB
         GemvConfig(64, 128, 4, 4, split_k=2, dot=True),  # 64
         GemvConfig(64, 128, 4, 4, split_k=4, dot=True)),  # 80
    64: (GemvConfig(128, 128, 8, 3, split_k=1, dot=True),  # 96, 144 KB
         GemvConfig(128, 128, 8, 3, split_k=4, dot=True),  # 119
         GemvConfig(64, 128, 4, 4, split_k=1, dot=True),  # 94, 128 KB
         GemvConfig(64, 128, 4, 4, split_k=2, dot=True),  # 126
         GemvConfig(64, 64, 4, 4, split_k=4, dot=True)),  # 119, 64 KB
    128: (GemvConfig(128, 64, 8, 4, split_k=1, dot=True),  # 109, 128 KB
          GemvConfig(128, 64, 8, 4, split_k=4, dot=True),  # 166
          GemvConfig(64, 64, 4, 4, split_k=1, dot=True),  # 122, 96 KB
          GemvConfig(64, 64, 4, 4, split_k=2, dot=True),  # 168
          GemvConfig(64, 64, 4, 4, split_k=4, dot=True)),  # 170
}

# the grid aims at this many programs per SM (several waves of loads in flight per SM)...
PROGRAMS_PER_SM = 8
# ...but no split shorter than this many K elements (each split's partials cost M*BN*4 bytes)
MIN_SPLIT_LEN = 512


@functools.lru_cache(maxsize=None)
def _device_info(device: str) -> tuple[int, int]:
    """(SM count, compute capability major); off-GPU (interpreter runs): an H200's."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count, torch.cuda.get_device_capability(dev)[0]
    return 132, 9


def _sm_count(device: torch.device) -> int:
    return _device_info(str(device))[0]


def _auto_split(N: int, K: int, cfg: GemvConfig, device: torch.device) -> int:
    """Power-of-two split of K giving ~PROGRAMS_PER_SM programs per SM, splits >= MIN_SPLIT_LEN
    long and whole BLOCK_K tiles."""
    tiles = triton.cdiv(N, cfg.block_n)
    want = max(1, PROGRAMS_PER_SM * _sm_count(device) // tiles)
    split = 1
    while split * 2 <= want and K // (split * 2) >= max(MIN_SPLIT_LEN, cfg.block_k):
        split *= 2
    return split


def default_config(M: int, N: int, K: int) -> GemvConfig:
    """Uncalibrated choice: FMA at M = 1, tensor cores above (M > 16: the bucket's first config)."""
    if M <= 1:
        return FMA_CONFIGS[1][0]
    return DOT_CONFIGS[0] if M <= GEMV_MAX_M else DOT_LARGE_M_CONFIGS[m_bucket(M)][0]


def candidate_configs(M: int) -> tuple[GemvConfig, ...]:
    """Configs `calibrate` times for an M bucket (each one Triton compile per shape)."""
    b = m_bucket(M)
    if b == 1:
        return FMA_CONFIGS[1] + DOT_CONFIGS[:1]
    if b > GEMV_MAX_M:
        return DOT_LARGE_M_CONFIGS[b]
    return FMA_CONFIGS.get(b, ()) + (DOT_CONFIGS if b > 8 else DOT_CONFIGS[:2])


def _split_useful(cfg: GemvConfig, N: int, device: torch.device) -> bool:
    """Whether a config's explicit split-K can pay off at this N: not when half of it would
    already give every SM a program (the split only adds partials then). Calibration skips the
    others (fewer compiles, a smaller workspace)."""
    return cfg.split_k <= 1 or triton.cdiv(N, cfg.block_n) * (cfg.split_k // 2) < _sm_count(device)


# ---------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------

_WORKSPACE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# 8 MB: M 16 x N 4096 x split 16 (small M), M 128 x N 4096 x split 4 (the largest calibrated
# large-M case: `_split_useful`); anything larger grows it (outside graph capture)
_WS_MIN_FLOATS = 1 << 21
_WS_MIN_COUNTERS = 1 << 14


def _workspace(device: torch.device, n_floats: int, n_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials and per-tile counters (zeroed once, re-armed by the kernels), one pair per
    device, grown outside graph capture only (device_buffers)."""
    return persistent_buffers(_WORKSPACE, device, (Want(n_floats, _WS_MIN_FLOATS, torch.float32),
                                                   Want(n_counters, _WS_MIN_COUNTERS, torch.int32, zeroed=True)),
                              "gemv workspace")


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x, w, *, out=None, residual=None, scale=1.0, norm_w=None, eps=0.0, prologue=_NONE,
            config: GemvConfig | None = None, pdl: bool | None = None, w_scale=None, silu_out: bool = False):
    w = _rows(w, "w")
    N, K = w.shape
    x = _rows(x, "x")
    M = x.shape[0]
    if x.shape[1] != (2 * K if prologue == _SILU else K):
        raise ValueError(f"x {tuple(x.shape)} does not match w {tuple(w.shape)}")
    if not 0 < M <= DOT_MAX_M:
        raise ValueError(f"gemv handles 1 <= M <= {DOT_MAX_M}, got M = {M}")
    if prologue != _NONE and M > GEMV_MAX_M:
        raise ValueError(f"the RMSNorm / silu_mul prologues take M <= {GEMV_MAX_M} (each program "
                         f"recomputes its rows' statistics), got M = {M}")
    xn_dt = promote(x.dtype, norm_w.dtype) if prologue == _RMS else x.dtype
    if w_scale is not None:
        if w.dtype != torch.float8_e4m3fn or w_scale.shape != (N,) or w_scale.dtype != torch.float32:
            raise TypeError(f"w_scale [N] fp32 goes with e4m3 weights, got {w.dtype} and "
                            f"{w_scale.dtype} {tuple(w_scale.shape)}")
        if prologue != _NONE:
            raise ValueError("fp8 weights take no prologue")
        if K % 4 or w.stride(0) % 4:
            raise ValueError(f"fp8 weights are read as int32 words: K and the row stride must be multiples "
                             f"of 4, got K = {K}, stride {w.stride(0)}")
        w_scale = w_scale.contiguous()
    elif xn_dt != w.dtype:
        raise TypeError(f"GEMV input dtype {xn_dt} must match the weight dtype {w.dtype}")
    y_dt = xn_dt if w_scale is not None else w.dtype
    out_dt = y_dt
    if residual is not None:
        residual = _rows(residual, "residual")
        if residual.shape != (M, N):
            raise ValueError(f"residual must be [{M}, {N}], got {tuple(residual.shape)}")
        out_dt = promote(residual.dtype, y_dt)
    n_out = N // 2 if silu_out else N
    if silu_out and (N % 2 or residual is not None):
        raise ValueError("the silu_mul epilogue takes an even number of weight rows [gate | up] and no residual")
    if out is None:
        out = torch.empty(M, n_out, dtype=out_dt, device=x.device)
    elif out.shape != (M, n_out) or out.dtype != out_dt or out.stride(-1) != 1:
        raise ValueError(f"out must be [{M}, {n_out}] {out_dt} with a unit last stride")

    cfg = config or choose_config(M, N, K, x.device)
    if silu_out and cfg.block_n % 2:
        raise ValueError(f"the silu_mul epilogue needs an even BLOCK_N, got {cfg}")
    if not cfg.dot and M > FMA_MAX_M:
        raise ValueError(f"FMA configs take M <= {FMA_MAX_M}, got M = {M} ({cfg})")
    if w_scale is not None and cfg.dot:
        raise ValueError(f"fp8 weights take the FMA and stream configs, not {cfg}")
    split = cfg.split_k or _auto_split(N, K, cfg, x.device)
    use_pdl = pdl_enabled(x.device) if pdl is None else bool(pdl) and pdl_supported(x.device)
    if cfg.stream and w_scale is None:
        raise ValueError(f"{cfg} takes fp8 weights")
    block_m = max(16, m_bucket(M)) if cfg.dot else m_bucket(M)
    tiles = triton.cdiv(n_out, cfg.block_n // 2) if silu_out else triton.cdiv(N, cfg.block_n)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    even_k = K % (split * cfg.block_k) == 0
    kw = dict(launch_pdl=True) if use_pdl else {}
    launch_kernel(_gemv_kernel, (tiles, split),
        x, w, out, residual if residual is not None else out, norm_w if norm_w is not None else w, ws, cnt,
        w_scale if w_scale is not None else ws,
        M, N, K, x.stride(0), w.stride(0), out.stride(0), residual.stride(0) if residual is not None else 0,
        float(scale), float(eps),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, EVEN_K=even_k, DOT=cfg.dot,
        PROLOGUE=prologue, RESIDUAL=residual is not None, X_DT=tl_dtype(x.dtype), XN_DT=tl_dtype(xn_dt),
        Y_DT=tl_dtype(y_dt), OUT_DT=tl_dtype(out_dt), PDL=use_pdl, DOT_FP32=INTERPRET, W_SCALE=w_scale is not None,
        SILU_OUT=silu_out, FP8_ASM=not INTERPRET, FP8_STREAM=cfg.stream, STAGES=cfg.num_stages,
        X_WORDS=w_scale is not None and x.dtype == torch.bfloat16 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True, **kw)
    return out


def gemv(x, w, out=None, *, config: GemvConfig | None = None, pdl: bool | None = None):
    """x [M, K] @ w[N, K]^T -> [M, N] in w's dtype (x.dtype == w.dtype), fp32 accumulation,
    1 <= M <= DOT_MAX_M (FMA configs M <= FMA_MAX_M). config None: the calibrated (else default)
    config for this shape."""
    return _launch(x, w, out=out, config=config, pdl=pdl)


def gemv_fp8(x, w_fp8, w_scale, config: GemvConfig, out=None, *, pdl: bool | None = None, silu_out: bool = False):
    """x [M, K] @ (w_fp8 [N, K] e4m3 * w_scale [N] fp32)^T -> [M, N] in x.dtype (weight-only fp8,
    quant.matmul.fp8_matmul_ref), 1 <= M <= FMA_MAX_M, with an FP8_FMA_CONFIGS config (each thread
    streams 16 fp8 weights per 16-byte vector and row, converts them in registers, fp32 FMAs:
    `_fp8_sums`) or an FP8_STREAM_CONFIGS one (the same math behind a cp.async pipeline:
    `_fp8_stream_sums`).
    silu_out: a [gate | up] weight, silu_mul of the product written ([M, N / 2], as gemv_silu_out;
    the config's BLOCK_N even)."""
    return _launch(x, w_fp8, out=out, config=config, pdl=pdl, w_scale=w_scale, silu_out=silu_out)


def gemv_silu_out(x, w, out=None, *, config=None, pdl=None):
    """silu_mul(x @ w^T) for a [gate | up] weight w [2F, K] -> [M, F] (TorchBackend.silu_mul after
    the linear, the gate_up output never stored): each column tile reads its outputs' gate rows
    and the matching up rows, so its epilogue has both halves of the outputs it writes; silu runs
    once per output (a silu_mul prologue on the down GEMV recomputes it in every column tile)."""
    return _launch(x, w, out=out, config=config, pdl=pdl, silu_out=True)


def gemv_residual(x, w, residual, scale, out=None, *, config=None, pdl=None):
    """residual + (x @ w^T) * scale with torch's roundings: the product rounded to w's dtype, then
    the sum to promote(residual, w). out may be `residual` itself (each element is read and then
    written by the same program). M <= DOT_MAX_M."""
    return _launch(x, w, out=out, residual=residual, scale=scale, config=config, pdl=pdl)


def gemv_rmsnorm(x, norm_w, eps, w, out=None, *, config=None, pdl=None):
    """reference.rms_norm(x, norm_w, eps) @ w^T: x [M <= GEMV_MAX_M, K], norm_w [K]; the normalised
    x never goes to memory."""
    if norm_w.dim() != 1 or norm_w.stride(0) != 1:
        raise ValueError("norm_w must be a contiguous [K] vector")
    return _launch(x, w, out=out, norm_w=norm_w, eps=eps, prologue=_RMS, config=config, pdl=pdl)


def gemv_silu_mul(gate_up, w, out=None, *, residual=None, scale=1.0, config=None, pdl=None):
    """silu_mul(gate_up) @ w^T for gate_up [M <= GEMV_MAX_M, 2K] (gate | up, as
    TorchBackend.silu_mul), optionally with the residual epilogue (residual + y * scale)."""
    return _launch(gate_up, w, out=out, residual=residual, scale=scale, prologue=_SILU, config=config, pdl=pdl)


# ---------------------------------------------------------------------------------------------
# Dispatch and calibration
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """Calibration of one (M bucket, N, K); times in us per call (CUDA graph, back to back).
    gemv: the fastest GEMV config (used by the fused ops either way); use_gemv: whether `linear`
    takes it (it beat cuBLAS)."""

    gemv: GemvConfig
    gemv_us: float
    cublas_us: float

    @property
    def use_gemv(self) -> bool:
        return self.gemv_us < self.cublas_us


def _choice_encode(c: Choice) -> dict:
    return dict(gemv=dataclasses.asdict(c.gemv), gemv_us=c.gemv_us, cublas_us=c.cublas_us)


def _choice_decode(d: dict) -> Choice:
    return Choice(GemvConfig(**d["gemv"]), float(d["gemv_us"]), float(d["cublas_us"]))


# (device, M bucket, N, K) -> Choice, filled by `calibrate`
PICKS = PickTable("gemv", _choice_encode, _choice_decode)


def calibrated_choice(M: int, N: int, K: int, device) -> Choice | None:
    """The calibration's Choice for M rows (its bucket) at [N, K], or None."""
    return PICKS.get(device, M, (N, K))


def choose_config(M: int, N: int, K: int, device: torch.device) -> GemvConfig:
    """The calibrated GEMV config for this shape (kept even where cuBLAS won: the fused ops still
    need one), else the default."""
    c = PICKS.get(device, M, (N, K))
    return c.gemv if c is not None else default_config(M, N, K)


def uses_gemv(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether `linear` takes the GEMV for this shape: the calibrated winner (1 <= M <= DOT_MAX_M),
    or (uncalibrated) 1 <= M <= 8 (the GEMV reads the weights once for any M; at M = 1 a plain
    Triton GEMV beat cuBLAS on all four anchor shapes)."""
    if not 1 <= M <= DOT_MAX_M:
        return False
    c = PICKS.get(device, M, (N, K))
    if c is not None:
        return c.use_gemv
    return M <= 8


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w^T: the GEMV where it was measured faster for this (M bucket, N, K), else
    cuBLAS (`x @ w.t()`); CPU tensors go to torch unless running under the Triton interpreter."""
    K = w.shape[1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if (x.is_cuda or INTERPRET) and x.dtype == w.dtype and uses_gemv(M, w.shape[0], K, x.device):
        y = gemv(x2, w)
    else:
        y = x2 @ w.t()
    return y.view(*x.shape[:-1], w.shape[0])


def weight_copies(N: int, K: int, dtype, device, seed: int = 0) -> list[torch.Tensor]:
    """Enough distinct random [N, K] matrices that cycling through them never hits in L2."""
    n = l2_busting_count(N * K * torch.tensor([], dtype=dtype).element_size(), least=1, most=64)
    g = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(N, K, device=device, generator=g) * K ** -0.5).to(dtype) for _ in range(n)]


def time_linear(fn_name: str, M: int, N: int, K: int, device, config: GemvConfig | None = None,
                pdl: bool | None = None, weights=None, calls: int | None = None) -> float:
    """us per call of cuBLAS ('cublas') or the GEMV ('gemv') at this shape, in a CUDA graph of
    back-to-back calls cycling through L2-busting weight copies (the benchmarks' measure; the
    calibration times the same calls through its Stopwatch)."""
    ws = weights if weights is not None else weight_copies(N, K, torch.bfloat16, device)
    x = torch.randn(M, K, device=device).to(ws[0].dtype)
    out = torch.empty(M, N, device=device, dtype=ws[0].dtype)
    n = calls or max(8, len(ws))
    if fn_name == "cublas":
        def fn(i):
            torch.mm(x, ws[i % len(ws)].t(), out=out)
    else:
        def fn(i):
            gemv(x, ws[i % len(ws)], out=out, config=config, pdl=pdl)
    return graph_time_us(fn, n)


class GemvTuning(Family):
    """The bf16 GEMV against cuBLAS, per (M bucket, N, K) of the plain weights (items: (N, K)): the
    fastest GEMV config is kept either way (the fused ops need one), and `linear` takes the GEMV
    where it beat cuBLAS (Choice.use_gemv). configs: a list for every M, or a callable M -> list;
    default `candidate_configs` less the explicit splits that cannot pay off at N (`_split_useful`).
    Buckets above DOT_MAX_M are never the GEMV: not timed."""

    table = PICKS

    def __init__(self, configs=None):
        self.configs = configs

    def shape(self, item) -> tuple:
        return (int(item[0]), int(item[1]))

    def wants(self, item, m: int, device) -> bool:
        return m <= DOT_MAX_M

    def candidates(self, m: int, N: int, K: int, device) -> list[GemvConfig]:
        """The configs timed at bucket m and shape (N, K), each with the split it runs at."""
        if callable(self.configs) or self.configs:
            cands = self.configs(m) if callable(self.configs) else self.configs
        else:
            cands = [c for c in candidate_configs(m) if _split_useful(c, N, device)]
        return [c if c.split_k else replace(c, split_k=_auto_split(N, K, c, device)) for c in cands]

    def launches(self, item, m: int, device):
        N, K = item
        w = torch.empty(N, K, device=device, dtype=torch.bfloat16)  # launches compile, never run
        x = torch.empty(m, K, device=device, dtype=torch.bfloat16)
        out = torch.empty(m, N, device=device, dtype=torch.bfloat16)
        return [functools.partial(gemv, x, w, out, config=cfg) for cfg in self.candidates(m, N, K, device)]

    def operands(self, item, device):
        return weight_copies(*item, torch.bfloat16, device)

    def tune_bucket(self, item, m: int, ws, device, stopwatch: Stopwatch) -> None:
        N, K = item
        calls = max(8, len(ws))
        x = torch.randn(m, K, device=device).to(torch.bfloat16)
        out = torch.empty(m, N, device=device, dtype=torch.bfloat16)
        t_cublas = stopwatch.time(lambda i: torch.mm(x, ws[i % len(ws)].t(), out=out), calls)
        trials = [Trial(cfg, functools.partial(_gemv_call, x, ws, out, cfg), str(cfg))
                  for cfg in self.candidates(m, N, K, device)]
        best, us = stopwatch.fastest(trials, calls, f"M={m} N={N} K={K}", f" (cuBLAS {t_cublas:.1f})")
        PICKS.put(device, m, (N, K), Choice(best.pick, us, t_cublas))


def _gemv_call(x, ws, out, cfg, i):
    gemv(x, ws[i % len(ws)], out=out, config=cfg)


def calibrate(shapes, device, m_values=(1, 2, 4, 8), *, configs=None, verbose: bool = False,
              parallel_compile: bool = True, stopwatch: Stopwatch | None = None) -> dict:
    """Time cuBLAS and the GEMV candidates once per (M bucket, N, K) (kernels/tuning.py's recipe:
    each a CUDA graph of >= 8 back-to-back calls over L2-busting weight copies, median of 5 replays)
    and record the results for `linear` / `choose_config`. shapes: iterable of (N, K) (bf16
    weights); M is timed at its bucket (3 -> 4); configs: see GemvTuning. Returns {(bucket, N, K):
    Choice}. Cost: a few ms per candidate plus one Triton compile each (cached on disk across runs);
    already calibrated keys are skipped."""
    return tune(GemvTuning(configs), [(int(n), int(k)) for n, k in shapes], device, m_values,
                parallel_compile=parallel_compile, verbose=verbose, stopwatch=stopwatch)


def clear_calibration() -> None:
    PICKS.clear()


def model_linear_shapes(cfg) -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses per decode step) of a ModelConfig's linear layers (fused projections as
    the model holds them). `calibrate` wants the distinct (N, K) of these."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    n_sparse = len(cfg.sparse_layers)
    n_light = cfg.num_hidden_layers - n_sparse
    shapes = [
        ("qkvg", 2 * cfg.q_size + 2 * cfg.kv_size, h, n_sparse),
        ("qkvz", 4 * cfg.lightning_size, h, n_light),
        ("o_proj", h, cfg.q_size, n_sparse),
        ("o_proj_l", h, cfg.lightning_size, n_light),
        ("gate_up", 2 * f, h, cfg.num_hidden_layers),
        ("down", h, f, cfg.num_hidden_layers),
        ("lm_head", cfg.vocab_size, h, 1),
    ]
    return [s for s in shapes if s[3] > 0]
