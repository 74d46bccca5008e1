"""InfLLM-v2 block selection over the paged compressed keys: stage 1 (`stage1.py`) then the
top-k (`topk.py`), for decode (one query per sequence) and for (chunked) prefill (every token)."""

from __future__ import annotations

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.config import SparseConfig
from salaserve.core.batch import ForwardBatch
from salaserve.kernels.options import INTERPRET
from salaserve.kernels.sparse._common import _step_tiles
from salaserve.kernels.sparse.stage1 import _LSE_BLOCK_N, _stage1_keys
from salaserve.kernels.sparse.topk import _topk_blocks, topk_blocks, topk_pages, topk_pages_torch

_SELECT_BUFFER_BYTES = 256 << 20  # bound on the int32 key buffer of one prefill selection chunk

# Prefill tile of the stage-1 keys kernel (tokens per tile, blocks per step; the keys do not depend
# on it) and its launch: 8 tokens x 16 blocks capped at 128 registers (no spill) at 2 stages, 3.37 ms
# for the last 8K chunk of a 128K prompt, where 4 x 32 blocks took 5.59 ms (172 registers: one
# program per SM), capped at 120 registers 3.90.
STAGE1_PREFILL_TILE = (8, 16)
STAGE1_PREFILL_LAUNCH = dict(num_stages=2, maxnreg=128)

# The decode top-k: one Triton kernel (topk.topk_pages) instead of torch.topk + sort + ~8 small ops
# per sparse layer and step (0.43 ms of a 5.6 ms eager batch-1 step at 128K), for rows up to
# FUSED_TOPK_MAX_BLOCKS blocks wide; wider ones keep the torch path (topk_pages_torch).
FUSED_TOPK_MAX_BLOCKS = 16384  # a 512K context's rows
# The prefill top-k (topk.topk_blocks) is one Triton kernel too, instead of _topk_blocks' torch ops
# (topk, where, sort, where, pad; ~100 ms of a 128K prefill over 128 calls): 964 -> 263 us per 8K
# chunk at 128K, the same blocks bit for bit. _topk_blocks stays as its reference and for CPU tensors.


def decode_select_meta(seq_lens: torch.Tensor, prompt_lens: torch.Tensor | None = None) -> tuple:
    """What select_blocks_decode derives from seq_lens and prompt_lens alone (int32 lengths, query
    positions, one stage-1 tile per row, int32 prompt lengths, zeros for None): the same for every
    sparse layer of a step, so callers may compute it once and pass it as `meta` (4 small kernels
    per layer otherwise)."""
    seq_lens = seq_lens.to(torch.int32)
    ar = torch.arange(seq_lens.shape[0], device=seq_lens.device, dtype=torch.int32)
    prompt_lens = torch.zeros_like(seq_lens) if prompt_lens is None else prompt_lens.to(torch.int32)
    return seq_lens, (seq_lens - 1).to(torch.int64), (ar, ar, torch.ones_like(ar)), prompt_lens


