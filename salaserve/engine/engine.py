"""The engine core: requests in, one step at a time, token ids out.

Synchronous and single-threaded; `LLM` drives it in-process and the server drives it from its own
process (`server/engine_worker.py`). Tokenization, detokenization and stop strings live outside, so a
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
from salaserve.spec.accept import accept_greedy, accept_sampling, spec_generator
from salaserve.spec.ngram import NgramDrafter
from salaserve.spec.tree import DraftTree

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
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "aborted": 0,
                      "spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        if args.speculative_algorithm == "NGRAM":
            self.scheduler.propose = self._propose_draft

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

    def abort(self, rid: str, reason: dict | None = None) -> bool:
        """Cancel a request at any point; its pages and slot are freed now. False if unknown.
        `reason` records why when it is not a cancellation (e.g. a stop string found outside)."""
        req = self.requests.get(rid)
        if req is None or req.status == Status.FINISHED:
            return False
        self._finish(req, reason or ABORT_REASON)
        if reason is None:
            self.stats["aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending_outputs)

    def _max_new_tokens(self, req: Request) -> int:
        room = self.context_length - req.num_prompt
        return room if req.params.max_new_tokens is None else min(req.params.max_new_tokens, room)

    def _finish(self, req: Request, reason: dict) -> None:
        self.scheduler.remove(req)
        req.finish_reason = reason
        self.requests.pop(req.rid, None)
        self.stats["finished"] += 1

    def _output(self, req: Request, new_ids: list[int], logprobs=None) -> StepOutput:
        return StepOutput(rid=req.rid, new_token_ids=new_ids, finished=req.status == Status.FINISHED,
                          finish_reason=req.finish_reason, num_prompt=req.num_prompt,
                          num_output=req.num_output, logprobs=logprobs, spec_verify_ct=req.spec_verify_ct,
                          spec_accepted=req.spec_accepted)

    # ---- speculative decoding ----------------------------------------------------------------
    def _propose_draft(self, req: Request, n_decoding: int) -> list[int]:
        """N-gram draft for a decoding request; none for large batches, penalised sampling, or
        where it would overshoot max_new_tokens."""
        args = self.args
        p = req.params
        if n_decoding > args.speculative_max_batch or p.repetition_penalty != 1.0 \
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or req.sampling.blocks_stop:
            return []
        if req.drafter is None:
            req.drafter = self.make_drafter(req)
            req.spec_k = args.speculative_num_draft_tokens
        room = self._max_new_tokens(req) - req.num_output - 1
        draft = req.drafter.propose(req.tokens, min(req.spec_k, room))
        if isinstance(draft, DraftTree):  # the kernels verify chains: a tree's first path
            draft = draft.first_path()[:max(0, room)]
        return draft

    def make_drafter(self, req: Request):
        """The drafter of a request (replaceable, e.g. by an oracle in benchmarks and tests)."""
        return NgramDrafter(self.args.speculative_ngram_max, self.args.speculative_ngram_min)

    def _verify(self, req: Request, logits, draft: list[int]) -> list[int]:
        """Accepted drafts + the target's next token, and the adaptive draft length update."""
        p = req.params
        if p.is_greedy:
            new = accept_greedy(logits, draft)
        else:
            gen = spec_generator(p, req.sampling.num_generated, logits.device, self.sampler._global_generator(logits.device))
            new = accept_sampling(logits, draft, p, gen)
        accepted = len(new) - 1
        # adaptive depth: grow after a fully accepted draft, shrink towards what was accepted
        k_max = self.args.speculative_num_draft_tokens
        req.spec_k = min(k_max, req.spec_k + 1) if accepted == len(draft) else max(1, accepted + 1)
        req.spec_verify_ct += 1
        req.spec_accepted += accepted
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_draft_tokens"] += len(draft)
        self.stats["spec_accepted_tokens"] += accepted
        return new

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + 1), SGLang's metric."""
        n = self.stats["spec_verify_steps"]
        return (self.stats["spec_accepted_tokens"] + n) / n if n else None

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

        sampled, rows = [], []
        verified, commits = [], []
        row = 0
        for i, w in enumerate(work):
            req = w.req
            if w.draft:  # verify: accept a prefix (the pending token + the accepted drafts)
                new = self._verify(req, logits[row:row + 1 + len(w.draft)], w.draft)
                row += 1 + len(w.draft)
                verified.append((req, new))
                commits.append((i, req.state_slot, len(new)))
                continue
            self._advance(req, w.num_tokens)
            if req.num_computed == len(req.tokens):
                sampled.append(req)
                rows.append(row)
                row += 1
        if commits:  # the Lightning states advance by the accepted tokens, in one call for all
            self.runner.commit_verified(commits)
        for req, new in verified:
            self._advance(req, len(new))
            outputs.append(self._emit(req, new, None))
        if not sampled:
            return outputs
        result = self.sampler.sample(logits[rows] if len(rows) != logits.shape[0] else logits,
                                     [r.sampling for r in sampled])
        for i, (req, tok) in enumerate(zip(sampled, result.token_ids)):
            lp = None
            if result.logprobs is not None and result.logprobs[i] is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else None
                lp = [(result.logprobs[i], top)]
            outputs.append(self._emit(req, [tok], lp, sampled_already=True))
        return outputs

    def _advance(self, req: Request, n: int) -> None:
        """n more of req's tokens are now in the caches (their compressed keys included)."""
        old = req.num_computed
        req.num_computed += n
        self.scheduler.compressed.on_extend(old, req.num_computed)

    def _emit(self, req: Request, new: list[int], lp, sampled_already: bool = False) -> StepOutput:
        """Append new tokens (stopping at the first that ends the request) and report them."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        kept = []
        for tok in new:
            req.tokens.append(tok)
            if not sampled_already:
                req.sampling.append(tok)
            kept.append(tok)
            self.stats["generated_tokens"] += 1
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                break
        return self._output(req, kept, lp)

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
