"""A drafter that knows the answer: proposes the continuation a reference run produced.

For benchmarks and tests on random weights, where real drafters are rarely right: it exercises
acceptance, the Lightning state replay and sparse verify at a chosen accept rate. `error_every`
corrupts every n-th proposed token so partial acceptance and rollback are exercised too.
`TreeOracleDrafter` hides the same continuation among wrong siblings of a DraftTree.
"""

from __future__ import annotations

import random

from salaserve.spec.tree import DraftTree


class OracleDrafter:
    def __init__(self, prompt_len: int, continuation: list[int], error_every: int = 0, vocab_size: int = 0):
        self.prompt_len = prompt_len
        self.continuation = continuation
        self.error_every = error_every
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - self.prompt_len  # outputs generated so far
        draft = list(self.continuation[done:done + k])
        self.calls += 1
        if self.error_every and draft and self.calls % self.error_every == 0:
            i = self.calls % len(draft)
            draft[i] = (draft[i] + 1) % self.vocab_size
        return draft


class TreeOracleDrafter:
    """The reference continuation hidden in a tree: at every level the correct token sits at a
    random position among `width` siblings (wrong tokens), and the first wrong sibling has a wrong
    child of its own, so verify meets rows off the accepted path at every depth. `miss_every`:
    every n-th proposal drops the correct token at a random level (0: the whole tree is rejected),
    so partial acceptance and full rejection are exercised too."""

    def __init__(self, prompt_len: int, continuation: list[int], vocab_size: int, depth: int = 3,
                 width: int = 2, miss_every: int = 0, seed: int = 0):
        if width < 1 or depth < 1:
            raise ValueError(f"need depth >= 1 and width >= 1, got {depth}, {width}")
        self.prompt_len, self.continuation = prompt_len, continuation
        self.vocab_size, self.depth, self.width, self.miss_every = vocab_size, depth, width, miss_every
        self.rng = random.Random(seed)
        self.calls = 0
        self.misses: list[int] = []  # the level dropped by each missing proposal (tests)

    def _wrong(self, avoid: set[int]) -> int:
        while True:
            t = self.rng.randrange(self.vocab_size)
            if t not in avoid:
                avoid.add(t)
                return t

    def propose(self, tokens: list[int], k: int) -> DraftTree:
        done = len(tokens) - self.prompt_len
        path = list(self.continuation[done:done + min(self.depth, k)])
        self.calls += 1
        miss = None
        if self.miss_every and path and self.calls % self.miss_every == 0:
            miss = self.rng.randrange(len(path))
            self.misses.append(miss)
        toks: list[int] = []
        parents: list[int] = []
        node = -1
        for level, right in enumerate(path):
            avoid = {right}
            slots = [self._wrong(avoid) for _ in range(self.width)]
            at = self.rng.randrange(self.width)
            if level != miss:
                slots[at] = right
            first = len(toks)
            toks += slots
            parents += [node] * self.width
            wrong = next((first + i for i in range(self.width) if i != at), None)
            if wrong is not None and level + 1 < len(path):  # an off-path subtree one level deeper
                toks.append(self._wrong(set()))
                parents.append(wrong)
            if level == miss:
                break
            node = first + at
        return DraftTree(tuple(toks), tuple(parents))
