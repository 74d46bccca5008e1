"""N-gram routing for a model drafter (EAGLE-3): prompt lookup first, the head otherwise.

Where the sequence's suffix occurred before (code repeating an identifier, a quoted passage), the
continuation found by prompt lookup is a better draft than the head's and costs no forward: a
match of at least `min_n` tokens becomes a chain draft and the head is not run that step. The head
still observes every committed hidden state; its pairs wait in its pending states and are
computed at its next propose (Eagle3Drafter._commit), so its K/V cache stays complete.
"""

from __future__ import annotations

from salaserve.spec.ngram import NgramDrafter


class NgramRouter:
    def __init__(self, drafter, min_n: int, max_n: int):
        """drafter: the model drafter (observe, propose(tokens, k, topk)); min_n: the shortest
        suffix match that routes a step to prompt lookup."""
        self.drafter = drafter
        self.ngram = NgramDrafter(max(max_n, min_n), min_n)
        self.routed = False  # whether the latest propose was answered by prompt lookup

    def observe(self, position: int, aux) -> None:
        self.drafter.observe(position, aux)

    def propose(self, tokens: list[int], k: int, topk: int | None = None):
        _, chain = self.ngram.lookup(tokens, k)
        self.routed = bool(chain)
        return chain if chain else self.drafter.propose(tokens, k, topk=topk)
