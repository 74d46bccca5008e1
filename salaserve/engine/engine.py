"""The engine core: requests in, one step at a time, token ids out.

Synchronous and single-threaded; `LLM` drives it in-process and the server drives it from its own
process (`engine/process.py`). Tokenization, detokenization and stop strings live outside, so a
step is scheduling + one model forward + sampling + token-level stop checks.
"""

from __future__ import annotations

import logging
import time

from salaserve.config import EngineArgs
from salaserve.engine.request import ABORT_REASON, Request, Status, StepOutput, length_reason, stop_reason
from salaserve.engine.runner import ModelRunner
from salaserve.engine.sampler import Sampler, SamplingState
from salaserve.engine.sampling_params import SamplingParams
from salaserve.engine.scheduler import Scheduler
from salaserve.model.default import default_model_dir

log = logging.getLogger("salaserve")


class Engine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        self.model_dir = args.model or default_model_dir()
        self.runner = ModelRunner(args, self.model_dir)
        self.cfg = self.runner.cfg
        caches = self.runner.caches
        self.scheduler = Scheduler(caches.kv, caches.compressed, caches.states, args.max_running_requests,
                                   args.chunked_prefill_size)
        self.sampler = Sampler(seed=args.seed)
        self.context_length = args.context_length or self.cfg.max_position_embeddings
        self.eos_ids = frozenset(self.cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[StepOutput] = []  # produced outside step() (e.g. max_new_tokens=0)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "aborted": 0}

    # ---- requests ----------------------------------------------------------------------------
    def validate_prompt(self, prompt_ids) -> list[int]:
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("prompt: must be a non-empty list of token ids")
        vocab = self.cfg.vocab_size
        ids = []
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValueError(f"prompt: token ids must be integers, got {t!r}")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t} is outside the vocabulary [0, {vocab})")
            ids.append(t)
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt: {len(ids)} tokens, the context length is {self.context_length}")
        if len(ids) + 1 > self.runner.capacity_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit in the KV cache "
                             f"({self.runner.capacity_tokens} tokens)")
        return ids

    def add_request(self, rid: str, prompt_ids, params: SamplingParams | None = None, priority: int = 0) -> Request:
        """Queue a request; raises ValueError naming the bad field (the engine keeps serving)."""
        if rid in self.requests:
            raise ValueError(f"rid: a request with id {rid!r} is already running")
        params = params or SamplingParams()
        params.validate(vocab_size=self.cfg.vocab_size)
        ids = self.validate_prompt(prompt_ids)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        req = Request(rid=rid, prompt_ids=ids, params=params, priority=priority)
        req.sampling = SamplingState(params, ids, eos_token_ids=() if params.ignore_eos else self.eos_ids)
        self.requests[rid] = req
        self.stats["prompt_tokens"] += len(ids)
        if self._max_new_tokens(req) <= 0:  # max_new_tokens=0: nothing to generate
            self._finish(req, length_reason(0))
            self._pending_outputs.append(self._output(req, []))
            return req
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> bool:
        """Cancel a request at any point; its pages and slot are freed now. False if unknown."""
        req = self.requests.get(rid)
        if req is None or req.status == Status.FINISHED:
            return False
        self._finish(req, ABORT_REASON)
        self.stats["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending_outputs)

    def _max_new_tokens(self, req: Request) -> int:
        return min(req.params.max_new_tokens, self.context_length - req.num_prompt)

    def _finish(self, req: Request, reason: dict) -> None:
        self.scheduler.remove(req)
        req.finish_reason = reason
        self.requests.pop(req.rid, None)
        self.stats["finished"] += 1

    def _output(self, req: Request, new_ids: list[int], logprobs=None) -> StepOutput:
        return StepOutput(rid=req.rid, new_token_ids=new_ids, finished=req.status == Status.FINISHED,
                          finish_reason=req.finish_reason, num_prompt=req.num_prompt,
                          num_output=req.num_output, logprobs=logprobs)

    # ---- the loop body -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending_outputs = list(self._pending_outputs), []
        work, out_of_room = self.scheduler.schedule()
        for req in out_of_room:  # alone and out of pages: it ends here, with what it has
            self._finish(req, length_reason(req.num_output))
            outputs.append(self._output(req, []))
        if not work:
            return outputs
        logits = self.runner.forward(work)
        self.stats["steps"] += 1

        sampled = []
        for w in work:
            req = w.req
            old = req.num_computed
            req.num_computed += w.num_tokens
            self.scheduler.compressed.on_extend(old, req.num_computed)
            if req.num_computed == len(req.tokens):
                sampled.append(req)
        if not sampled:
            return outputs
        result = self.sampler.sample(logits, [r.sampling for r in sampled])
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(sampled, result.token_ids)):
            req.tokens.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            self.stats["generated_tokens"] += 1
            lp = None
            if result.logprobs is not None and result.logprobs[i] is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else None
                lp = [(result.logprobs[i], top)]
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(self._output(req, [tok], lp))
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> dict | None:
        p = req.params
        n = req.num_output
        if not p.ignore_eos and n >= p.min_new_tokens:
            if tok in self.eos_ids or (p.stop_token_ids and tok in p.stop_token_ids):
                return stop_reason(tok)
        if n >= self._max_new_tokens(req):
            return length_reason(n)
        return None

    # ---- introspection (tests, metrics) ------------------------------------------------------
    def resource_counters(self) -> dict:
        c = self.runner.caches
        return {
            "pages_used": c.kv.allocator.num_used,
            "pages_free": c.kv.allocator.num_free,
            "compressed_entries": c.compressed.entries_in_use,
            "slots_used": c.states.num_used,
            "slots_free": c.states.num_free,
        }

    def flush_cache(self) -> bool:
        """Nothing is cached across requests yet (no prefix cache): succeeds when idle."""
        return not self.scheduler.has_work
