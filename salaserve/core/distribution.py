"""The token distribution a request's SamplingParams ask for, where two places must agree on it.

The sampler (engine/sampler.py) draws from it; speculative acceptance (spec/accept.py) accepts a
drafted token with its probability. Both truncate with `keep_mask` and seed a request's step with
`mix_seed`, so that speculation keeps the distribution of plain sampling exactly.
"""

from __future__ import annotations

import torch

from salaserve.core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a well-spread 64-bit generator seed per request step."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keep_mask(sorted_p, top_k, top_p, min_p, need_p: bool, need_min_p: bool) -> torch.Tensor:
    """Which entries of each descending-sorted probability row survive top-k, top-p, min-p."""
    ranks = torch.arange(sorted_p.shape[1], device=sorted_p.device)
    keep = ranks[None, :] < top_k[:, None]
    if need_p:
        kept = sorted_p * keep
        cum = kept.cumsum(dim=-1)
        before = cum - kept  # mass strictly ahead of each entry
        # Nucleus of the top-k survivors: the smallest prefix whose mass reaches top_p of theirs.
        # (cum[:, -1], not a separate sum: identical whatever the window width,
        # see engine/sampler.py's module doc)
        limit = torch.where(top_p < 1.0, top_p * cum[:, -1], torch.inf)
        keep &= before < limit[:, None]
    if need_min_p:
        keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    return keep


def effective_top_k(p: SamplingParams, vocab: int) -> int:
    """The number of tokens top-k keeps: the whole vocabulary when top-k is off."""
    return vocab if p.top_k <= 0 else min(p.top_k, vocab)
