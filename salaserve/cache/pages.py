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


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# An fp8 page's scale (per KV head) is set when its first token is written: the amax of the
# tokens of that page written in the same step, times this headroom. Later tokens up to HEADROOM x
# that amax are represented; larger values saturate at +-448 x scale (e4m3 keeps ~3 significant
# bits at every magnitude, so the headroom costs precision only below scale * 2^-6).
FP8_HEADROOM = 8.0
# The block-sparse prefill on fp8 pages dequantizes the batch's pages of one layer into a transient
# compute-dtype copy (kernels/sparse/attention.py) of at most this many bytes (1 GiB: 1M tokens at the
# full-size head geometry; longer batches convert in the kernels); the cache budget keeps it free.
FP8_STAGE_MAX_BYTES = 1 << 30


class KVPool:
    """K and V for every sparse layer: [n_layers, num_pages, block_size, kv_heads, head_dim].

    dtype float8_e4m3fn (`--kv-cache-dtype fp8_e4m3`): K and V are stored in fp8 with an fp32 scale
    per (layer, page, KV head), k_scale / v_scale [n_layers, num_pages, kv_heads]; `write` quantizes
    and `gather` dequantizes to `compute_dtype`.
    """

    def __init__(self, n_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, compute_dtype: torch.dtype | None = None):
        self.block_size = block_size
        self.allocator = PageAllocator(num_pages)
        shape = (n_layers, num_pages, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.fp8 = dtype == FP8
        self.compute_dtype = compute_dtype or (torch.bfloat16 if self.fp8 else dtype)
        if self.fp8:
            self.k_scale = torch.ones(n_layers, num_pages, kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)

    @staticmethod
    def bytes_per_page(n_layers, block_size, kv_heads, head_dim, dtype) -> int:
        data = 2 * n_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        scales = 2 * n_layers * kv_heads * 4 if dtype == FP8 else 0
        return data + scales

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K, V rows [n, kv_heads, head_dim] of n new tokens at flat slots
        (page * block_size + offset)."""
        for pool, scale, x in ((self.k, getattr(self, "k_scale", None), k),
                               (self.v, getattr(self, "v_scale", None), v)):
            flat = pool[layer].view(-1, *x.shape[1:])
            if not self.fp8:
                flat[slots] = x.to(flat.dtype)
                continue
            page = slots // self.block_size
            amax = x.float().abs().amax(-1)  # [n, kv_heads]
            # pages whose first token is in this step take a fresh scale from this step's tokens
            fresh = torch.zeros(scale.shape[1:], dtype=torch.float32, device=x.device)
            fresh.scatter_reduce_(0, page[:, None].expand_as(amax), amax, reduce="amax", include_self=True)
            starts = page[slots % self.block_size == 0]
            scale[layer, starts] = (fresh[starts] * (FP8_HEADROOM / FP8_MAX)).clamp_min(1e-12)
            q = (x.float() / scale[layer, page][:, :, None]).clamp(-FP8_MAX, FP8_MAX)
            flat[slots] = q.to(FP8)

    def gather(self, layer: int, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [length, kv_heads, head_dim] of one sequence (torch backend / tests),
        dequantized to compute_dtype for an fp8 pool."""
        k = self.k[layer, pages]
        v = self.v[layer, pages]
        if self.fp8:
            k = (k.float() * self.k_scale[layer, pages][:, None, :, None]).to(self.compute_dtype)
            v = (v.float() * self.v_scale[layer, pages][:, None, :, None]).to(self.compute_dtype)
        return k.flatten(0, 1)[:length], v.flatten(0, 1)[:length]
