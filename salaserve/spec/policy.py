"""How much to speculate at the current load: a draft shape from the number of decoding requests.

A verify step feeds 1 + draft tokens per request; at batch 1 the step is memory bound and the
extra tokens are nearly free, as the batch grows they cost compute the rejected drafts waste. So
the draft gets shallower (and narrower) as more requests decode, and stops at high load.

The table is a list of levels `max_batch:depth:topk`, increasing in max_batch: a step with n
decoding requests belongs to the first level with n <= max_batch, past the last level it is off.
The shape moves to another level only once the load has stayed in that level for `patience`
consecutive steps (hysteresis: a load that wobbles across a threshold does not flap the shape).
The engine's `speculative_max_batch` stays a hard cap on top (off at once above it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftShape:
    depth: int  # most draft tokens along a path (0: no draft)
    topk: int  # candidates per tree level (1: a chain)

    @property
    def off(self) -> bool:
        return self.depth <= 0


OFF = DraftShape(0, 1)
DEFAULT_LEVELS = "1:5:4,4:3:2,8:2:1"


def parse_levels(spec: str) -> list[tuple[int, DraftShape]]:
    """'1:5:4,4:3:2,8:2:1' -> [(1, DraftShape(5, 4)), ...]; topk may be left out (1)."""
    levels = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) not in (2, 3) or not all(f.strip().isdigit() for f in fields):
            raise ValueError(f"speculative load level {part!r}: want max_batch:depth[:topk] (integers)")
        n, depth, topk = (int(f) for f in fields + ["1"][:3 - len(fields)])
        if n < 1 or depth < 1 or topk < 1:
            raise ValueError(f"speculative load level {part!r}: max_batch, depth, topk must be >= 1")
        if levels and n <= levels[-1][0]:
            raise ValueError(f"speculative load levels {spec!r}: max_batch must increase")
        levels.append((n, DraftShape(depth, topk)))
    if not levels:
        raise ValueError("speculative load levels: none given")
    return levels


class SpeculationPolicy:
    def __init__(self, levels: list[tuple[int, DraftShape]], max_depth: int, max_topk: int = 1,
                 patience: int = 4, hard_cap: int | None = None):
        """max_depth / max_topk: the configured draft's (a level never exceeds them); hard_cap: no
        draft above this many decoding requests, without waiting for the hysteresis."""
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.levels = levels
        self.max_depth, self.max_topk, self.patience, self.hard_cap = max_depth, max_topk, patience, hard_cap
        self.level = 0  # index into levels; len(levels): off. Starts deep (an idle server's first request)
        self._candidate, self._count = 0, 0  # a level the load has been in, and for how many steps
        self.n = 0  # decoding requests of the latest step

    def _level_of(self, n: int) -> int:
        return next((i for i, (cap, _) in enumerate(self.levels) if n <= cap), len(self.levels))

    def update(self, n: int) -> DraftShape:
        """Once per step with the number of decoding requests; returns the step's shape."""
        self.n = n
        want = self._level_of(n)
        if want == self.level:
            self._count = 0
        else:
            self._count = self._count + 1 if want == self._candidate else 1
            self._candidate = want
            if self._count >= self.patience:
                self.level, self._count = want, 0
        return self.shape

    @property
    def shape(self) -> DraftShape:
        if self.level >= len(self.levels) or (self.hard_cap is not None and self.n > self.hard_cap):
            return OFF
        s = self.levels[self.level][1]
        return DraftShape(min(s.depth, self.max_depth), min(s.topk, self.max_topk))
