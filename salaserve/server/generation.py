"""Engine requests as an HTTP handler drives them.

One HTTP request may fan out into several engine requests (a batch of prompts, `n` samples):
a `RequestGroup` holds them, sends them all to one engine replica, and has one inbox that the
engine client fills, so a handler waits on a single queue and coalesces whatever arrived while
it was busy. Each `Sequence` turns token ids
into text (`RequestStream`: detokenization, stop strings) and keeps timings for the metrics.

Whatever way a handler ends (done, client gone, error), `RequestGroup.cancel` makes the engine
free every unfinished request's pages and slot.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from salaserve.core.request import StepOutput
from salaserve.engine.output import RequestStream


def new_rid() -> str:
    return uuid.uuid4().hex


@dataclass
class SequenceUpdate:
    """What changed for one sequence since its handler last looked."""

    index: int
    text: str  # new text
    token_ids: list[int]  # new token ids
    logprobs: list = field(default_factory=list)  # new (logprob, top list or None) pairs
    finished: bool = False
    finish_reason: dict | None = None
    completion_tokens: int = 0


class Sequence:
    def __init__(self, index: int, rid: str, prompt_ids: list[int], params, priority: int, tokenizer):
        self.index = index
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.priority = priority
        self.stream = RequestStream(tokenizer, params, prompt_ids)
        self.created = time.perf_counter()
        self.last_token_time: float | None = None
        self.finished_at: float | None = None
        self._new_text: list[str] = []
        self._new_ids: list[int] = []
        self._new_logprobs: list = []
        self._since_emit = 0
        self.dirty = False
        self.in_engine = False  # accepted by the engine (so ours to cancel)
        self.spec_verify_ct = 0  # speculative decoding counters, cumulative (from the engine)
        self.spec_accepted = 0
        self.cached_tokens = 0  # prompt tokens the engine copied rather than computed
        self.num_preemptions = 0  # times the engine preempted it (SGLang's total_retractions)
        # (logprob or None, token id, top list or None) per prompt token from logprob_start_len on
        self.prompt_logprobs: list | None = None

    # ---- state ---------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.stream.finished

    @property
    def finish_reason(self) -> dict | None:
        return self.stream.finish_reason

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def token_ids(self) -> list[int]:
        return self.stream.token_ids

    @property
    def logprobs(self) -> list:
        return self.stream.logprobs

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.token_ids)

    @property
    def error(self) -> str | None:
        """Set when an engine error (not the client) ended the request."""
        r = self.finish_reason
        if r and r.get("type") == "abort" and r.get("status_code", 0) >= 500:
            return r.get("message") or "internal error"
        return None

    @property
    def e2e_latency(self) -> float:
        return (self.finished_at or time.perf_counter()) - self.created

    # ---- progress --------------------------------------------------------------------------------
    def consume(self, out: StepOutput, metrics=None) -> bool:
        """Fold one engine output in. True when a stop string ended the sequence here, i.e. the
        engine still runs it and must be told to abort."""
        if self.finished:
            return False
        delta = self.stream.process(out)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.spec_verify_ct:
            self.spec_verify_ct, self.spec_accepted = out.spec_verify_ct, out.spec_accepted
        if out.cached_tokens:
            self.cached_tokens = out.cached_tokens
        self.num_preemptions = max(self.num_preemptions, out.num_preemptions)
        n = len(out.new_token_ids)
        if n:
            now = time.perf_counter()
            if metrics is not None:
                first = self.last_token_time is None
                metrics.on_tokens(n, now - (self.created if first else self.last_token_time), first)
            self.last_token_time = now
        if delta.text:
            self._new_text.append(delta.text)
        self._new_ids.extend(delta.token_ids)
        self._new_logprobs.extend(delta.logprobs)
        self._since_emit += n
        self.dirty = self.dirty or bool(n or delta.text or delta.finished)
        if delta.finished:
            self.finished_at = time.perf_counter()
            if metrics is not None:
                metrics.on_finish(self.prompt_tokens, self.completion_tokens, self.e2e_latency,
                                  aborted=(self.finish_reason or {}).get("type") == "abort")
        return delta.finished and not out.finished

    def ready_to_emit(self, interval: int) -> bool:
        return self.dirty and (self.finished or self._since_emit >= interval)

    def take(self) -> SequenceUpdate:
        u = SequenceUpdate(index=self.index, text="".join(self._new_text), token_ids=self._new_ids,
                           logprobs=self._new_logprobs, finished=self.finished,
                           finish_reason=self.finish_reason, completion_tokens=self.completion_tokens)
        self._new_text, self._new_ids, self._new_logprobs = [], [], []
        self._since_emit = 0
        self.dirty = False
        return u

    def mark_aborted(self, message: str) -> None:
        self.stream.finished = True
        self.stream.finish_reason = {"type": "abort", "message": message}
        self.finished_at = time.perf_counter()


class RequestGroup:
    """The engine requests of one HTTP request (its prompts times n). `owner`: the client that
    may abort them (auth.request_owner; None: only the admin)."""

    def __init__(self, client, tokenizer, metrics=None, owner: str | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.owner = owner
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.seqs: list[Sequence] = []

    def add(self, prompt_ids: list[int], params, priority: int = 0, rid: str | None = None) -> Sequence:
        seq = Sequence(len(self.seqs), rid or new_rid(), prompt_ids, params, priority, self.tokenizer)
        self.seqs.append(seq)
        return seq

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)

    async def start(self, replica: int | None = None) -> None:
        """Hand every sequence to the engine: all to one replica (server/replicas.py), `replica`
        or the one the router picks for the first prompt. On a rejection (ValueError, naming the
        field) or any failure, the ones already queued are cancelled and the error is raised. A
        sequence's index is its share rank: the engine lets other requests' first sequences in
        before this request's later ones (Request.share_rank)."""
        if replica is None:
            replica = self.client.route(self.seqs[0].prompt_ids)
        results = await asyncio.gather(
            *(self.client.add(s.rid, s.prompt_ids, s.params, s.priority, self.inbox, s.index, share_rank=s.index,
                              owner=self.owner, replica=replica) for s in self.seqs),
            return_exceptions=True)
        for seq, result in zip(self.seqs, results):
            seq.in_engine = not isinstance(result, BaseException)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.cancel()
            raise errors[0]

    async def updates(self, interval: int = 1):
        """Yields lists of SequenceUpdate (never empty) until every sequence has finished; each
        list folds in everything that arrived since the previous one."""
        while not self.done:
            items = [await self.inbox.get()]
            while not self.inbox.empty():
                items.append(self.inbox.get_nowait())
            for tag, out in items:
                seq = self.seqs[tag]
                if seq.consume(out, self.metrics):
                    self.client.cancel(seq.rid)  # a stop string ended it: free it now
            ready = [s.take() for s in self.seqs if s.ready_to_emit(interval)]
            if ready:
                yield ready

    async def wait(self) -> list[Sequence]:
        async for _ in self.updates(interval=1 << 30):
            pass
        return self.seqs

    def cancel(self, message: str = "client disconnected") -> None:
        """End every unfinished sequence now; the engine frees their resources."""
        for s in self.seqs:
            if not s.finished:
                if s.in_engine:  # never touch a rid we did not get (e.g. a duplicate of another's)
                    self.client.cancel(s.rid)
                s.mark_aborted(message)
                if self.metrics is not None and s.in_engine:
                    self.metrics.on_finish(s.prompt_tokens, s.completion_tokens, s.e2e_latency, aborted=True)


async def run_unless_disconnected(request, coro):
    """Await `coro` unless the HTTP client goes away first; then cancel it and return None.
    For non-streaming handlers (the caller's cleanup aborts the engine requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _until_disconnected(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
