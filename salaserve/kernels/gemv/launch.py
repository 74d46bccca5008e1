"""The GEMV launchers: argument checks, the split-K workspace shared by every launch on a device, and
the public entry points (gemv, gemv_fp8, gemv_residual, gemv_rmsnorm, gemv_silu_mul, gemv_silu_out, and
`linear`: the GEMV or cuBLAS, as the calibration decided).
Graph capturable: no host syncs, no allocation except the output (or pass `out=`); the workspace
grows outside capture only, so run every shape once (or calibrate) before capturing.
"""

from __future__ import annotations

import torch
import triton

from salaserve.kernels._triton_utils import pdl_enabled, pdl_supported, promote, tl_dtype
from salaserve.kernels.compile_ahead import launch_kernel
from salaserve.kernels.device_buffers import Want, persistent_buffers
from salaserve.kernels.gemv.configs import DOT_MAX_M, FMA_MAX_M, GEMV_MAX_M, GemvConfig, auto_split
from salaserve.kernels.gemv.dispatch import choose_config, uses_gemv
from salaserve.kernels.gemv.kernel import _NONE, _RMS, _SILU, _gemv_kernel
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.tuning import m_bucket


_WORKSPACE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# 8 MB: M 16 x N 4096 x split 16 (small M), M 128 x N 4096 x split 4 (the largest calibrated
# large-M case: `split_useful`); anything larger grows it (outside graph capture)
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
    split = cfg.split_k or auto_split(N, K, cfg, x.device)
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
