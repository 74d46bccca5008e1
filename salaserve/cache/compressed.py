"""InfLLM-v2 compressed keys (C1, C2), stored page-aligned beside the K/V pages.

C1 entry j (mean of keys 16j..16j+31) lives in page j // 4 at slot j % 4, C2 entry i (mean of keys
64i..64i+127) in page i: both levels are indexed through the request's page table and freed with
its pages, so block ids, page ids and compressed-entry ids share one map. Entries are written
incrementally as they are born (C1 at token 16j+31, C2 at 64i+127), from the first token on; the
values equal the reference's bulk build (spec 3.3).
"""

from __future__ import annotations

import torch

from salaserve.config import SparseConfig


def num_entries(length: int, kernel: int, stride: int) -> int:
    """Complete compression windows in a sequence of `length` keys."""
    return max(0, (length - kernel) // stride + 1)


class CompressedKeyPool:
    """c1: [n_layers, num_pages, c1_per_block, kv_heads, d]; c2: [n_layers, num_pages, c2_per_block, ...]."""

    def __init__(self, sc: SparseConfig, n_layers: int, num_pages: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        if sc.block_size % sc.c2_kernel_stride != 0:
            raise ValueError("block_size must be a multiple of the C2 stride for page-aligned C2 entries")
        self.sc = sc
        self.c1_per_page = sc.block_size // sc.kernel_stride
        self.c2_per_page = sc.block_size // sc.c2_kernel_stride
        self.c1 = torch.zeros(n_layers, num_pages, self.c1_per_page, kv_heads, head_dim, dtype=dtype, device=device)
        self.c2 = torch.zeros(n_layers, num_pages, self.c2_per_page, kv_heads, head_dim, dtype=dtype, device=device)
        self.entries_in_use = 0  # live C1 + C2 entries over all sequences (accounting for tests/metrics)

    @staticmethod
    def bytes_per_page(sc: SparseConfig, n_layers, kv_heads, head_dim, dtype) -> int:
        per_entry = n_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return per_entry * (sc.block_size // sc.kernel_stride + sc.block_size // sc.c2_kernel_stride)

    def counts(self, length: int) -> tuple[int, int]:
        sc = self.sc
        return (num_entries(length, sc.kernel_size, sc.kernel_stride),
                num_entries(length, sc.c2_kernel_size, sc.c2_kernel_stride))

    def on_extend(self, old_len: int, new_len: int) -> None:
        a1, a2 = self.counts(old_len)
        b1, b2 = self.counts(new_len)
        self.entries_in_use += (b1 - a1) + (b2 - a2)

    def on_release(self, length: int) -> None:
        self.entries_in_use -= sum(self.counts(length))

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous C1 [n1, kv_heads, d] and C2 [n2, kv_heads, d] of one sequence of `length` keys."""
        n1, n2 = self.counts(length)
        return (self.c1[layer, pages].flatten(0, 1)[:n1], self.c2[layer, pages].flatten(0, 1)[:n2])
