"""fp8 weights in the GEMV kernel (`gemv_fp8`): the FMA inner loops on e4m3 codes read as int32 words,
each word converted by inline PTX (`_e4m3_words_to_f32`; bit operations under the interpreter), x
read as int64 words of 4 bf16 in the same thread mapping (`_x_quads`): `_fp8_sums` walks a program's
BLOCK_N rows one (or, BLOCK_N even, a pair) at a time in one register-prefetched loop;
`_fp8_stream_sums` (a `stream` config) takes all of them per K step behind a cp.async pipeline.
"""

from __future__ import annotations

import triton
import triton.language as tl

from salaserve.kernels._triton_utils import bf16_pair


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
