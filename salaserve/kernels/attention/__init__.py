"""Triton kernels for the sparse layers' dense attention and cache maintenance.

What lives here, one module per kernel family (the InfLLM-v2 selection and the per-token
block-sparse attention live in kernels/sparse/):

- kv_store.py   `store_kv`: scatter a step's new K/V rows into the paged pool (one launch for K and V);
                `dequantize_pages`: fp8 pages in the compute dtype
- compress.py   `update_compressed`: write every C1/C2 compressed-key entry born during the step
- prefill.py    `dense_prefill_attention`: varlen causal flash attention of new tokens over the whole
                paged cache
- decode.py     `paged_decode_attention`: one query per sequence over a per-(sequence, KV head) list
                of pages, split over programs (flash-decoding) + a small reduction kernel;
                `dense_block_table`: the all-pages list for dense sequences, built on the device;
                `choose_num_splits`
- common.py     what they share: the pool's scale pointers, the fp8-converting K/V tile load

Layouts (see cache/pages.py, cache/compressed.py, engine/batch.py):
- K/V pool of one layer: [num_pages, block_size, Hkv, d], contiguous; page b of a sequence holds its
  tokens [b*block_size, (b+1)*block_size).
- page ids are int32 in the tables; every address into a pool is formed in int64 (a pool layer can
  exceed 2^31 elements).
- GQA: query head h uses KV head h // (Hq // Hkv). The attention kernels pack the GROUP query
  heads of one KV head as rows of the tl.dot M dimension, so each K/V tile is loaded once for the
  whole group.

FP8 pools (`--kv-cache-dtype fp8_e4m3`, cache/pages.py): K/V pages in e4m3 with an fp32 scale per
(layer, page, KV head). store_kv sets the scales and quantizes in one kernel, as KVPool.write
(same scales, same e4m3 codes). The attention kernels feed the e4m3 codes, converted exactly, to
the dots and apply the scales to the score tile (per key column) and to the probabilities before
p @ v: the same products as with dequantized pages, without rounding K and V to the compute dtype
(the torch backend's KVPool.gather rounds them once). The compressed-key update dequantizes as
KVPool.gather does.

Graph safety: the decode-path wrappers (store_kv, update_compressed on a decode batch,
paged_decode_attention, dense_block_table) never read device tensors on the host; their grids depend
only on static shapes (B, Hkv, num_splits, max_sel) and on host-side batch mirrors that are fixed for
a captured decode batch.
"""

from salaserve.kernels.attention.compress import update_compressed
from salaserve.kernels.attention.decode import (DECODE_CONFIG, choose_num_splits, dense_block_table,
                                                paged_decode_attention)
from salaserve.kernels.attention.kv_store import dequantize_pages, store_kv
from salaserve.kernels.attention.prefill import PREFILL_CONFIG, dense_prefill_attention

__all__ = ["store_kv", "dequantize_pages", "update_compressed", "dense_prefill_attention", "PREFILL_CONFIG",
           "paged_decode_attention", "dense_block_table", "choose_num_splits", "DECODE_CONFIG"]
