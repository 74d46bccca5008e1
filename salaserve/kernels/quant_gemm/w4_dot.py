"""int4 (GPTQ) linears on tensor cores and for prefill: `w4a16_gemv` (split-K tl.dot, BLOCK_M
16..64), `w4a16_gemm` (the dequantize-in-tile GEMM) and `w4a16_dense_mm` (W dequantized into a
bf16 scratch, then cuBLAS: the prefill path)."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.kernels.quant_gemm._common import _configs, _GEMV_KEY, _tile_ids, _store_output, _split_range, _workspace, _gemv_block_m, _default_split_k, _check_x, _act_order

@triton.jit
def _int4_magic(qw):
    """qw int32 [R, BN] -> fp32 [R, 8, BN] = 2**23 + nibble; nibble j of row r is k = 8r + j."""
    shifts = tl.arange(0, 8) * 4
    nib = (qw[:, None, :] >> shifts[None, :, None]) & 0xF
    return (nib | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _zeros_magic(qzeros_ptr, g, offs_n, mask, stride_zg):
    """2**23 + true zero point of groups g at columns offs_n (shapes broadcast), fp32."""
    packed = tl.load(qzeros_ptr + g * stride_zg + offs_n // 8, mask=mask, other=0)
    return (((packed >> ((offs_n % 8) * 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- w4a16


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, perm_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, stride_zg, m_bucket,
    GROUP_SIZE: tl.constexpr,
    ACT_ORDER: tl.constexpr,  # g_idx is not k // GROUP_SIZE: look the group up per input channel
    X_PERM: tl.constexpr,  # qweight row k holds input channel perm[k]: gather x through perm
    GROUP_PER_TILE: tl.constexpr,  # (heuristic) every K tile lies in one group: one scale row per tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n, tile = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_begin, k_end = _split_range(K, SPLIT_K, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    r = tl.arange(0, BLOCK_K // 8)  # packed rows of a K tile
    j = tl.arange(0, 8)  # nibble within a packed row

    if BLOCK_M == 1:
        # GEMV: one pass per nibble j over the packed tile [BK/8, BN] (row r holds k = 8r + j), so
        # qweight keeps its coalesced 2D layout; fp32 FMAs; the cross-thread reduction over K
        # happens once, after the loop
        offs_m = pid_m + tl.arange(0, 1)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        acc2 = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            rows = k0 // 8 + r
            qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :],
                         mask=(rows[:, None] < K // 8) & n_mask[None, :], other=0)
            if GROUP_PER_TILE:
                g = k0 // GROUP_SIZE
                z = _zeros_magic(qzeros_ptr, g, offs_n, n_mask, stride_zg)[None, :]
                part = tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.float32)
            for jj in tl.static_range(8):
                kk = rows * 8 + jj  # [BK/8] input channels of nibble jj
                k_mask = kk < K
                if X_PERM:
                    xk = tl.load(perm_ptr + kk, mask=k_mask, other=0)
                else:
                    xk = kk
                xj = tl.load(x_row + xk, mask=k_mask, other=0.0).to(tl.float32)[:, None]
                wj = (((qw >> (4 * jj)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + q
                if GROUP_PER_TILE:
                    part += xj * (wj - z)
                else:
                    if ACT_ORDER:
                        g = tl.load(g_idx_ptr + kk, mask=k_mask, other=0)[:, None]
                    else:
                        g = (kk // GROUP_SIZE)[:, None]
                    mask2 = k_mask[:, None] & n_mask[None, :]
                    zj = _zeros_magic(qzeros_ptr, g, offs_n[None, :], mask2, stride_zg)
                    sj = tl.load(scales_ptr + g * N + offs_n[None, :], mask=mask2, other=0.0).to(tl.float32)
                    acc2 += xj * ((wj - zj) * sj)
            if GROUP_PER_TILE:
                s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                acc2 += part * s[None, :]
        acc = tl.sum(acc2, axis=0)[None, :]
    else:
        # tensor cores: x tile [BM, BK] @ dequantized weight tile [BK, BN]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            if X_PERM:
                xk = tl.load(perm_ptr + kk, mask=k_mask, other=0)
            else:
                xk = kk
            xt = tl.load(x_rows + xk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            rows = k0 // 8 + r
            qw = tl.load(qweight_ptr + rows[:, None] * N + offs_n[None, :],
                         mask=(rows[:, None] < K // 8) & n_mask[None, :], other=0)
            wq = _int4_magic(qw)
            if GROUP_PER_TILE:
                # q - zero is a small integer, exact in bf16: scale after the dot, in fp32
                g = k0 // GROUP_SIZE
                z = _zeros_magic(qzeros_ptr, g, offs_n, n_mask, stride_zg)
                s = tl.load(scales_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                w = tl.reshape(wq - z[None, None, :], (BLOCK_K, BLOCK_N)).to(xt.dtype)
                acc += tl.dot(xt, w) * s[None, :]
            else:
                k3 = k0 + r[:, None] * 8 + j[None, :]
                k3_mask = k3 < K
                if ACT_ORDER:
                    g = tl.load(g_idx_ptr + k3, mask=k3_mask, other=0)[:, :, None]
                else:
                    g = (k3 // GROUP_SIZE)[:, :, None]
                mask3 = k3_mask[:, :, None] & n_mask[None, None, :]
                z = _zeros_magic(qzeros_ptr, g, offs_n[None, None, :], mask3, stride_zg)
                s = tl.load(scales_ptr + g * N + offs_n[None, None, :], mask=mask3, other=0.0).to(tl.float32)
                w = tl.reshape((wq - z) * s, (BLOCK_K, BLOCK_N)).to(xt.dtype)
                acc = tl.dot(xt, w, acc)
    _store_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K)


_w4a16_heur = triton.heuristics(
    {"GROUP_PER_TILE": lambda a: (not a["ACT_ORDER"]) and a["GROUP_SIZE"] % a["BLOCK_K"] == 0}
)(_w4a16_kernel)

# Config lists were checked by compiling for sm_90 (no spills, shared memory fits); timing is the
# autotuner's job. GEMV keys on the M-tile kind: the FMA path (BLOCK_M 1) and the tl.dot path differ.
_W4_GEMV_FMA = [
    triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_K": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 256}, num_warps=8, num_stages=2),
]
_W4_GEMV_DOT = [
    triton.Config({"BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128}, num_warps=8, num_stages=3),
]
_W4_GEMM = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]


_w4a16_gemv_fma_tuned = triton.autotune(configs=_configs(_W4_GEMV_FMA), key=_GEMV_KEY)(_w4a16_heur)
_w4a16_gemv_dot_tuned = triton.autotune(configs=_configs(_W4_GEMV_DOT), key=_GEMV_KEY)(_w4a16_heur)
_w4a16_gemm_tuned = triton.autotune(configs=_configs(_W4_GEMM), key=["m_bucket", "N", "K", "ACT_ORDER"])(_w4a16_heur)


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    perm: Optional[torch.Tensor] = None,
    *,
    act_order: Optional[bool] = None,
    split_k: Optional[int] = None,
    block_n: int = 128,
    block_k: Optional[int] = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Small-M x [M, K] @ int4 weights -> [M, N] in x.dtype. qzeros are v2 (true zeros).
    block_k given: that config, no autotuning (tests, benchmarks); split_k None: heuristic."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    x = _check_x(x, K)
    M = x.shape[0]
    gs = K if group_size <= 0 else group_size
    ao = _act_order(g_idx, gs, act_order)
    block_m = _gemv_block_m(M)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = split_k or _default_split_k(tiles, K, x.device)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N if split > 1 else 0, tiles)
    args = (x, qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, perm if perm is not None else qzeros,
            out, ws, cnt, M, N, K, x.stride(0), out.stride(0), qzeros.stride(0), block_m)
    meta = dict(GROUP_SIZE=gs, ACT_ORDER=ao, X_PERM=perm is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                SPLIT_K=split, GROUP_M=1)
    grid = (tiles, split)
    if block_k is None:
        (_w4a16_gemv_fma_tuned if block_m == 1 else _w4a16_gemv_dot_tuned)[grid](*args, **meta)
    else:
        _w4a16_heur[grid](*args, **meta, BLOCK_K=block_k, num_warps=num_warps)
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: Optional[torch.Tensor] = None,
    group_size: int = 128,
    perm: Optional[torch.Tensor] = None,
    *,
    act_order: Optional[bool] = None,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Large-M (prefill) x [M, K] @ int4 weights -> [M, N] in x.dtype, tiled tl.dot, no split-K.
    config (BLOCK_M/BLOCK_N/BLOCK_K[/num_warps]) given: no autotuning."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    x = _check_x(x, K)
    M = x.shape[0]
    gs = K if group_size <= 0 else group_size
    ao = _act_order(g_idx, gs, act_order)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, 0, 1)
    args = (x, qweight, qzeros, scales, g_idx if g_idx is not None else qzeros, perm if perm is not None else qzeros,
            out, ws, cnt, M, N, K, x.stride(0), out.stride(0), qzeros.stride(0),
            min(triton.next_power_of_2(M), 4096))
    meta = dict(GROUP_SIZE=gs, ACT_ORDER=ao, X_PERM=perm is not None, SPLIT_K=1, GROUP_M=8)

    def grid(c):
        return (triton.cdiv(M, c["BLOCK_M"]) * triton.cdiv(N, c["BLOCK_N"]), 1)

    if config is None:
        _w4a16_gemm_tuned[grid](*args, **meta)
    else:
        cfg = dict(config)
        warps = cfg.pop("num_warps", 4)
        _w4a16_heur[grid(cfg)](*args, **meta, **cfg, num_warps=warps)
    return out


# ---------------------------------------------------------------- w4a16 prefill: dequantize + cuBLAS
#
# At prefill sizes the GEMM is compute-bound and cuBLAS's bf16 tensor-core GEMM (~690 TFLOP/s)
# beats a dequantize-in-tile Triton GEMM by ~2x (micro: w4a16 32K prefill 0.50x bf16). So the
# weight is expanded once per call into a shared bf16 scratch [K, N] (4.5 bytes moved per weight,
# ~1% of an 8K-token chunk's GEMM time) and cuBLAS does the product.


@triton.jit
def _w4_dequant_kernel(qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N, K, stride_zg,
                       GROUP_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [K, N] (N contiguous, qweight's orientation) = (q - z) * s, rounded once to out's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < K // 8) & (offs_n[None, :] < N)
    w = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    g = (rows[:, None] * 8) // GROUP_SIZE  # the 8 channels of a packed row share a group (GROUP_SIZE % 8 == 0)
    s = tl.load(scales_ptr + g * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = (tl.load(qzeros_ptr + g * stride_zg + offs_n[None, :] // 8, mask=mask, other=0)
         >> ((offs_n[None, :] % 8) * 4)) & 0xF
    for j in tl.static_range(8):
        kk = rows[:, None] * 8 + j
        q = (w >> (4 * j)) & 0xF
        tl.store(out_ptr + kk.to(tl.int64) * N + offs_n[None, :], ((q - z).to(tl.float32) * s).to(out_ptr.dtype.element_ty),
                 mask=mask)


_SCRATCH: dict[str, torch.Tensor] = {}


def w4a16_dequantize(w: QuantizedLinearWeights, dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W^T [K, N] in `dtype` (rows in qweight's order: perm-ordered for reordered act-order weights)."""
    K, N = w.in_features, w.out_features
    if w.group_size % 8:
        raise ValueError(f"group size {w.group_size} must be a multiple of 8")
    if out is None:
        out = torch.empty(K, N, dtype=dtype, device=w.qweight.device)
    block_r, block_n = 8, 128
    _w4_dequant_kernel[(triton.cdiv(K // 8, block_r), triton.cdiv(N, block_n))](
        w.qweight, w.qzeros, w.scales, out, N, K, w.qzeros.stride(0),
        GROUP_SIZE=w.group_size, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return out


def w4a16_dense_mm(x: torch.Tensor, w: QuantizedLinearWeights) -> torch.Tensor:
    """Prefill-sized x [M, K] @ int4 weights via a bf16/fp16 scratch copy of W^T and torch.mm.
    One scratch per device, shared by every call (calls on one stream run in order)."""
    K, N = w.in_features, w.out_features
    x = _check_x(x, K)
    if not w.g_idx_trivial:
        raise ValueError("act-order weights must be reordered first (formats.reorder_act_order)")
    key = f"{x.device}-{x.dtype}"
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < K * N:
        _SCRATCH.pop(key, None)
        buf = torch.empty(K * N, dtype=x.dtype, device=x.device)
        _SCRATCH[key] = buf
    wt = w4a16_dequantize(w, x.dtype, out=buf[: K * N].view(K, N))
    if w.perm is not None:
        x = x[:, w.perm.long()]  # qweight row k holds input channel perm[k]
    return x @ wt
