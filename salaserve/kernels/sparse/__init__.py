"""InfLLM-v2 block selection and block-sparse prefill attention over the paged caches (Triton).

Spec section 3.4/3.5 and the executable spec `salaserve/model/reference.py` (`stage1_scores`,
`select_blocks`): the project's choices are followed exactly, i.e. stage-1 visibility of
compressed entries by `visible_count` (entry j is visible to the query at position p iff its whole
window lies in [0, p], one entry fewer for prompt tokens of a prompt whose length is = stride - 1
(mod stride), as the official single-shot prefill shows them), stage-1 overflows kept as +inf,
future blocks score -inf, and ties are broken toward the lower block index.

One module per stage:
  stage1.py     block scores of the compressed keys, packed into sortable int32 keys
  topk.py       top-k over the keys (decode: page ids; prefill: block indices per token)
  selection.py  the two composed: select_blocks_decode, select_blocks_prefill
  attention.py  block-sparse attention over the selected blocks: sparse_prefill_attention, and
                sparse_attention (TorchBackend.sparse_attention's contract: selection + attention)
  _common.py    tiles of consecutive tokens, small helpers

The modules' tuning constants are module globals read at call time. `set_knob` / `knobs` change one
(or a function that another module calls) for every module that reads it: the tests' seam for
driving small inputs through the multi-split and multi-segment paths. The engine never changes them
(they are constants, not user choices; those are KernelOptions, kernels/options.py); assigning to
this package does not.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from salaserve.kernels.sparse import _common, attention, selection, stage1, topk
from salaserve.kernels.sparse._common import (LOG2E, _dot_precision, _pow2, _prefill_tiles, _step_tiles,
                                              tile_tensors)
from salaserve.kernels.sparse.attention import (_PER_TOKEN_WARPS, SPARSE_FP8_STAGE_MAX_BYTES, SPARSE_WINDOW_LAUNCH,
                                                SPARSE_WINDOW_TOKENS, _ascending_lists, _sparse_prefill_attn_kernel,
                                                _sparse_window_attn_kernel, sparse_attention, sparse_prefill_attention)
from salaserve.kernels.sparse.selection import (_SELECT_BUFFER_BYTES, FUSED_TOPK_MAX_BLOCKS,
                                                STAGE1_PREFILL_LAUNCH, STAGE1_PREFILL_TILE, decode_select_meta,
                                                prefill_width, select_blocks_decode, select_blocks_prefill)
from salaserve.kernels.sparse.stage1 import (_LSE_BLOCK_N, _MAX_BLOCKS, _TARGET_PROGRAMS, _stage1_block_keys_kernel,
                                             _stage1_keys, _stage1_lse_kernel, _stage1_lse_partials, pack_keys,
                                             unpack_keys)
from salaserve.kernels.sparse.topk import (_TOPK_MAX_CANDIDATES, TOPK_ONE_PASS_BLOCKS, TOPK_SEGMENT, _topk_blocks,
                                           _topk_blocks_kernel, _topk_blocks_merge_kernel, _topk_blocks_segment_kernel,
                                           _topk_merge_kernel, _topk_pages_kernel, _topk_segment_kernel, topk_blocks,
                                           topk_pages, topk_pages_torch)

_MODULES = (_common, stage1, topk, selection, attention)


def set_knob(name: str, value):
    """Set module global `name` (a constant such as _TARGET_PROGRAMS, or a function that another
    module calls, such as topk_blocks) in every module of the package that binds it, this one
    included. Returns the previous value; raises AttributeError for a name no module has."""
    holders = [m for m in _MODULES if name in vars(m)]
    if not holders:
        raise AttributeError(f"no sparse kernel module has {name!r}")
    previous = getattr(holders[0], name)
    for m in holders + [sys.modules[__name__]]:
        setattr(m, name, value)
    return previous


@contextmanager
def knobs(**values):
    """set_knob for each keyword inside the block, the previous values restored after it."""
    saved = {}
    try:
        for name, value in values.items():
            saved[name] = set_knob(name, value)
        yield
    finally:
        for name, value in saved.items():
            set_knob(name, value)
