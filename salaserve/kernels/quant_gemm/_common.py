"""Pieces shared by the quantized linear kernels: the split-K launch (ranges, the in-launch
reduction, the shared workspace), config lists for the autotuner."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from salaserve.kernels._triton_utils import write_silu_tile
from salaserve.kernels.device_buffers import Want, persistent_buffers
from salaserve.kernels.options import INTERPRET
from salaserve.quant.formats import is_trivial_g_idx

GEMV_MAX_M = 64  # split-K GEMV kernels up to here; prefill paths above
SPLIT_K_CTAS_PER_SM = 4  # split-K aims at this many CTAs per SM (enough loads in flight)
SPLIT_K_MIN_CHANNELS = 256  # ...but never splits K finer than this


def _configs(configs: list) -> list:
    # the interpreter cannot benchmark; one config means the autotuner never times anything
    return configs[:1] if INTERPRET else configs


_GEMV_KEY = ["BLOCK_M", "BLOCK_N", "N", "K", "SPLIT_K", "ACT_ORDER"]


# ---------------------------------------------------------------- shared jit helpers


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (pid_m, pid_n, tile), grouped so GROUP_M row tiles reuse a column tile in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n, pid


@triton.jit
def _store_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K: tl.constexpr):
    """Write acc [BLOCK_M, BLOCK_N] (fp32) to out; with split-K, the last split reduces."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # workspace [SPLIT_K, M, N] fp32
        tl.store(part + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # all threads' partials are written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last split of this tile: sum all partials in a fixed order
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):
                total += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # re-armed for the next launch: no memset needed


@triton.jit
def _split_k_total(acc, part, part_stride, mask, cnt_ptr, tile, SPLIT_K: tl.constexpr):
    """_store_output's split-K reduction for an epilogue that does more than store: every split writes
    acc to part + its index * part_stride and bumps the tile's counter; returns (last, total): last is
    true in the split that arrived last, whose total is all splits' partials added in split order (the
    counter re-armed for the next launch); elsewhere total is the split's own acc, not to be used."""
    tl.store(part + tl.program_id(1) * part_stride, acc, mask=mask)
    tl.debug_barrier()  # all threads' partials are written before the release below
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = acc
    if last:
        total = tl.zeros_like(acc)
        for s in range(SPLIT_K):
            total += tl.load(part + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile, 0)  # re-armed for the next launch
    return last, total


@triton.jit
def _store_silu_output(acc, offs_m, offs_n, M, N, out_ptr, stride_om, ws_ptr, cnt_ptr, tile, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Y_DT: tl.constexpr):
    """_store_output for a [gate | up] weight whose tile `tile` holds BLOCK_N/2 gate columns, then the
    matching up columns (a SILU_OUT column map): silu_mul of the tile's linear outputs (rounded to
    Y_DT first, as the linear would store them) goes to out [M, N/2] (write_silu_tile); with split-K
    the partials go to the workspace under the tile's own positions offs_n (pid_n * BLOCK_N + j, whole
    tiles: [SPLIT_K, M, tiles * BLOCK_N], as a ragged last tile's up half lies past N) and the last
    split reduces (_split_k_total)."""
    m_mask = offs_m < M
    if SPLIT_K == 1:
        write_silu_tile(acc, offs_m, m_mask, tile, N // 2, out_ptr, stride_om, BLOCK_M, BLOCK_N, Y_DT, Y_DT)
    else:
        NP = tl.cdiv(N, BLOCK_N) * BLOCK_N
        last, total = _split_k_total(acc, ws_ptr + offs_m[:, None] * NP + offs_n[None, :], M * NP,
                                     m_mask[:, None] & (offs_n[None, :] < NP), cnt_ptr, tile, SPLIT_K)
        if last:
            write_silu_tile(total, offs_m, m_mask, tile, N // 2, out_ptr, stride_om, BLOCK_M, BLOCK_N, Y_DT, Y_DT)


@triton.jit
def _split_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_begin, k_end) of this split; split lengths are whole BLOCK_K tiles (groups stay aligned)."""
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = tl.program_id(1) * k_len
    return k_begin, tl.minimum(k_begin + k_len, K)


# ---------------------------------------------------------------- launch helpers

_WORKSPACE: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


_WS_MIN_FLOATS = 8 << 20  # 32 MB: split * M * N of every GEMV launch up to M = 64 at the model's shapes
_WS_MIN_TILES = 1 << 14


def _workspace(device: torch.device, n_floats: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials and tile counters, one pair per device (device_buffers). On a GPU they start
    large enough for every launch the model makes (growth during capture is refused)."""
    cuda = device.type == "cuda"
    partials = Want(n_floats, _WS_MIN_FLOATS if cuda else 0, torch.float32)
    counters = Want(n_tiles, _WS_MIN_TILES if cuda else 0, torch.int32, zeroed=True)
    return persistent_buffers(_WORKSPACE, device, (partials, counters), "quantized GEMV workspace")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: pretend H200


def _gemv_block_m(M: int) -> int:
    return 1 if M == 1 else min(64, max(16, triton.next_power_of_2(M)))


def _default_split_k(tiles: int, K: int, device: torch.device) -> int:
    """Enough splits for SPLIT_K_CTAS_PER_SM CTAs per SM, at most 32, power of two."""
    want = max(1, SPLIT_K_CTAS_PER_SM * _sm_count(device) // max(tiles, 1))
    split = max(1, min(want, K // SPLIT_K_MIN_CHANNELS, 32))
    return 1 << (split.bit_length() - 1)


def _check_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be [M, {K}], got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def _check_decode_x(x: torch.Tensor, K: int, max_m: int, kernel: str) -> torch.Tensor:
    """x for the bf16-only decode GEMVs on repacked int4 weights: [1..max_m, K], bf16."""
    x = _check_x(x, K)
    if not 1 <= x.shape[0] <= max_m:
        raise ValueError(f"{kernel} takes 1 <= M <= {max_m}, got {x.shape[0]}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"{kernel} takes bf16 x, got {x.dtype}")
    return x


def _act_order(g_idx: Optional[torch.Tensor], group_size: int, act_order: Optional[bool]) -> bool:
    if act_order is not None:
        return act_order
    return not is_trivial_g_idx(g_idx, group_size)  # syncs; the container caches this instead
