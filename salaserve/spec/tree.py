"""Draft trees: the verify metadata for drafters that propose several continuations at once.

A verify step feeds the sequence's pending token (the root, row 0) followed by n candidates in
topological order; candidate i (row i + 1) has `parents[i]`: the index of its parent candidate, or
-1 for a child of the root. An n-gram draft is a chain (parents -1, 0, 1, ...). A tree drafter
(EAGLE-3 style) proposes siblings: alternatives for the same position.

What each layer needs from this metadata:
  - positions: cache_len + depth (siblings share a position);
  - sparse layers: candidate i attends to the cache and to its ancestors only (`ancestor_mask`),
    and selects blocks as a decode query at its position;
  - Lightning layers (root depth 0): o_i = scale (gamma^(depth_i + 1) q_i S0 + sum over j on
    its path (the root, its ancestors, i) of gamma^(depth_i - depth_j) (q_i . k_j) v_j): the
    chunk form of `lightning_verify` with the causal mask replaced by `ancestor_mask` and t by
    the depth (its `tree` argument);
  - commit: replay the accepted path's rows (`accept_greedy_tree` / `accept_sampling_tree` return
    them), not a prefix: Lightning states and, since siblings share a position, the sparse
    layers' K/V and compressed keys of the path.
A backend that verifies trees says so (`supports_tree_verify`; the torch backend's ground truth is
kernels/tree_verify.py); on the others the engine verifies a tree drafter's `first_path()`, a
chain. Chains always take the chain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from salaserve.core.batch import tree_row_depths


def path_rows(parents, row: int) -> list[int]:
    """Verify rows from the root (row 0) down to `row` (row = candidate + 1) of the tree with these
    parent candidates, in order: what a decode of that row's path would have fed."""
    out = [row]
    while out[-1]:
        out.append(parents[out[-1] - 1] + 1)
    return out[::-1]


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # candidate tokens, parents before children
    parents: tuple[int, ...]  # parent candidate index per candidate, -1 = the root (pending token)

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"candidate {i} has parent {p}: parents must come first (-1 = root)")

    @classmethod
    def chain(cls, tokens) -> "DraftTree":
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of each candidate: 1 for the root's children (its position is cache_len + depth)."""
        return tree_row_depths(self.parents)[1:]

    @property
    def max_depth(self) -> int:
        """Positions past the root the tree spans (0 when empty): a chain's length."""
        return max(self.depths(), default=0)

    def path_rows(self, row: int) -> list[int]:
        """Verify rows from the root (row 0) down to `row` (row = candidate + 1), in order."""
        return path_rows(self.parents, row)

    def pruned(self, max_depth: int) -> "DraftTree":
        """The candidates at depth <= max_depth (their ancestors are kept with them), re-indexed."""
        depths, index = self.depths(), {}
        tokens, parents = [], []
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if depths[i] <= max_depth:
                index[i] = len(tokens)
                tokens.append(t)
                parents.append(-1 if p < 0 else index[p])
        return DraftTree(tuple(tokens), tuple(parents))

    def children(self, node: int) -> list[int]:
        """Candidates whose parent is `node` (-1: the root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def first_path(self) -> list[int]:
        """Tokens along the first child at every level: the chain a chain-only verify can take."""
        out, node = [], -1
        while (kids := self.children(node)):
            node = kids[0]
            out.append(self.tokens[node])
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over the verify rows (row 0 = root): row r may attend to column c iff c
        is r or one of its ancestors. A chain gives the causal (lower-triangular) mask."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            r = i + 1
            mask[r] = mask[p + 1]
            mask[r, r] = True
        return mask


def accept_greedy_tree(logits: torch.Tensor, tree: DraftTree) -> tuple[list[int], list[int]]:
    """Greedy acceptance over a tree. logits [n+1, V] at the verify rows (row 0 = root).
    From the root, follow the child whose token is the target's argmax while there is one.
    Returns (emitted tokens = accepted candidates + the target's next token, verify rows whose
    k/v the commit replays = 0 followed by the accepted candidates' rows)."""
    target = logits.argmax(-1).tolist()
    tokens, rows = [], [0]
    node = -1
    while True:
        want = target[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return tokens + [want], rows
        tokens.append(want)
        rows.append(nxt + 1)
        node = nxt
