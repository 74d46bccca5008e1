"""Pieces every paged-attention kernel of this package shares: the pool's scale pointers and compute
dtype (`_pool_args`), the K/V tile load that converts fp8 codes (`_load_kv`), the dot precision."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype):
    # fp32 tl.dot defaults to tf32 on the GPU; fp32 pools (tests, tiny model) want exact products.
    return "ieee" if dtype == torch.float32 else None


def _pool_args(kv_pool, layer: int) -> dict:
    """The scale pointers and dtypes a page-reading kernel needs: scales [num_pages, Hkv] of the
    layer (fp8 pools; the K pool itself as an unused placeholder otherwise), the compute dtype."""
    if kv_pool.fp8:
        return dict(k_scale=kv_pool.k_scale[layer], v_scale=kv_pool.v_scale[layer], fp8=True,
                    compute=kv_pool.compute_dtype)
    return dict(k_scale=kv_pool.k[layer], v_scale=kv_pool.v[layer], fp8=False, compute=kv_pool.k.dtype)


@triton.jit
def _load_kv(ptr, KV_FP8: tl.constexpr, COMPUTE_DT: tl.constexpr, mask=None):
    """A K or V tile for the attention dots. fp8 pools: the e4m3 codes converted exactly to the
    compute dtype, unscaled: the attention kernels apply the (page, KV head) scales to the small
    score tile (q . k) and to the probabilities (p before p @ v), one multiply per key instead of
    a multiply and a rounding per element."""
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    if KV_FP8:
        x = x.to(COMPUTE_DT)
    return x
