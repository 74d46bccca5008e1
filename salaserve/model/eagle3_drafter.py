"""EAGLE-3 drafting for one request: the head's own K/V over recent positions, a top-k tree.

The engine hands the drafter the target's captured hidden states of the positions it committed
(`observe`), and asks for a draft when the request decodes next (`propose`). The head's input at
position i is (target hidden state at i, the token at i + 1): a pair becomes computable once
that token is known, so observed states wait in `pending` until `propose` sees the token.

The draft's K/V of committed positions depend on that position's pair only (one decoder layer),
so they are computed once and kept: the last `window` positions, the rest dropped (the head then
attends to a bounded recent context; memory per request is window x 2 x kv_heads x head_dim).
Everything lives on the request (`Request.drafter`) and goes when the engine drops it.
"""

from __future__ import annotations

import torch

from salaserve.model.eagle3 import Eagle3Head
from salaserve.spec.tree import DraftTree


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, depth: int = 5, topk: int = 1, window: int = 128):
        if depth < 1 or topk < 1 or window < 1:
            raise ValueError(f"need depth, topk, window >= 1, got {depth}, {topk}, {window}")
        self.head, self.depth, self.topk, self.window = head, depth, topk, window
        self.pending: dict[int, torch.Tensor] = {}  # position -> target aux hidden [3*H]
        self.cache_pos: list[int] = []  # positions of the cached K/V rows, increasing
        self.cache_k = self.cache_v = None  # [1, P, Hkv, d]
        self.root: tuple[int, torch.Tensor] | None = None  # (position p, head output at p)
        self.last_tree: DraftTree | None = None

    # ---- what the target computed --------------------------------------------------------------
    def observe(self, position: int, aux: torch.Tensor) -> None:
        """The target's aux hidden state [3*H] at a committed position. A position seen again (the
        request was recomputed) replaces what followed it."""
        self.pending = {p: a for p, a in self.pending.items() if p < position}
        self.pending[position] = aux.clone()  # a row of the step's output: not a view that keeps it all
        if len(self.pending) > self.window:  # drafts are not asked for (e.g. a large batch)
            for p in sorted(self.pending)[:len(self.pending) - self.window]:
                del self.pending[p]

    def _truncate(self, position: int) -> None:
        """Forget cached positions >= position."""
        keep = sum(1 for p in self.cache_pos if p < position)
        if keep < len(self.cache_pos):
            self.cache_pos = self.cache_pos[:keep]
            self.cache_k, self.cache_v = self.cache_k[:, :keep], self.cache_v[:, :keep]
        if self.root is not None and self.root[0] >= position:
            self.root = None

    @torch.no_grad()
    def _commit(self, tokens: list[int]) -> None:
        """Run the head over the pending pairs whose next token is known; cache their K/V."""
        ready = sorted(p for p in self.pending if p + 1 < len(tokens))
        if not ready:
            return
        self._truncate(ready[0])
        head = self.head
        dev = head.fc.weight.device
        aux = torch.stack([self.pending.pop(p) for p in ready]).to(dev)
        nxt = torch.tensor([tokens[p + 1] for p in ready], device=dev)
        pos = torch.tensor(ready, device=dev)
        P = len(self.cache_pos)
        # each new row sees the cache and the new rows at or before its position
        mask = torch.ones(len(ready), P + len(ready), dtype=torch.bool, device=dev)
        mask[:, P:] = pos[None, :] <= pos[:, None]
        out, k, v = head.layer(head.embed_tokens(nxt)[None], head.fuse(aux)[None], pos[None],
                               self.cache_k, self.cache_v, mask[None])
        self.cache_k = k if self.cache_k is None else torch.cat([self.cache_k, k], dim=1)
        self.cache_v = v if self.cache_v is None else torch.cat([self.cache_v, v], dim=1)
        self.cache_pos += ready
        if len(self.cache_pos) > self.window:
            cut = len(self.cache_pos) - self.window
            self.cache_pos = self.cache_pos[cut:]
            self.cache_k, self.cache_v = self.cache_k[:, cut:], self.cache_v[:, cut:]
        self.root = (ready[-1], out[0, -1])

    # ---- drafting --------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, tokens: list[int], k: int, topk: int | None = None) -> DraftTree:
        """A tree of at most `depth` levels (and k levels) of `topk` candidates each (the argument,
        else the drafter's), in target ids. Its first path is the head's greedy chain."""
        self._commit(tokens)
        depth = min(self.depth, k)
        if depth <= 0 or self.root is None or self.root[0] != len(tokens) - 2:
            self.last_tree = DraftTree((), ())
            return self.last_tree
        head = self.head
        p, root_out = self.root
        dev = root_out.device
        K = topk or self.topk
        tok: list[int] = []  # target ids of the tree nodes
        parents: list[int] = []
        node_k, node_v = [], []  # K/V rows of computed nodes ([1, 1, Hkv, d] each)
        computed: list[int] = []  # node index of each node_k row
        anc: list[set[int]] = []  # ancestors of each node (node indices, itself included)
        # level 1: the root's top-k
        logp = torch.log_softmax(head.logits(root_out[None]), dim=-1)[0]
        top = logp.topk(min(K, logp.numel()))
        frontier = []  # (node index, its input hidden = the parent's output)
        for s, d in zip(top.values.tolist(), top.indices.tolist()):
            i = len(tok)
            tok.append(int(head.target_ids(torch.tensor(d, device=dev))))
            parents.append(-1)
            anc.append({i})
            frontier.append((i, root_out, s))
        for level in range(1, depth):
            n = len(frontier)
            ids = torch.tensor([tok[i] for i, _, _ in frontier], device=dev)
            hid = torch.stack([h for _, h, _ in frontier])
            pos = torch.full((1, n), p + level, device=dev)
            past_k = self._past(node_k, self.cache_k)
            past_v = self._past(node_v, self.cache_v)
            P = len(self.cache_pos)
            mask = torch.zeros(n, P + len(computed) + n, dtype=torch.bool, device=dev)
            mask[:, :P] = True
            for r, (i, _, _) in enumerate(frontier):
                for c, j in enumerate(computed):
                    mask[r, P + c] = j in anc[i]
                mask[r, P + len(computed) + r] = True
            out, kk, vv = head.layer(head.embed_tokens(ids)[None], hid[None], pos, past_k, past_v, mask[None])
            for r, (i, _, _) in enumerate(frontier):
                node_k.append(kk[:, r:r + 1])
                node_v.append(vv[:, r:r + 1])
                computed.append(i)
            lp = torch.log_softmax(head.logits(out[0]), dim=-1)  # [n, Vd]
            # candidates: each frontier node's top-k children, scored by the path's log-prob; the
            # first frontier node's best child goes first so that the first path stays greedy
            ck = lp.topk(min(K, lp.shape[-1]), dim=-1)
            cands = []
            for r, (i, _, s) in enumerate(frontier):
                for s2, d in zip(ck.values[r].tolist(), ck.indices[r].tolist()):
                    cands.append((s + s2, r, d))
            first = cands[0]
            rest = sorted(cands[1:], key=lambda c: -c[0])[:K - 1]
            nxt = []
            for s, r, d in [first] + sorted(rest, key=lambda c: (c[1], -c[0])):
                i = len(tok)
                parent = frontier[r][0]
                tok.append(int(head.target_ids(torch.tensor(d, device=dev))))
                parents.append(parent)
                anc.append(anc[parent] | {i})
                nxt.append((i, out[0, r], s))
            frontier = nxt
        self.last_tree = DraftTree(tuple(tok), tuple(parents))
        return self.last_tree

    @staticmethod
    def _past(rows: list[torch.Tensor], cache: torch.Tensor | None) -> torch.Tensor | None:
        parts = ([cache] if cache is not None else []) + rows
        return torch.cat(parts, dim=1) if parts else None
