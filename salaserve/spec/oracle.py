"""A drafter that knows the answer: proposes the continuation a reference run produced.

For benchmarks and tests on random weights, where real drafters are rarely right: it exercises
acceptance, the Lightning state replay and sparse verify at a chosen accept rate. `error_every`
corrupts every n-th proposed token so partial acceptance and rollback are exercised too.
"""

from __future__ import annotations


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
