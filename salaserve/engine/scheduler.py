"""Continuous batching: which tokens of which requests run in the next step.

Each step: every decoding request first (one token each), then prefill chunks (continuing ones,
then newly admitted requests) up to the token budget. Admission needs a free state slot, room under
max_running_requests and pages for the first chunk. When pages run out mid-decode, the newest
running request is preempted: its pages and slot are freed and it is re-queued to be recomputed
(prompt + output so far) when room returns, so nothing fails and nothing is lost. A waiting
request whose prompt a running request is prefilling stays queued: the engine hands it a copy of
that prefill when it completes (`adopt`, Engine._fork_twins).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable

from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool
from salaserve.cache.state import StatePool
from salaserve.core.request import ADMISSION_ORDERS, Request, Status
from salaserve.spec.tree import DraftTree


# Tokens per prefill chunk while a request's prompt logprobs are computed: each needs a logits
# row (73448 fp32 values for the real vocabulary, ~0.3 GB per 1024 tokens).
PROMPT_LOGPROB_CHUNK = 1024


@dataclass
class ScheduledWork:
    req: Request
    num_tokens: int  # tokens fed this step, starting at req.num_computed (draft tokens included)
    draft: list[int] = field(default_factory=list)  # speculative tokens fed after the pending one
    tree: DraftTree | None = None  # the draft as a tree (draft = its tokens); None: a chain


class Scheduler:
    def __init__(self, kv: KVPool, compressed: CompressedKeyPool, states: StatePool,
                 max_running_requests: int, chunked_prefill_size: int, schedule_policy: str = "fcfs"):
        self.kv = kv
        self.compressed = compressed
        self.states = states
        self.block_size = kv.block_size
        self.max_running = max_running_requests
        self.budget = chunked_prefill_size
        self.prompt_logprob_chunk = PROMPT_LOGPROB_CHUNK
        self.share_prefill = True  # requests with the prompt of one being prefilled wait for its copy
        if schedule_policy not in ADMISSION_ORDERS:
            raise ValueError(f"schedule_policy must be one of {', '.join(ADMISSION_ORDERS)}, got {schedule_policy!r}")
        self.admission_key = ADMISSION_ORDERS[schedule_policy]
        self.waiting: list[Request] = []  # sorted by admission_key
        self.running: list[Request] = []  # admission order; the last is the newest
        self.num_preemptions = 0
        # speculative decoding: returns draft tokens (a list: a chain; or a DraftTree) for a
        # decoding request (given the number of decoding requests this step), or None when
        # speculation is off
        self.propose: Callable[[Request, int], list[int] | DraftTree] | None = None
        # called with a number of pages when fewer are free: gives back pages held for later use
        # (the engine's prefix cache), before anything running is preempted
        self.reclaim: Callable[[int], None] | None = None

    # ---- queue management --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        keys = [self.admission_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self.admission_key(req)), req)

    def adopt(self, req: Request, pages: int, may_reclaim: bool = True) -> bool:
        """Start a waiting request now with `pages` fresh pages and a state slot, its prefill to be
        copied in by the caller (prefill sharing, the prefix cache); False, and nothing changed,
        if the running limit, the slots or the pages (one kept per decoding request) do not allow
        it. may_reclaim=False: only pages free already (the copy's source may be what a reclaim
        would give back)."""
        if req not in self.waiting or len(self.running) >= self.max_running or not self.states.num_free:
            return False
        reserve = self._decode_reserve()
        free = self._num_free_pages(pages + reserve) if may_reclaim else self.kv.allocator.num_free
        if free - reserve < pages:
            return False
        self.waiting.remove(req)
        req.state_slot = self.states.alloc()
        req.pages = self.kv.allocator.alloc(pages)
        req.status = Status.RUNNING
        self.running.append(req)
        return True

    def remove(self, req: Request) -> None:
        """Take a request out of the scheduler (finished or aborted) and free its resources."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        if req.pages:
            self.kv.allocator.free(req.pages)
            req.pages = []
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None
        self.compressed.on_release(req.num_computed)
        req.num_computed = 0

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._release(victim)  # recomputed from scratch (prompt + output so far) on resume
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add(victim)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_free_pages(self, want: int) -> int:
        """Free pages, once pages held for later use were reclaimed if fewer than `want` are free."""
        free = self.kv.allocator.num_free
        if free < want and self.reclaim is not None:
            self.reclaim(want - free)
            free = self.kv.allocator.num_free
        return free

    def _grow(self, req: Request, new_len: int) -> bool:
        need = self._pages_for(new_len) - len(req.pages)
        if need <= 0:
            return True
        if need > self._num_free_pages(need):
            return False
        req.pages.extend(self.kv.allocator.alloc(need))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- the per-step decision ---------------------------------------------------------------
    def schedule(self) -> tuple[list[ScheduledWork], list[Request]]:
        """Returns the step's work and the requests that must finish because they alone exceed
        the page pool (the engine finishes them with reason `length`)."""
        while True:
            work, out_of_room = self._schedule_once()
            if work or out_of_room or len(self.running) < 2:
                return work, out_of_room
            # Every running request is stuck mid-prefill for want of pages: let the older ones on.
            self._preempt(self.running[-1])

    def _schedule_once(self) -> tuple[list[ScheduledWork], list[Request]]:
        work: list[ScheduledWork] = []
        out_of_room: list[Request] = []
        budget = self.budget

        # 1. decodes, oldest first; preempt the newest running request while pages are short
        n_decoding = sum(1 for r in self.running if r.is_decoding)
        for req in list(self.running):
            if req not in self.running or not req.is_decoding:
                continue
            draft = self.propose(req, n_decoding) if self.propose is not None else []
            tree = None
            if isinstance(draft, DraftTree):  # its candidates occupy positions up to its depth
                tree, draft = draft, list(draft.tokens)
            span = tree.max_depth if tree is not None else len(draft)
            if draft and not self._grow(req, req.num_computed + 1 + span):
                draft, tree = [], None  # no room for speculation: plain decode
            if self._room_for_decode(req, work, out_of_room):
                work.append(ScheduledWork(req, 1 + len(draft), draft, tree))
                budget -= 1 + len(draft)

        # 2. continue chunked prefills of running requests
        for req in self.running:
            if req.is_decoding or budget <= 0:
                continue
            n = self._fit(req, min(req.num_pending, budget, self._chunk_cap(req)))
            if n > 0:
                work.append(ScheduledWork(req, n))
                budget -= n

        # 3. admit waiting requests in admission order (priority first; twins of a prompt being prefilled
        # wait for its copy instead, see _awaits_twin)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_running and self.states.num_free:
            req = self.waiting[i]
            if self._awaits_twin(req):
                i += 1
                continue
            reserve = self._decode_reserve()
            want = min(req.num_pending, budget, self._chunk_cap(req))
            room = (self._num_free_pages(self._pages_for(want) + reserve) - reserve) * self.block_size
            n = min(want, room)
            if n <= 0:
                break
            self.waiting.pop(i)
            req.state_slot = self.states.alloc()
            req.status = Status.RUNNING
            self.running.append(req)
            n = self._fit(req, n)
            work.append(ScheduledWork(req, n))
            budget -= n
        return work, out_of_room

    def _room_for_decode(self, req: Request, work: list[ScheduledWork], out_of_room: list[Request]) -> bool:
        """Give req a page for its next token, preempting newer requests if needed."""
        while not self._grow(req, req.num_computed + 1):
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                out_of_room.append(req)  # alone and still no room: it cannot grow any more
                return False
            work[:] = [w for w in work if w.req is not victim]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _decode_reserve(self) -> int:
        """Pages kept free when starting a request: one per running decode, so that admission
        does not force a preemption."""
        return sum(1 for r in self.running if r.is_decoding)

    @staticmethod
    def shares_prefill(req: Request) -> bool:
        """Whether req may start from a copy of another request's prefill (the engine's twins):
        a fresh prompt without per-chunk work (prompt logprobs, scoring only)."""
        return req.num_output == 0 and req.num_computed == 0 and req.prompt_logprobs is None and not req.score_only

    @staticmethod
    def reuses_prefix(req: Request) -> bool:
        """Whether req may start from a copy of a cached prompt prefix (the engine's prefix cache):
        nothing computed yet (a new request, or one preempted and recomputed from scratch) and no
        prompt logprobs left to compute or prompt to score."""
        return req.num_computed == 0 and not req.prompt_lp_pending and not req.score_only

    def _awaits_twin(self, req: Request) -> bool:
        """A running request is prefilling req's very prompt: req waits to be handed a copy of it
        (Engine._fork_twins) rather than computing it again."""
        return self.share_prefill and self.shares_prefill(req) and any(
            r.num_output == 0 and r.num_computed < r.num_prompt and r.prompt_ids == req.prompt_ids for r in self.running)

    def _chunk_cap(self, req: Request) -> int:
        """Chunks that compute prompt logprobs hold a logits row per token from position
        prompt_lp_next - 1 on ([tokens, vocab] fp32): at most prompt_logprob_chunk such rows. A
        chunk ends at the request's cache_split (the prefix cache snapshots the caches there)."""
        cap = 1 << 62
        if req.prompt_lp_pending:
            cap = max(req.prompt_lp_next - 1 - req.num_computed, 0) + self.prompt_logprob_chunk
        if req.num_computed < req.cache_split:
            cap = min(cap, req.cache_split - req.num_computed)
        return cap

    def _fit(self, req: Request, n: int) -> int:
        """Grow req's pages for up to n more tokens; returns how many fit (0 = none now)."""
        start = req.num_computed
        free = self._num_free_pages(self._pages_for(start + n) - len(req.pages))
        room = (len(req.pages) + free) * self.block_size - start
        n = max(0, min(n, room))
        if n and not self._grow(req, start + n):
            raise AssertionError("page accounting out of sync")
        return n
