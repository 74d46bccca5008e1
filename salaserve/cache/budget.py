"""Splits the memory left after the weights between Lightning state slots and KV pages.

Slots bound concurrency (48 MiB each at full size, fp32), pages bound total context (about
8.5 KiB per token over the 8 sparse layers, compressed keys included).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import FP8, FP8_STAGE_MAX_BYTES, KVPool
from salaserve.cache.state import StatePool
from salaserve.config import EngineArgs, ModelConfig

log = logging.getLogger("salaserve")

CPU_DEFAULT_TOKENS = 1 << 17  # page budget on CPU when max_total_tokens is not given
ACTIVATION_RESERVE = 6 * 2**30  # GPU bytes kept free for activations, logits, graphs and fla


@dataclass
class CachePlan:
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes

    def describe(self, block_size: int) -> str:
        gib = 2**30
        return (f"KV pages: {self.num_pages} x {block_size} tokens = {self.num_pages * block_size} tokens "
                f"({self.num_pages * self.page_bytes / gib:.2f} GiB); Lightning state slots: {self.num_slots} "
                f"({self.num_slots * self.slot_bytes / gib:.2f} GiB)")


def plan_caches(cfg: ModelConfig, args: EngineArgs, device: torch.device, kv_dtype: torch.dtype,
                state_dtype: torch.dtype, compressed_dtype: torch.dtype | None = None) -> CachePlan:
    """compressed_dtype: the compressed keys' dtype (the model dtype; default kv_dtype)."""
    sc = cfg.sparse
    n_sparse, n_light = len(cfg.sparse_layers), len(cfg.lightning_layers)
    comp_dtype = compressed_dtype or kv_dtype
    page_bytes = (KVPool.bytes_per_page(n_sparse, sc.block_size, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
                  + CompressedKeyPool.bytes_per_page(sc, n_sparse, cfg.num_key_value_heads, cfg.head_dim, comp_dtype))
    slot_bytes = StatePool.bytes_per_slot(n_light, cfg.lightning_nh, cfg.lightning_head_dim, state_dtype)
    # on CUDA one extra slot (and page) is reserved for the padding rows of graph batches; the
    # prefix cache's entries hold slots of their own
    num_slots = args.max_running_requests + args.prefix_cache_slots + (1 if device.type == "cuda" else 0)
    if args.max_total_tokens is not None:
        num_pages = -(-args.max_total_tokens // sc.block_size)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights and whatever else is resident
        stage = FP8_STAGE_MAX_BYTES if kv_dtype == FP8 else 0  # the sparse prefill's dequantized copy
        budget = int(total * args.mem_fraction_static) - used - ACTIVATION_RESERVE - stage - num_slots * slot_bytes
        num_pages = budget // page_bytes
        if num_pages < 1:
            raise RuntimeError(
                f"not enough GPU memory for the caches: {budget / 2**30:.1f} GiB left after weights, "
                f"{num_slots} state slots and the activation reserve; lower --max-running-requests or "
                f"raise --mem-fraction-static")
    else:
        num_pages = CPU_DEFAULT_TOKENS // sc.block_size
    return CachePlan(num_pages=int(num_pages), num_slots=num_slots, page_bytes=page_bytes, slot_bytes=slot_bytes)
