"""Prompt-lookup (n-gram) drafter: continue the sequence the way it continued before.

The index maps every n-gram (n = min_n..max_n) of the request's tokens to the position right after
its most recent occurrence. It is extended as tokens arrive (O(max_n) per token), so proposing is
O(max_n + k) whatever the context length, 1M tokens included.
"""

from __future__ import annotations


class NgramDrafter:
    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> position after its latest occurrence
        self.indexed = 0  # tokens[:indexed] are in the index as n-gram *ends*, except the last one

    def _index_upto(self, tokens: list[int], end: int) -> None:
        """Index n-grams ending at positions indexed .. end-1 (each maps to its next position)."""
        for e in range(self.indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if e + 1 >= n:
                    self.index[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the sequence's suffix."""
        return self.lookup(tokens, k)[1]

    def lookup(self, tokens: list[int], k: int) -> tuple[int, list[int]]:
        """(n, draft): the length of the longest suffix n-gram seen earlier and up to k tokens that
        followed it; (0, []) without a match."""
        L = len(tokens)
        # Index every n-gram ending before the last token; the suffix itself must not match itself.
        self._index_upto(tokens, L - 1)
        if k <= 0:
            return 0, []
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            start = self.index.get(tuple(tokens[L - n:]))
            if start is not None and start < L:
                return n, tokens[start:start + k]
        return 0, []
