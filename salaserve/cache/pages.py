"""Paged K/V pool for the sparse (InfLLM-v2) layers.

A page holds `block_size` tokens, so InfLLM-v2 block b of a sequence is exactly its page b: block
selection yields page ids through the request's page table. One page table per request is shared
by all sparse layers; page ids index every layer's tensors.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """Raised by PageAllocator.alloc when the pool cannot satisfy a request right now."""


class PageAllocator:
    """Free-list allocator with exact accounting (pages are ints in [0, num_pages))."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"need at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)


class KVPool:
    """K and V for every sparse layer: [n_layers, num_pages, block_size, kv_heads, head_dim]."""

    def __init__(self, n_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.block_size = block_size
        self.allocator = PageAllocator(num_pages)
        shape = (n_layers, num_pages, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_page(n_layers, block_size, kv_heads, head_dim, dtype) -> int:
        return 2 * n_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [length, kv_heads, head_dim] of one sequence (torch backend / tests)."""
        k = self.k[layer, pages].flatten(0, 1)[:length]
        v = self.v[layer, pages].flatten(0, 1)[:length]
        return k, v
