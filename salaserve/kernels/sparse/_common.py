"""Pieces shared by the sparse-layer kernels: the stage-1/attention tiles of consecutive tokens
(host side and the Triton helpers that read them), small host helpers."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from salaserve.core.batch import ForwardBatch

LOG2E = 1.0 / math.log(2.0)  # softmax in base 2: exp(x) = exp2(x * log2(e))


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs (tests) need IEEE products to match the fp32 reference; bf16 ignores it.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _tile_rows(tile_seq_ptr, tile_tok0_ptr, tile_ntok_ptr, positions_ptr, pid_tile,
               GP: tl.constexpr, BLOCK_T: tl.constexpr):
    """A tile is BLOCK_T consecutive tokens of one sequence. Rows of the dot's M dimension are
    (token, head-in-group) pairs, row r = t * GP + h; GP >= 16 pads the group for tl.dot."""
    seq = tl.load(tile_seq_ptr + pid_tile)
    tok0 = tl.load(tile_tok0_ptr + pid_tile)
    ntok = tl.load(tile_ntok_ptr + pid_tile)
    r = tl.arange(0, BLOCK_T * GP)
    t_of_r = r // GP
    h_of_r = r % GP
    tok_r = tok0 + t_of_r
    pos_r = tl.load(positions_ptr + tok_r, mask=t_of_r < ntok, other=0)
    return seq, tok0, ntok, t_of_r, h_of_r, tok_r, pos_r


@triton.jit
def _load_q_rows(q_ptr, tok_r, h_of_r, row_ok, g, stride_qt, stride_qh,
                 GROUP: tl.constexpr, D: tl.constexpr):
    d = tl.arange(0, D)
    ptrs = q_ptr + tok_r[:, None] * stride_qt + (g * GROUP + h_of_r)[:, None] * stride_qh + d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


def _prefill_tiles(batch: ForwardBatch, block_t: int):
    """Host-side tiles: BLOCK_T consecutive tokens of one sequence each."""
    seqs, tok0s, ntoks = [], [], []
    start = 0
    for i, n in enumerate(batch.q_lens_host):
        for t in range(0, n, block_t):
            seqs.append(i)
            tok0s.append(start + t)
            ntoks.append(min(block_t, n - t))
        start += n
    return seqs, tok0s, ntoks


def tile_tensors(tiles, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_prefill_tiles' (sequence, first token, token count) lists as int32 tensors on `device`."""
    return tuple(torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True) for x in tiles)


def _step_tiles(batch: ForwardBatch, block_t: int, device):
    """(_prefill_tiles(batch, block_t), their tile_tensors), built once per step and tile size:
    every sparse layer of a prefill step tiles the same tokens (kept in batch.derived)."""
    cache = batch.derived if batch.derived is not None else {}
    key = ("prefill_tiles", block_t)
    if key not in cache:
        tiles = _prefill_tiles(batch, block_t)
        cache[key] = tiles, tile_tensors(tiles, device)
    return cache[key]
