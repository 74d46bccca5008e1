"""The int4 decode calibration and dispatch: `calibrate_w4` times, per shape and M bucket, the
decode GEMVs that can run there and records the fastest (kernel, config, split) in PICKS
(kernels/tuning.py's recipe);
`w4_decode_choice` and `w4a16_decode` run that pick for quant_linear. The kernels: the dp2a GEMV
(w4_dp2a.py, 1-2 rows), the FMA GEMV (w4_fma.py, up to 4 rows where dp2a cannot run) and the
warpgroup-MMA GEMV (w4_wgmma.py, 4-16 rows, on a repacked copy of the weights). At 1-2 rows the
calibration also times the dp2a GEMV on x rounded to int16 by x's producer (the add + RMSNorm and
silu_mul kernels write it instead of bf16) and keeps it where it beats the pick on bf16 x."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton

from salaserve.kernels.quant_gemm._common import _sm_count
from salaserve.kernels.quant_gemm.w4_dp2a import (W4_DP2A_CONFIGS, W4_DP2A_MAX_M, W4_DP2A_ROUNDED_CONFIGS, X_TILE,
                                                  round_x_int16, w4_dp2a_usable, w4a16_gemv_dp2a,
                                                  w4a16_gemv_dp2a_rounded)
from salaserve.kernels.quant_gemm.w4_fma import W4_FMA_CONFIGS, W4_FMA_GROUP_MULTIPLE, W4_FMA_MAX_M, w4a16_gemv_fma
from salaserve.kernels.quant_gemm.w4_wgmma import (W4_WGMMA_CONFIGS, W4_WGMMA_MAX_M, W4_WGMMA_MIN_M, repack_w4_for_wgmma,
                                                   w4_wgmma_usable, w4a16_gemv_wgmma)
from salaserve.kernels.timing import l2_busting_count
from salaserve.kernels.tuning import Family, PickTable, Stopwatch, Trial, tune
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.quant.formats.w4a16 import W4A16


def _choice_encode(v: tuple) -> list:
    return [v[0], list(v[1]), v[2]]


def _choice_decode(v: list) -> tuple:
    return (str(v[0]), tuple(v[1]), int(v[2]))


# (device, bucket, N, K, group size) -> (kernel "dp2a", "fma" or "wgmma", config, split), filled by
# calibrate_w4: the pick for bf16 x
PICKS = PickTable("w4", _choice_encode, _choice_decode)
# the same keys -> (kernel "dp2a_rounded", config, split) for w4a16_decode_rounded, where it beat
# PICKS' pick (1-2 rows)
ROUNDED_PICKS = PickTable("w4_rounded", _choice_encode, _choice_decode)


def w4_shape(w: QuantizedLinearWeights) -> tuple:
    """The int4 tables' shape key: (N, K, group size)."""
    return (w.out_features, w.in_features, w.group_size)


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


def w4_candidates(m: int, w: QuantizedLinearWeights, device) -> list[tuple]:
    """(kernel, config, split) candidates of the decode calibration at M bucket m: the dp2a
    kernel's configs (M <= 2, no act-order perm), else the FMA kernel's (M <= W4_FMA_MAX_M) and,
    where w carries its repacked copy, the wgmma kernel's (W4_WGMMA_MIN_M <= M <= 16, whole
    tiles), each with its split-K choices."""
    N, K = w.out_features, w.in_features
    out = []
    if m <= W4_DP2A_MAX_M and w4_dp2a_usable(w):
        out += [("dp2a", cfg, split) for cfg in W4_DP2A_CONFIGS[m] for split in _w4_splits(N, K, cfg[0], cfg[1], device)]
    elif m <= W4_FMA_MAX_M and w.group_size % W4_FMA_GROUP_MULTIPLE == 0:
        # at 1-2 rows the dp2a kernel was 12-25% faster at every shape: the FMA kernel's configs
        # are timed only where it cannot run (compiles saved at start-up)
        out += [("fma", cfg, split) for cfg in W4_FMA_CONFIGS[m] for split in _w4_splits(N, K, cfg[0], cfg[1], device)]
    if w.wgmma is not None and W4_WGMMA_MIN_M <= m <= W4_WGMMA_MAX_M:
        out += [("wgmma", cfg, split) for cfg in W4_WGMMA_CONFIGS if w4_wgmma_usable(w, cfg)
                for split in _w4_splits(N, K, cfg[0], cfg[1], device)]
    return out


