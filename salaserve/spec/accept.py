"""Acceptance of drafted tokens against the target model's logits.

Greedy: the longest prefix of the draft equal to the target's argmax, then the target's own next
token. Sampling: speculative rejection sampling for a deterministic drafter (the draft puts all its
mass on one token): accept draft d with probability p(d); on rejection sample from p with d
removed, renormalised; after a fully accepted draft sample the bonus token from p. The emitted
tokens are then distributed exactly as sampling from the target one token at a time.

Trees of point-mass candidates (`accept_sampling_tree`): at a node, its children are tried in
order against a residual that starts as p and loses each rejected child's token (zeroed,
renormalised); the first accepted child becomes the node, and when all are rejected the emitted
token is drawn from the last residual. Child c is emitted with probability p(c): the mass removed
before it is exactly what the earlier children were emitted with, so the emitted token is ~ p.
"""

from __future__ import annotations

import torch

from salaserve.core.distribution import effective_top_k, keep_mask, mix_seed
from salaserve.spec.tree import DraftTree


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """The sampler's distribution for one request: softmax(logits / T) filtered by top-k, top-p
    and min-p, renormalised. logits [n, V] fp32 -> probs [n, V]."""
    vocab = logits.shape[-1]
    probs = torch.softmax(logits / params.temperature, dim=-1)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    n = logits.shape[0]
    dev = logits.device
    keep = keep_mask(sorted_p, torch.full((n,), float(effective_top_k(params, vocab)), device=dev),
                     torch.full((n,), float(params.top_p), device=dev),
                     torch.full((n,), float(params.min_p), device=dev),
                     params.top_p < 1.0, params.min_p > 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)


def accept_greedy(logits: torch.Tensor, draft: list[int]) -> list[int]:
    """logits [k+1, V] at the verified positions; returns the accepted drafts + the next token."""
    target = logits.argmax(-1).tolist()
    out = []
    for i, d in enumerate(draft):
        if d != target[i]:
            break
        out.append(d)
    out.append(target[len(out)])
    return out


def accept_sampling(logits: torch.Tensor, draft: list[int], params, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling against a point-mass draft; exact in distribution."""
    probs = target_probs(logits.float(), params)
    u = torch.rand(len(draft) + 1, generator=generator, device=probs.device).tolist()
    out = []
    for i, d in enumerate(draft):
        p = probs[i]
        if u[i] < float(p[d]):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was a point mass on d, so u < p(d) = 1 always; kept for safety
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out


def accept_sampling_tree(logits: torch.Tensor, tree: DraftTree, params,
                         generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Multi-candidate rejection sampling over a tree of point-mass candidates; exact in
    distribution. logits [n+1, V] at the verify rows (row 0 = root). Returns (emitted tokens,
    verify rows the commit replays), as accept_greedy_tree."""
    probs = target_probs(logits.float(), params)
    # one uniform per candidate: each is tried at most once
    u = torch.rand(len(tree), generator=generator, device=probs.device).tolist()
    tokens, rows, node = [], [0], -1
    while True:
        residual = probs[node + 1].clone()
        accepted = None
        for c in tree.children(node):
            t = tree.tokens[c]
            if u[c] < float(residual[t]):
                accepted = c
                break
            residual[t] = 0.0
            total = float(residual.sum())
            if total <= 0.0:  # the residual was a point mass on t (rounding): t is the only outcome
                accepted = c
                break
            residual /= total
        if accepted is None:  # every child rejected (or a leaf: the bonus token from p)
            tokens.append(int(torch.multinomial(residual, 1, generator=generator)))
            return tokens, rows
        tokens.append(tree.tokens[accepted])
        rows.append(accepted + 1)
        node = accepted


def spec_generator(params, num_generated: int, device, shared: torch.Generator | None) -> torch.Generator | None:
    """Seeded requests draw from their own generator, positioned by their step count."""
    if params.seed is None:
        return shared
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(params.seed, num_generated) ^ 0x5BEC)
    return g
