"""fp8 (e4m3) weights at decode sizes: `w8a16_gemv` (weights converted to bf16, tensor cores; x
exact) and the start-up calibration that chooses between it and gemv/'s FMA GEMV on the fp8
codes (`calibrate_fp8_gemv`, `fp8_gemv_choice`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.quant_gemm._common import (_GEMV_KEY, _check_x, _configs, _default_split_k, _gemv_block_m,
                                                  _split_range, _store_output, _tile_ids, _workspace)
from salaserve.kernels.timing import l2_busting_count
from salaserve.kernels.tuning import Family, PickTable, Stopwatch, Trial, m_bucket, tune
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.quant.formats.fp8 import FP8


# ---------------------------------------------------------------- w8a16 (fp8 weights)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr = False,  # interpreter runs: its tl.dot misreads bf16 operands
):
    # launched without PDL: the large shapes measured up to 30% slower with it (gate_up 36.2 us
    # plain, 47.1 with PDL, same config)
    pid_m, pid_n, tile = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin, k_end = _split_range(K, SPLIT_K, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # weight [N, K], K contiguous
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


_W8_GEMV_DOT = [
    triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 256}, num_warps=8, num_stages=3),
]
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
) -> torch.Tensor:
    """Small-M x [M, K] @ (fp8 e4m3 W [N, K] * scale [N])^T -> [M, N] in x.dtype, on tensor cores
    (x padded to 16 rows) at every M, also M = 1, where it measured faster than an FMA loop over
    the converted weights (3.02 vs 3.48 ms for all the decode step's linears on the H200).
    block_k None: the autotuned configs; else that config (tests)."""
    N, K = w_fp8.shape
    x = _check_x(x, K)
    M = x.shape[0]
    block_m = max(16, _gemv_block_m(M))
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    args = (x, w_fp8, scale, out, ws, cnt, M, N, K, x.stride(0), w_fp8.stride(0), out.stride(0))
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, GROUP_M=1, DOT_FP32=INTERPRET)
    grid = (tiles, split)
    if block_k is None:
        _w8a16_gemv_dot_tuned[grid](*args, **meta)
    else:
        launch_kernel(_w8a16_kernel, grid, *args, **meta, BLOCK_K=block_k, num_warps=num_warps)
    return out


def _config_encode(c):
    return None if c is None else dataclasses.asdict(c)


def _config_decode(d):
    from salaserve.kernels.gemv import GemvConfig

    return None if d is None else GemvConfig(**d)


# (device, M bucket, N, K) -> the gemv.FP8_FMA_CONFIGS / FP8_STREAM_CONFIGS config that beat
# w8a16_gemv at start-up, or None where w8a16 stayed faster; filled by calibrate_fp8_gemv
PICKS = PickTable("fp8_gemv", _config_encode, _config_decode)


def fp8_gemv_choice(M: int, w: QuantizedLinearWeights, device):
    """The calibrated gemv_fp8 config for this decode size and shape, or None (w8a16)."""
    from salaserve.kernels import gemv as G

    if not 1 <= M <= G.FMA_MAX_M:
        return None
    return PICKS.get(device, M, (w.out_features, w.in_features))


def fp8_candidates(M: int, w: QuantizedLinearWeights) -> tuple:
    """The gemv_fp8 configs the calibration times for this decode size and weight."""
    from salaserve.kernels import gemv as G

    b = m_bucket(M)
    return G.FP8_FMA_CONFIGS[b] + G.FP8_STREAM_CONFIGS.get(b, ())


class Fp8GemvTuning(Family):
    """Per (M bucket, fp8 shape) (items: fp8 weights): w8a16_gemv against every gemv.FP8_FMA_CONFIGS
    and FP8_STREAM_CONFIGS config of the bucket; the table keeps the config that beat w8a16, or None.
    The GEMV reads the codes as int32 words: K a multiple of 4 (other shapes stay on w8a16).
    silu_shapes: (N, K) of [gate | up] weights, which one-row steps call through the silu_mul
    junction (TritonBackend.residual_norm_linear): at M = 1 those are timed as the junction runs
    them, w8a16 or an odd-BLOCK_N GEMV followed by the silu_mul kernel against the GEMV with its
    silu_mul epilogue."""

    table = PICKS

    def __init__(self, silu_shapes=frozenset()):
        self.silu_shapes = frozenset(silu_shapes)

    def shape(self, w) -> tuple:
        return (w.out_features, w.in_features)

    def wants(self, w, m: int, device) -> bool:
        return w.in_features % 4 == 0

    def _junction(self, w, m: int) -> bool:
        return m == 1 and self.shape(w) in self.silu_shapes

    def candidates(self, w, m: int, device) -> list:
        from salaserve.kernels import gemv as G

        N, K = self.shape(w)
        return [dataclasses.replace(c, split_k=c.split_k or G.auto_split(N, K, c, device))
                for c in fp8_candidates(m, w)]

    def launches(self, w, m: int, device):
        from salaserve.kernels import gemv as G

        x = torch.empty(m, w.in_features, device=device, dtype=torch.bfloat16)
        junction = self._junction(w, m)
        return ([functools.partial(w8a16_gemv, x, w.weight, w.scale)]
                + [functools.partial(G.gemv_fp8, x, w.weight, w.scale, c, silu_out=junction and c.block_n % 2 == 0)
                   for c in self.candidates(w, m, device)])

    def operands(self, w, device):
        n = l2_busting_count(w.weight.nbytes)
        return [torch.randn(w.out_features, w.in_features, device=device).to(torch.float8_e4m3fn) for _ in range(n)]

    def tune_bucket(self, w, m: int, copies, device, stopwatch: Stopwatch) -> None:
        from salaserve.kernels import gemv as G
        from salaserve.kernels.fused import silu_mul

        N, K = self.shape(w)
        n = len(copies)
        x = torch.randn(m, K, device=device).to(torch.bfloat16)
        junction = self._junction(w, m)
        after = silu_mul if junction else (lambda y: y)

        def w8a16(i):
            return after(w8a16_gemv(x, copies[i % n], w.scale))

        def gemv_fp8(cfg, i):
            if junction and cfg.block_n % 2 == 0:
                return G.gemv_fp8(x, copies[i % n], w.scale, cfg, silu_out=True)
            return after(G.gemv_fp8(x, copies[i % n], w.scale, cfg))

        calls = max(8, n)
        t_ref = stopwatch.time(w8a16, calls)
        trials = [Trial(c, functools.partial(gemv_fp8, c), str(c)) for c in self.candidates(w, m, device)]
        best = stopwatch.fastest(trials, calls, f"fp8 gemv M={m} N={N} K={K}"
                                 + (" (silu_mul junction)" if junction else ""), f" (w8a16 {t_ref:.1f})")
        # a config is kept only where it beat w8a16 (a tie stays on w8a16)
        PICKS.put(device, m, (N, K), best[0].pick if best is not None and best[1] < t_ref else None)


def calibrate_fp8_gemv(weights, device, m_values=(1, 2, 4, 8), verbose: bool = False,
                       silu_shapes=frozenset(), parallel_compile: bool = True, stopwatch=None) -> dict:
    """Tune the fp8 decode GEMV against w8a16 (Fp8GemvTuning, kernels/tuning.py's recipe) for the fp8
    weights' shapes and record the picks for quant_linear. Returns {(bucket, N, K): config or None}.
    GPU only."""
    return tune(Fp8GemvTuning(silu_shapes), [w for w in weights if w.format == FP8.name], device, m_values,
                parallel_compile=parallel_compile, verbose=verbose, stopwatch=stopwatch)