def w4_rounded_usable(w: QuantizedLinearWeights) -> bool:
    """Whether the calibration times the rounded-x dp2a kernel for w (weights it takes)."""
    return w.format == W4A16.name and w4_dp2a_usable(w) and w.in_features % X_TILE == 0


def w4_rounded_choice(rows: int, w: QuantizedLinearWeights, device) -> Optional[tuple]:
    """(kernel, config, split) for w4a16_decode_rounded where the calibration found x rounded by its
    producer faster at this many rows and w's shape than the pick on bf16 x; else None (the producer
    writes bf16 x)."""
    if not 1 <= rows <= W4_DP2A_MAX_M or getattr(w, "format", None) != W4A16.name:
        return None
    return ROUNDED_PICKS.get(device, rows, w4_shape(w))


def w4_decode_choice(x: torch.Tensor, w: QuantizedLinearWeights) -> Optional[tuple]:
    """The calibrated (kernel, config, split) for x [M, K] at w's shape, or None (not calibrated,
    or the wgmma kernel's pick with x not bf16 or w without its repacked copy: quant_linear's
    default route)."""
    M = x.shape[0]
    hit = PICKS.get(x.device, M, w4_shape(w)) if M <= W4_WGMMA_MAX_M else None
    if hit is not None and hit[0] != "fma" and (x.dtype != torch.bfloat16 or (hit[0] == "wgmma"
                                                                             and w.wgmma is None)):
        return None
    return hit


def w4_silu_out_usable(w: QuantizedLinearWeights) -> bool:
    """Whether a [gate | up] int4 weight can take the dp2a GEMV's silu_mul epilogue (silu_out): the
    dp2a kernel takes it, and F = N/2 is a multiple of 4 (16-byte column vectors in each half)."""
    return getattr(w, "format", None) == W4A16.name and w4_dp2a_usable(w) and w.out_features % 8 == 0


def w4a16_decode(x: torch.Tensor, w: QuantizedLinearWeights, choice: tuple, silu_out: bool = False) -> torch.Tensor:
    """x @ int4 weights through a (kernel, config, split) of calibrate_w4. silu_out (the dp2a kernel's
    choices only): w is [gate | up] and the result silu_mul of the product (w4a16_gemv_dp2a)."""
    kernel, cfg, split = choice
    if silu_out:
        if kernel != "dp2a":
            raise ValueError(f"silu_out needs the dp2a kernel, not {kernel}")
        return w4a16_gemv_dp2a(x, w, config=cfg, split_k=split, silu_out=True)
    if kernel == "wgmma":
        return w4a16_gemv_wgmma(x, w, w.wgmma, config=cfg, split_k=split)
    if kernel == "dp2a":
        return w4a16_gemv_dp2a(x, w, config=cfg, split_k=split)
    return w4a16_gemv_fma(x, w, config=cfg, split_k=split)


