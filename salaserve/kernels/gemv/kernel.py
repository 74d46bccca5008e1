"""The GEMV Triton kernel, `_gemv_kernel`: one kernel for every path (FMA, tensor cores, fp8 weights), the
fused prologues and epilogues, split-K reduced in the same launch.

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

import triton
import triton.language as tl

from salaserve.kernels._triton_utils import round_to, rsqrt_rn, silu_mul_rounded, write_silu_tile
from salaserve.kernels.gemv.fp8_sums import _fp8_stream_sums, _fp8_sums


# prologue kinds (constexpr PROLOGUE)
_NONE, _RMS, _SILU = 0, 1, 2


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


# M (the rows) is not specialised: mixed steps pass any row count, and a new class (M % 16 == 0 or
# not) would compile after start-up; BLOCK_M, M's bucket, is what the code depends on
@triton.jit(do_not_specialize=['M'])
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
