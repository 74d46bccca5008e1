"""Prompt prefix cache: the caches of recent prompts, kept after their requests moved on, so that
a later prompt that starts with one of them (a shared system prompt, a conversation's earlier
turns) prefills only the rest.

The Lightning layers make this different from a K/V radix cache: their state is one recurrent
matrix per layer and head, whose value at a position cannot be recovered from the K/V pages. So an
entry is a prompt prefix snapshot when a prefill chunk ends there: copies of its K/V pages (fp8
scales included), its compressed-key pages, and its Lightning state in a slot of its own
(EngineArgs.prefix_cache_slots slots are set aside for this). Snapshots are taken of every whole
prompt (a conversation's next turn extends it) and, when a new prompt shares a long enough
prefix with an entry without extending it (the same system prompt, another question), of that
common prefix: the new prompt's prefill pauses there for it, so the third such prompt reuses it.
A new prompt reuses the longest entry that is a proper prefix of it: its request starts from a
copy of the entry and prefills from there, exactly as if its own prefill had stopped at that
chunk boundary.

Cached values can depend on more than the tokens: InfLLM-v2's stage 1 treats prompt tokens by a
rule that depends on the prompt's length (reference.visible_count), so an entry records the class
of the prompt that computed it (`variant`, SparseConfig.prompt_class) and a request reuses it only
when it would have computed the same values (Engine._can_reuse): hits give exactly the uncached
outputs. Entries shorter than dense_len were computed densely and fit any prompt.

Entries give their pages back (least recently used first) whenever the scheduler is short of
pages, before anything running is preempted; Engine.flush_cache empties the cache (the
/flush_cache route). Preempted requests, which recompute from scratch, resume from the longest
entry their tokens extend. This module does the bookkeeping; the engine (Engine._cache_prefix,
_reuse_cached_prompts, _reclaim_pages) allocates, copies and frees.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CachedPrompt:
    tokens: list[int]  # the prompt whose caches these are
    pages: list[int]  # copies of its K/V and compressed-key pages (ceil(len / block) of them)
    state_slot: int  # its Lightning state after the last prompt token
    last_used: int = 0
    # the stage-1 prompt class (SparseConfig.prompt_class) of the prompt whose prefill computed it;
    # None: its values depend on the tokens alone (Engine._prefix_variant)
    variant: int | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, max_entries: int, min_tokens: int):
        self.max_entries = max_entries
        self.min_tokens = min_tokens
        self.entries: list[CachedPrompt] = []
        self._clock = 0
        self.version = 0  # bumped when entries come or go: a prompt checked at this version needs no new lookup

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    @property
    def num_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries)

    def _touch(self, entry: CachedPrompt) -> None:
        self._clock += 1
        entry.last_used = self._clock

    def lookup(self, prompt: list[int], usable=None) -> CachedPrompt | None:
        """The longest entry that is a proper prefix of prompt (the request still has a token of
        its own to compute, whose logits give its first output token), and for which usable(entry)
        holds where given, marked as used."""
        best = None
        for e in self.entries:
            # (first and last tokens before the whole slice: most prompts differ there already)
            if (e.length < len(prompt) and (best is None or e.length > best.length) and prompt[0] == e.tokens[0]
                    and prompt[e.length - 1] == e.tokens[-1] and prompt[:e.length] == e.tokens
                    and (usable is None or usable(e))):
                best = e
        if best is not None:
            self._touch(best)
        return best

    def split_point(self, prompt: list[int]) -> int:
        """The longest common prefix of prompt with an entry, where it is at least min_tokens long
        and leaves prompt a token of its own (else 0): worth a snapshot, since two prompts already
        share it (a system prompt, a few-shot preamble)."""
        best = 0
        for e in self.entries:
            n = min(e.length, len(prompt) - 1)
            if n >= self.min_tokens and prompt[:self.min_tokens] == e.tokens[:self.min_tokens]:
                best = max(best, _common_prefix(prompt, e.tokens, n))
        return best if best >= self.min_tokens else 0

    def wants(self, prompt: list[int], variant: int | None = None) -> bool:
        """Whether a prompt that has just been prefilled (with this variant) should be cached: long
        enough, and not held already (a held one is marked as used instead)."""
        if not self.enabled or len(prompt) < self.min_tokens:
            return False
        for e in self.entries:
            if e.tokens == prompt and e.variant == variant:
                self._touch(e)
                return False
        return True

    def add(self, entry: CachedPrompt) -> None:
        if len(self.entries) >= self.max_entries:
            raise RuntimeError("prefix cache full: evict an entry first")
        self._touch(entry)
        self.entries.append(entry)
        self.version += 1

    def pop_lru(self) -> CachedPrompt | None:
        """Remove and return the least recently used entry (its pages and slot for the caller to
        free), or None when empty."""
        if not self.entries:
            return None
        entry = min(self.entries, key=lambda e: e.last_used)
        self.entries.remove(entry)
        self.version += 1
        return entry


def _common_prefix(a: list[int], b: list[int], n: int) -> int:
    """Length of the common prefix of a and b, at most n: a bisection over slice comparisons (each
    done in C), ~log2(n) of them, instead of a Python loop over up to a million tokens."""
    lo, hi = 0, n  # a[:lo] == b[:lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