def select_blocks_decode(q: torch.Tensor, comp: CompressedKeyPool, layer: int, page_table: torch.Tensor,
                         seq_lens: torch.Tensor, sc: SparseConfig, scale: float, max_sel: int,
                         block_t: int = 1, bb: int = 16, meta: tuple | None = None,
                         prompt_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks to attend for one decode query per sequence (position seq_len - 1).

    q [B, Hq, d] (bf16/fp32); page_table [B, P] int32 (P is the static width, >= every
    sequence's page count); seq_lens [B] int32 total lengths including the new token.
    Returns (block_table [B, Hkv, max_sel] int32 page ids, block_count [B, Hkv] int32):
      - entries [0, count) are page ids in ascending block order, so the last listed page is always
        the sequence's last (possibly partial) page, holding seq_len - (nb - 1) * block_size tokens;
        entries past count are 0 (a valid page id, never to be read);
      - sparse sequences (seq_len >= dense_len): the top-k of spec 3.4 with every existing entry
        visible, count = min(topk_eff, nb), except for a row that is a prompt token (a one-token
        prefill chunk: seq_len <= prompt_lens[row], int32 [B], None: none is), which sees what the
        prompt rule shows it (reference.visible_count);
      - dense sequences (seq_len < dense_len): every block, count = nb. This needs
        max_sel >= ceil((dense_len - 1) / block_size) (128 for the real config); a smaller max_sel
        serves sparse sequences only.
    CUDA-graph capturable: no host sync, every shape depends only on (B, P, max_sel).
    meta: decode_select_meta(seq_lens, prompt_lens), when the caller shares it across layers.
    """
    if max_sel < sc.topk_eff:
        raise ValueError(f"max_sel={max_sel} < topk_eff={sc.topk_eff}")
    B = q.shape[0]
    nb_out = page_table.shape[1]
    seq_lens, positions, tiles, prompt_lens = meta if meta is not None else decode_select_meta(seq_lens, prompt_lens)
    # The lse partials in fixed 64-entry ranges, whatever the table width and batch: a sequence
    # then gets the same lse bits, hence the same bf16 block scores and blocks, in a CUDA graph
    # (static width, padded batch) as eagerly, and whichever requests share its step. (Sized
    # by the GPU, the partition moved with the width: verify graphs vs eager differed by 2e-2.)
    # At batch 1 this is the partition the sizing chose anyway up to 16K pages.
    keys = _stage1_keys(q, comp, layer, page_table, seq_lens, positions, tiles, B, 0, nb_out,
                        scale, block_t, bb, lse_per_split=_LSE_BLOCK_N, prompt_lens=prompt_lens)
    if nb_out <= FUSED_TOPK_MAX_BLOCKS:
        return topk_pages(keys, page_table, seq_lens, sc, max_sel)
    return topk_pages_torch(keys, page_table, seq_lens, sc, max_sel)


def prefill_width(batch: ForwardBatch, sc: SparseConfig) -> int:
    """Width of select_blocks_prefill's output: topk_eff, or more when a dense sequence needs all
    of its blocks listed."""
    dense_nb = [-(-L // sc.block_size) for L, s in zip(batch.seq_lens_host, batch.is_sparse_host) if not s]
    return max([sc.topk_eff] + dense_nb)


def select_blocks_prefill(q: torch.Tensor, comp: CompressedKeyPool, layer: int, batch: ForwardBatch,
                          sc: SparseConfig, scale: float, block_t: int | None = None,
                          bb: int | None = None) -> torch.Tensor:
    """Per-token block selection for a (chunked) prefill batch.

    q [N, Hq, d] (the batch's tokens, packed by sequence); compressed keys read through
    batch.page_table. Token t at absolute position p sees the C1/C2 entries reference.visible_count
    shows it, with its sequence's batch.prompt_lens (prompt tokens: the official single-shot rule).
    Returns block_idx [Hkv, N, W] int32: block indices, ascending, -1 padded at the end.
    W = topk_eff when every sequence is sparse; a dense sequence (seq_len < dense_len) gets every
    causal block listed and W grows to cover it (see `prefill_width`).
    Not graph-capturable (host-side tiling from batch.q_lens_host). block_t (tokens per stage-1
    tile), bb (blocks per stage-1 step): STAGE1_PREFILL_TILE where None; the keys do not depend
    on them.
    """
    block_t = STAGE1_PREFILL_TILE[0] if block_t is None else block_t
    bb = STAGE1_PREFILL_TILE[1] if bb is None else bb
    N = q.shape[0]
    hkv = comp.c1.shape[3]
    dev = q.device
    width = prefill_width(batch, sc)
    nb_out = max(-(-L // sc.block_size) for L in batch.seq_lens_host)
    (seqs, tok0s, ntoks), (tile_seq, tile_tok0, tile_ntok) = _step_tiles(batch, block_t, dev)
    if all(batch.is_sparse_host):
        limit = sc.topk_eff  # = width: the top-k needs no ranks
    else:
        tok_seq = torch.repeat_interleave(torch.arange(len(batch.q_lens_host), device=dev),
                                          batch.cu_seqlens_q.diff(), output_size=N)
        limit = torch.where(batch.is_sparse[tok_seq], sc.topk_eff, width)
    qb = batch.positions // sc.block_size

    out = torch.empty(hkv, N, width, dtype=torch.int32, device=dev)
    rows_per_chunk = max(block_t, _SELECT_BUFFER_BYTES // (4 * hkv * nb_out))
    i = 0
    while i < len(tok0s):  # chunks of whole tiles, bounding the key buffer
        j = i
        while j < len(tok0s) and tok0s[j] + ntoks[j] - tok0s[i] <= rows_per_chunk:
            j += 1
        j = max(j, i + 1)
        lo, hi = tok0s[i], tok0s[j - 1] + ntoks[j - 1]
        keys = _stage1_keys(q, comp, layer, batch.page_table, batch.seq_lens, batch.positions,
                            (tile_seq[i:j], tile_tok0[i:j], tile_ntok[i:j]), hi - lo, lo, nb_out,
                            scale, block_t, bb, launch=STAGE1_PREFILL_LAUNCH, prompt_lens=batch.prompt_lens)
        lim = limit if isinstance(limit, int) else limit[lo:hi]
        if keys.is_cuda or INTERPRET:
            topk_blocks(keys, width, lim, qb[lo:hi], out=out[:, lo:hi])
        else:
            out[:, lo:hi] = _topk_blocks(keys, width, lim, qb[lo:hi])
        i = j
    return out
