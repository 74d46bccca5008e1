"""fp8 (e4m3) weights at decode sizes: `w8a16_gemv` (weights converted to bf16 on tensor cores),
`w8a8_gemv` (x quantized per 128 channels, fp8 tensor cores), and the start-up calibrations that
choose between them and gemv.py's FMA GEMV on the fp8 codes."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import pdl_supported, pdl_wait_first, round_to_e4m3
from salaserve.kernels.compile_ahead import launch_kernel, precompile
from salaserve.quant.formats import FP8_MAX, QuantizedLinearWeights
from salaserve.kernels.quant_gemm._common import (_INTERPRET, _configs, _GEMV_KEY, _tile_ids, _store_output,
                                                  _split_range, _workspace, _gemv_block_m, _default_split_k, _check_x,
                                                  _device_key, _to_calibrate)

# SALASERVE_FP8_DOT=1 adds gemv.FP8_DOT_CONFIGS (fp8 on tensor cores with f16 operands) to the fp8
# GEMV calibration's candidates. Off: correct on the GPU but slower than the FMA GEMV at every
# shape (BENCHMARKS run 44).
FP8_DOT = os.environ.get("SALASERVE_FP8_DOT", "0") == "1"
# SALASERVE_FP8_MMA=1 adds gemv.FP8_MMA_CONFIGS (fp8 codes on mma.sync from registers,
# quant_gemm/fp8_mma.py) too. Off: correct on the GPU, slower than the FMA GEMV at one row (run 79:
# gate_up 44.6 vs 38.9 us) and within 1% of w8a16 over a step's linears at 8 rows (run 75), not
# worth its compiles at every start-up.
FP8_MMA = os.environ.get("SALASERVE_FP8_MMA", "0") == "1"
# SALASERVE_FP8_STREAM=0 leaves out gemv.FP8_STREAM_CONFIGS (the FMA GEMV behind a cp.async
# pipeline, `gemv._fp8_stream_sums`) from the calibration's candidates.
FP8_STREAM = os.environ.get("SALASERVE_FP8_STREAM", "1") == "1"


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
        launch_kernel(_w8a16_kernel, grid, *args, **meta, BLOCK_K=block_k, num_warps=num_warps)
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
    launch_kernel(_w8a8_gemv_kernel, (tiles, split),
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
            cands = _w8a8_candidates(m, N, K, device)
            precompile(functools.partial(w8a8_gemv, x, copies[0], w.scale, config=cfg) for cfg in cands)
            best = None
            for cfg in cands:
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


def _mma_candidates(M: int, w: QuantizedLinearWeights) -> tuple:
    """gemv.FP8_MMA_CONFIGS where the mma GEMV takes this shape and weight (fp8_mma.launch's
    conditions on W), with SALASERVE_FP8_MMA=1."""
    from salaserve.kernels import gemv as G
    from salaserve.kernels.quant_gemm import fp8_mma

    if not FP8_MMA or not fp8_mma.mma_usable(M, w.in_features) or not fp8_mma.w_aligned(w.weight):
        return ()
    return G.FP8_MMA_CONFIGS


def _fp8_candidates(M: int, w: QuantizedLinearWeights) -> tuple:
    """The gemv_fp8 configs the calibration times for this decode size and weight."""
    from salaserve.kernels import gemv as G

    b = G._bucket(M)
    return (G.FP8_FMA_CONFIGS[b] + (G.FP8_STREAM_CONFIGS.get(b, ()) if FP8_STREAM else ())
            + (G.FP8_DOT_CONFIGS if FP8_DOT else ()) + _mma_candidates(M, w))


def calibrate_fp8_gemv(weights, device, m_values=(1, 2, 4, 8), verbose: bool = False,
                       silu_shapes=frozenset()) -> dict:
    """Per (M bucket, fp8 shape): time w8a16_gemv, every gemv.FP8_FMA_CONFIGS config and, where
    switched on, the FP8_STREAM_CONFIGS, FP8_DOT_CONFIGS and FP8_MMA_CONFIGS ones (CUDA graphs
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
            cands = [dataclasses.replace(c, split_k=c.split_k or G._auto_split(N, K, c, device))
                     for c in _fp8_candidates(m, w)]
            precompile([functools.partial(w8a16_gemv, x, copies[0], w.scale)]
                       + [functools.partial(G.gemv_fp8, x, copies[0], w.scale, c,
                                            silu_out=junction and c.block_n % 2 == 0) for c in cands])
            t_ref = graph_time_us(lambda i: after(w8a16_gemv(x, copies[i % n], w.scale)), calls=max(8, n))
            best = (None, t_ref)
            for cfg in cands:
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