class W4DecodeTuning(Family):
    """Per (M bucket, int4 shape) (items: w4a16 weights with trivial g_idx): every (kernel, config,
    split) of the decode GEMVs that can run there (the dp2a or FMA kernel and, for weights with their
    repacked copy, the wgmma kernel: w4_candidates), timed over L2-busting random weights of the
    same layout; the fastest goes to PICKS. At 1-2 rows, for weights the rounded-x dp2a kernel takes,
    its candidates are timed on x rounded beforehand (its producer does the rounding in the step, at
    no extra kernel) and the fastest goes to ROUNDED_PICKS where it beat the pick on bf16 x."""

    table = PICKS

    @property
    def tables(self) -> tuple:
        return (PICKS, ROUNDED_PICKS)

    def shape(self, w) -> tuple:
        return w4_shape(w)

    def wants(self, w, m: int, device) -> bool:
        return w.format == W4A16.name and w.g_idx_trivial and bool(w4_candidates(m, w, device))

    def _rounded(self, w, m: int) -> bool:
        return m <= W4_DP2A_MAX_M and w4_rounded_usable(w)

    def launches(self, w, m: int, device):
        """Each candidate's launch, the rounded-x kernel's included: the whole start-up's compiles in
        one batch, so the thread pool never waits on one bucket's slowest."""
        x = torch.randn(m, w.in_features, device=device).to(torch.bfloat16)
        out = [functools.partial(w4a16_decode, x, w, c) for c in w4_candidates(m, w, device)]
        if self._rounded(w, m):
            xq, xs = round_x_int16(x)
            out += [functools.partial(w4a16_decode_rounded, xq, xs, w, c) for c in rounded_choices(m, w, device)]
        return out

    def operands(self, w, device):
        n_copies = l2_busting_count(w.qweight.nbytes)
        copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1), wgmma=None)
                  for _ in range(n_copies)]
        if w.wgmma is not None:
            copies = [dataclasses.replace(c, wgmma=repack_w4_for_wgmma(c)) for c in copies]
        return copies

    def tune_bucket(self, w, m: int, copies, device, stopwatch: Stopwatch) -> None:
        calls = max(8, len(copies))
        label = f"w4 M={m} N={w.out_features} K={w.in_features}"
        x = torch.randn(m, w.in_features, device=device).to(torch.bfloat16)
        best = stopwatch.fastest([Trial(c, functools.partial(_decode_call, x, copies, c), _label(c))
                                  for c in w4_candidates(m, w, device)], calls, label)
        PICKS.put(device, m, w4_shape(w), best[0].pick)
        if self._rounded(w, m):
            xq, xs = round_x_int16(x)
            rounded = stopwatch.fastest([Trial(c, functools.partial(_rounded_call, xq, xs, copies, c), _label(c))
                                         for c in rounded_choices(m, w, device)], calls, label)
            if rounded[1] < best[1]:
                ROUNDED_PICKS.put(device, m, w4_shape(w), rounded[0].pick)


def _label(choice: tuple) -> str:
    return f"{choice[0]} {choice[1]} split {choice[2]}"


def _decode_call(x, copies, choice, i):
    return w4a16_decode(x, copies[i % len(copies)], choice)


def _rounded_call(xq, xs, copies, choice, i):
    return w4a16_decode_rounded(xq, xs, copies[i % len(copies)], choice)


def calibrate_w4(weights, device, m_values=(1, 2, 4, 8, 16), verbose: bool = False,
                 parallel_compile: bool = True, stopwatch=None) -> dict:
    """Tune the int4 decode GEMVs (W4DecodeTuning, kernels/tuning.py's recipe) for the w4a16 weights'
    shapes and keep the fastest for quant_linear (before graph capture; GPU only). Seconds with
    Triton's kernel cache warm; with an empty one the compiles of every candidate take minutes
    (precompiled in threads; the plan cache keeps the picks across restarts). Returns
    {(bucket, N, K, group size): (kernel, config, split)}."""
    return tune(W4DecodeTuning(), [w for w in weights if w.format == W4A16.name], device, m_values,
                parallel_compile=parallel_compile, verbose=verbose, stopwatch=stopwatch)


def rounded_choices(m: int, w: QuantizedLinearWeights, device, configs=None) -> list[tuple]:
    """(kernel, config, split) for w4a16_decode_rounded at M bucket m: the rounded dp2a kernel's configs
    (or `configs`) with the calibration's split-K choices."""
    N, K = w.out_features, w.in_features
    return [("dp2a_rounded", cfg, split) for cfg in (configs or W4_DP2A_ROUNDED_CONFIGS[m])
            for split in _w4_splits(N, K, cfg[0], cfg[1], device)]


def w4a16_decode_rounded(xq: torch.Tensor, xs: torch.Tensor, w: QuantizedLinearWeights, choice: tuple,
                         out_dtype: torch.dtype = torch.bfloat16, silu_out: bool = False) -> torch.Tensor:
    """x rounded by its producer (round_x_int16's layout) @ int4 weights through a (kernel, config, split)
    of rounded_choices (the rounded dp2a kernel's). silu_out as w4a16_decode's."""
    kernel, cfg, split = choice
    if kernel != "dp2a_rounded":
        raise ValueError(f"x rounded by its producer takes the dp2a_rounded kernel, not {kernel}")
    return w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=split, out_dtype=out_dtype, silu_out=silu_out)
