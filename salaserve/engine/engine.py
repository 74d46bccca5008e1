"""The engine core: requests in, one step at a time, token ids out.

Synchronous and single-threaded; `LLM` drives it in-process and the server drives it from its own
process (`server/engine_worker.py`). Tokenization, detokenization and stop strings live outside, so a
step is scheduling + one model forward + sampling + token-level stop checks.

With overlap scheduling (the default without speculation) a step launches its forward and
sampling, then reads back the *previous* step's tokens and reports them: the host's work of one
step runs while the GPU computes the next, and outputs arrive one step later (see _InFlight).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from salaserve.config import EngineArgs
from salaserve.core.request import ABORT_REASON, Request, Status, StepOutput, length_reason, stop_reason
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.grammar import GrammarCompiler
from salaserve.engine.prefix_cache import CachedPrompt, PrefixCache
from salaserve.engine.runner import ModelRunner, placeholder, prompt_aux_rows, prompt_logit_rows
from salaserve.engine.sampler import Sampler, SamplingState, needs_history, read_logprobs
from salaserve.engine.scheduler import Scheduler, ScheduledWork
from salaserve.engine.warmup import warm_up_engine
from salaserve.kernels.compile_ahead import parallel_autotune
from salaserve.kernels.compile_watch import WATCH
from salaserve.model.default import default_model_dir
from salaserve.model.eagle3 import load_eagle3
from salaserve.model.eagle3_drafter import Eagle3Drafter
from salaserve.spec.accept import accept_greedy, accept_sampling, accept_sampling_tree, spec_generator
from salaserve.spec.ngram import NgramDrafter
from salaserve.spec.policy import SpeculationPolicy, parse_levels
from salaserve.spec.routing import NgramRouter
from salaserve.spec.tree import DraftTree, accept_greedy_tree

log = logging.getLogger("salaserve")

# EAGLE-3: the most prompt positions whose hidden states the prefill captures for the drafter
PROMPT_CONTEXT_MAX = 32768


@dataclass
class _InFlight:
    """A step whose sampled token ids are still on their way to the host (overlap scheduling).
    Each request's token stands in req.tokens as placeholder(row) at `positions` until resolved."""

    reqs: list[Request]
    positions: list[int]  # index of each request's placeholder in req.tokens
    tokens: torch.Tensor  # [M] int64 on the device: what the next step's placeholders read
    host: torch.Tensor  # [M] int64 on the host, filled by a non-blocking copy
    copied: torch.cuda.Event | None  # recorded after that copy (None on the CPU)


class Engine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args or EngineArgs(**kwargs)
        self.args = args
        self.model_dir = args.model or default_model_dir()
        if args.tp_size > 1:  # rank 0 here; ranks 1..N-1 in processes of their own
            from salaserve.engine.tp_workers import start_runner

            self.runner = start_runner(args, self.model_dir)
        else:
            self.runner = ModelRunner(args, self.model_dir)
        self.cfg = self.runner.cfg
        caches = self.runner.caches
        self.scheduler = Scheduler(caches.kv, caches.compressed, caches.states, args.max_running_requests,
                                   args.chunked_prefill_size, args.schedule_policy)
        self.sampler = Sampler(seed=args.seed)
        self.context_length = args.context_length or self.cfg.max_position_embeddings
        self.eos_ids = frozenset(self.cfg.eos_token_ids)
        self.grammars = GrammarCompiler(self.model_dir, self.cfg.vocab_size, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self._pending_outputs: list[StepOutput] = []  # produced outside step() (e.g. max_new_tokens=0)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "aborted": 0,
                      "spec_verify_steps": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0,
                      "spec_head_drafts": 0, "spec_ngram_routed": 0,
                      "shared_prefill_tokens": 0, "cached_prompt_tokens": 0}
        self.eagle_head = None
        if args.speculative_algorithm == "EAGLE3":
            self.eagle_head = self._load_eagle_head()
        self.spec_policy = None
        if args.speculative_algorithm in ("NGRAM", "EAGLE3"):
            self.scheduler.propose = self._propose_draft
            topk = args.speculative_eagle_topk if self.eagle_head is not None else 1
            self.spec_policy = SpeculationPolicy(parse_levels(args.speculative_load_levels), self._draft_depth(),
                                                 topk, args.speculative_policy_patience, args.speculative_max_batch)
        # whether the backend verifies a drafter's DraftTree whole (else its first path)
        self.tree_verify = bool(getattr(self.runner.model.ops, "supports_tree_verify", False))
        self.prefix_cache = PrefixCache(args.prefix_cache_slots, args.prefix_cache_min_tokens)
        self.scheduler.reclaim = self._reclaim_pages
        # Overlap scheduling: step N+1 is scheduled, built and launched before step N's tokens are
        # read back, so the host's work (scheduling, batch build, outputs) runs while the GPU
        # computes. Off with speculation, whose drafts need the real tokens.
        self.overlap = args.overlap_schedule and args.speculative_algorithm is None
        self._inflight: _InFlight | None = None
        self._pinned: list[torch.Tensor] = []  # two host buffers for the token copies, alternating
        self._trace = None
        self._builds_seen = len(WATCH.events)
        if args.warmup and self.runner.device.type == "cuda":
            t = time.perf_counter()
            with parallel_autotune(args.parallel_compile):
                warm_up_engine(self)
            self.runner.startup_phases["serving warm-up"] = time.perf_counter() - t
        log.info("ready: %s; built at start-up: %s", self.runner.describe_startup(), WATCH.counts() or "nothing")
        WATCH.mark_ready()  # from now on a kernel compile, autotune or graph capture is a cold path
        self._builds_seen = len(WATCH.events)
        self._trace = open(args.step_trace, "a", buffering=1) if args.step_trace else None

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their group (nothing to stop with one
        rank). The engine takes no more steps afterwards."""
        self.runner.shutdown()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

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

    def add_request(self, rid: str, prompt_ids, params: SamplingParams | None = None, priority: int = 0,
                    share_rank: int = 0) -> Request:
        """Queue a request; raises ValueError naming the bad field (the engine keeps serving).
        share_rank: its position among the sequences of one client request (Request.share_rank)."""
        if rid in self.requests:
            raise ValueError(f"rid: a request with id {rid!r} is already running")
        params = params or SamplingParams()
        params.validate(vocab_size=self.cfg.vocab_size)
        ids = self.validate_prompt(prompt_ids)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        if isinstance(share_rank, bool) or not isinstance(share_rank, int) or share_rank < 0:
            raise ValueError(f"share_rank: must be a non-negative integer, got {share_rank!r}")
        req = Request(rid=rid, prompt_ids=ids, params=params, priority=priority, share_rank=share_rank)
        sampling = SamplingState(params, ids, eos_token_ids=() if params.ignore_eos else self.eos_ids)
        sampling.grammar = self.grammars.matcher(params)  # (compiled here: a bad grammar is a ValueError)
        req.sampling = sampling
        self.requests[rid] = req
        self.stats["prompt_tokens"] += len(ids)
        if params.wants_prompt_logprobs:
            start = params.logprob_start_len
            req.prompt_logprobs = [(None, ids[0], None)] if start == 0 else []
            req.prompt_lp_next = max(start, 1)
        if self._max_new_tokens(req) <= 0:  # nothing to generate: score the prompt, or end here
            req.score_only = True
            if not req.prompt_lp_pending:
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
        return self.scheduler.has_work or bool(self._pending_outputs) or self._inflight is not None

    def _max_new_tokens(self, req: Request) -> int:
        room = self.context_length - req.num_prompt
        return room if req.params.max_new_tokens is None else min(req.params.max_new_tokens, room)

    def _finish(self, req: Request, reason: dict) -> None:
        while req.tokens and req.tokens[-1] < 0:  # tokens still in flight are not part of it
            req.tokens.pop()
        self.scheduler.remove(req)
        req.finish_reason = reason
        self.requests.pop(req.rid, None)
        req.drafter = None  # an EAGLE-3 drafter's K/V and pending hidden states go with it
        self.stats["finished"] += 1

    def _output(self, req: Request, new_ids: list[int], logprobs=None, num_output: int | None = None) -> StepOutput:
        prompt_lp = None
        if req.prompt_logprobs is not None and not req.prompt_lp_sent and not req.prompt_lp_pending:
            prompt_lp, req.prompt_lp_sent = req.prompt_logprobs, True
        return StepOutput(rid=req.rid, new_token_ids=new_ids, finished=req.status == Status.FINISHED,
                          finish_reason=req.finish_reason, num_prompt=req.num_prompt,
                          num_output=req.num_output if num_output is None else num_output, logprobs=logprobs,
                          spec_verify_ct=req.spec_verify_ct, spec_accepted=req.spec_accepted,
                          prompt_logprobs=prompt_lp, cached_tokens=req.cached_tokens,
                          num_preemptions=req.num_preemptions)

    # ---- speculative decoding ----------------------------------------------------------------
    def _propose_draft(self, req: Request, n_decoding: int) -> list[int] | DraftTree:
        """A draft for a decoding request, of the policy's shape at this load (spec/policy.py);
        none for large batches, penalised or biased sampling (the verify reads the raw logits), or
        where it would overshoot max_new_tokens. A drafter's DraftTree stays a tree where the
        backend verifies trees (cut to the depth that cannot overshoot), else it becomes its first
        path; a chain always becomes a list."""
        args = self.args
        p = req.params
        shape = self.spec_policy.shape
        if shape.off or n_decoding > args.speculative_max_batch or p.repetition_penalty != 1.0 \
                or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.logit_bias \
                or req.sampling.blocks_stop or req.sampling.grammar:
            return []
        self._ensure_drafter(req)
        room = self._max_new_tokens(req) - req.num_output - 1
        if self.eagle_head is None:  # NGRAM's adaptive length, within the policy's depth
            draft = req.drafter.propose(req.tokens, min(req.spec_k, shape.depth, room))
        else:
            draft = req.drafter.propose(req.tokens, min(shape.depth, room), topk=shape.topk)
            routed = isinstance(req.drafter, NgramRouter) and req.drafter.routed
            self.stats["spec_ngram_routed" if routed else "spec_head_drafts"] += 1
        if isinstance(draft, DraftTree):
            if self.tree_verify and not draft.is_chain:
                tree = draft.pruned(max(0, room))
                return list(tree.tokens) if tree.is_chain else tree
            draft = draft.first_path()[:max(0, room)]  # (a chain's first path is the chain)
        return draft

    def _ensure_drafter(self, req: Request):
        if req.drafter is None:
            req.drafter = self.make_drafter(req)
            req.spec_k = self.args.speculative_num_draft_tokens
        return req.drafter

    def _draft_depth(self) -> int:
        """The configured draft depth: EAGLE3's steps, else the draft tokens."""
        args = self.args
        if self.eagle_head is not None:
            return args.speculative_num_steps or args.speculative_num_draft_tokens
        return args.speculative_num_draft_tokens

    def make_drafter(self, req: Request):
        """The drafter of a request (replaceable, e.g. by an oracle in benchmarks and tests)."""
        args = self.args
        if self.eagle_head is not None:
            head = Eagle3Drafter(self.eagle_head, depth=self._draft_depth(), topk=args.speculative_eagle_topk,
                                 window=args.speculative_eagle_window)
            if args.speculative_ngram_route:
                return NgramRouter(head, args.speculative_ngram_route, args.speculative_ngram_max)
            return head
        return NgramDrafter(args.speculative_ngram_max, args.speculative_ngram_min)

    def _load_eagle_head(self):
        """The EAGLE-3 head of --speculative-draft-model-path, on the target's device and dtype,
        sharing its embedding; the runner then returns the head's target layers at every logit row."""
        runner = self.runner
        path = self.args.speculative_draft_model_path
        head = load_eagle3(path, dtype=runner.dtype, device=runner.device, target_cfg=self.cfg)
        head.attach_target(runner.model.p["embed"], self.cfg.scale_emb)
        runner.aux_layers = head.cfg.aux_layer_ids
        # the prefill also hands the drafter the prompt's last positions (its K/V window), as many
        # as the head was trained with where its config says
        trained = head.cfg.prompt_context or PROMPT_CONTEXT_MAX
        runner.aux_context = min(self.args.speculative_eagle_window, PROMPT_CONTEXT_MAX, trained)
        log.info("EAGLE-3 head %s: draft vocab %d, target layers %s", path, head.cfg.draft_vocab_size,
                 list(head.cfg.aux_layer_ids))
        return head

    def _observe(self, seen: list[tuple[Request, int, int]]) -> None:
        """EAGLE-3: hand each (request, position, logit row) its target hidden state."""
        aux = self.runner.last_aux
        for req, pos, row in seen:
            if req.status != Status.FINISHED:
                self._ensure_drafter(req).observe(pos, aux[row])

    def _copy_context(self, src: Request, dst: Request) -> None:
        """A twin's drafter gets the prompt context its leader's prefill captured (not yet computed
        into the leader's cache: it waits in the pending states until the first propose)."""
        head = getattr(src.drafter, "drafter", src.drafter)  # (under an NgramRouter)
        pending = getattr(head, "pending", {})
        drafter = self._ensure_drafter(dst)
        for p in sorted(pending):
            drafter.observe(p, pending[p])

    def _verify(self, req: Request, logits, draft: list[int],
                tree: DraftTree | None = None) -> tuple[list[int], list[int] | None]:
        """Accepted drafts + the target's next token, and the adaptive draft length update; for a
        tree also the accepted path's verify rows (the commit replays them; None for a chain)."""
        p = req.params
        gen = None if p.is_greedy else spec_generator(p, req.sampling.num_generated, logits.device,
                                                      self.sampler._global_generator(logits.device))
        rows = None
        if tree is not None:
            new, rows = accept_greedy_tree(logits, tree) if p.is_greedy else accept_sampling_tree(logits, tree, p, gen)
        else:
            new = accept_greedy(logits, draft) if p.is_greedy else accept_sampling(logits, draft, p, gen)
        accepted = len(new) - 1
        # NGRAM's adaptive depth: grow after a fully accepted draft, shrink towards what was
        # accepted (EAGLE-3 drafts its fixed depth: its misses are not runs of a pattern)
        if self.eagle_head is None:
            k_max = self.args.speculative_num_draft_tokens
            full = tree.max_depth if tree is not None else len(draft)
            req.spec_k = min(k_max, req.spec_k + 1) if accepted == full else max(1, accepted + 1)
        req.spec_verify_ct += 1
        req.spec_accepted += accepted
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_draft_tokens"] += len(draft)
        self.stats["spec_accepted_tokens"] += accepted
        return new, rows

    @property
    def avg_spec_accept_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + 1), SGLang's metric."""
        n = self.stats["spec_verify_steps"]
        return (self.stats["spec_accepted_tokens"] + n) / n if n else None

    # ---- the loop body -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending_outputs = list(self._pending_outputs), []
        self._reuse_cached_prompts()
        if self.spec_policy is not None:  # the step's draft shape, from the decoding requests now
            n = sum(1 for r in self.scheduler.running if r.is_decoding)
            if n:
                self.spec_policy.update(n)
        work, out_of_room = self.scheduler.schedule()
        for req in out_of_room:  # alone and out of pages: it ends here, with what it has
            self._finish(req, None)  # drops a token still in flight first, so num_output counts it out
            req.finish_reason = length_reason(req.num_output)
            outputs.append(self._output(req, []))
        if not work:
            return outputs + self._resolve()
        prev = self._inflight.tokens if self._inflight is not None else None
        if self._trace is not None:
            self._trace_step(work)
        logits = self.runner.forward(work, prev_tokens=prev)
        self.stats["steps"] += 1
        if len(WATCH.events) != self._builds_seen:
            self._log_cold_paths()

        sampled, rows = [], []
        verified, commits = [], []
        seen = []  # EAGLE-3: (request, position, logit row) of the committed positions
        eagle = self.eagle_head is not None
        row = ctx_row = 0  # ctx_row: into runner.last_aux_context (the drafters' prompt context)
        for i, w in enumerate(work):
            req = w.req
            if w.draft:  # verify: accept a prefix or a tree's path (the pending token + the accepted drafts)
                new, path = self._verify(req, logits[row:row + 1 + len(w.draft)], w.draft, w.tree)
                if eagle:  # the pending token and the accepted drafts (a tree's: their rows): their hidden states hold
                    kept = range(len(new)) if path is None else path
                    seen += [(req, req.num_computed + j, row + r) for j, r in enumerate(kept)]
                row += 1 + len(w.draft)
                verified.append((req, new))
                commits.append((i, req.state_slot, len(new) if path is None else path))
                continue
            lo, hi = prompt_logit_rows(req, req.num_computed, w.num_tokens)
            if hi > lo:
                self._record_prompt_logprobs(req, req.num_computed + lo, logits[row:row + hi - lo])
                row += hi - lo
            if eagle and self.runner.aux_context:  # this chunk's share of the prompt context
                lo, hi = prompt_aux_rows(req, req.num_computed, w.num_tokens, self.runner.aux_context)
                ctx = self.runner.last_aux_context
                for j in range(hi - lo):
                    self._ensure_drafter(req).observe(req.num_computed + lo + j, ctx[ctx_row + j])
                ctx_row += hi - lo
            self._advance(req, w.num_tokens)
            if req.cache_split and req.num_computed == req.cache_split and req.num_output == 0:
                self._cache_prefix(req, req.cache_split)  # a common prefix with an earlier prompt
                req.cache_split = 0
            if req.num_computed == len(req.tokens):
                if req.num_output == 0:
                    self._cache_prefix(req, req.num_prompt)  # the whole prompt (later turns extend it)
                if req.score_only:  # scored its prompt: nothing to sample
                    self._finish(req, length_reason(0))
                    outputs.append(self._output(req, []))
                    continue
                for r in [req] + self._fork_twins(req):  # twins sample from the same logits row
                    sampled.append(r)
                    rows.append(row)
                    if eagle:
                        if r is not req and req.drafter is not None:  # the prompt context, every chunk's
                            self._copy_context(req, r)
                        seen.append((r, r.num_computed - 1, row))
                row += 1
        if commits:  # the Lightning states advance by the accepted tokens, in one call for all
            self.runner.commit_verified(commits)
        if seen:
            self._observe(seen)
        for req, new in verified:
            self._advance(req, len(new))
            outputs.append(self._emit(req, new, None))
        if not sampled:
            return outputs + self._resolve()
        logits = logits[rows] if len(rows) != logits.shape[0] else logits
        if self.overlap and all(self._can_defer(r) for r in sampled):
            launched = self._launch_sample(logits, sampled)
            outputs += self._resolve()  # the previous step's tokens, while the GPU runs this one
            self._inflight = launched
            return outputs
        outputs += self._resolve()  # before sampling: penalties and seeds read the real history
        result = self.sampler.sample(logits, [r.sampling for r in sampled])
        for i, (req, tok) in enumerate(zip(sampled, result.token_ids)):
            if req.status == Status.FINISHED:  # stopped by its previous token, read just now
                continue
            lp = None
            if result.logprobs is not None and result.logprobs[i] is not None:
                top = result.top_logprobs[i] if result.top_logprobs is not None else None
                lp = [(result.logprobs[i], top)]
            outputs.append(self._emit(req, [tok], lp, sampled_already=True))
        return outputs

    def _fork_twins(self, req: Request) -> list[Request]:
        """Waiting requests with req's prompt, which req has just computed (its first token is
        sampled now): each that can start gets a copy of req's caches instead of a prefill of its
        own, and samples its first token from req's logits (n > 1 samples, repeated prompts; the
        scheduler holds such twins back while req prefills). Not for requests that need
        per-chunk work (prompt logprobs, scoring only) or were preempted with output."""
        sched = self.scheduler
        if not sched.share_prefill or req.num_output or not sched.waiting:
            return []
        twins = []
        for w in [w for w in sched.waiting if w.prompt_ids == req.prompt_ids and sched.shares_prefill(w)]:
            if not sched.adopt(w, len(req.pages)):
                break
            self.runner.copy_caches(req.pages, req.state_slot, w.pages, w.state_slot)
            self._advance(w, req.num_computed)
            w.cached_tokens = req.num_computed
            self.stats["shared_prefill_tokens"] += req.num_computed
            twins.append(w)
        return twins

    # ---- prefix cache (engine/prefix_cache.py) ------------------------------------------------
    def _cache_prefix(self, req: Request, length: int) -> None:
        """req's caches hold exactly its first `length` prompt tokens now: keep a copy for later
        prompts that start with them, if they are enough tokens, pages are to spare and a slot is
        free (the least recently used entry makes room)."""
        cache, sched = self.prefix_cache, self.scheduler
        variant = self._prefix_variant(req, length)
        if not cache.wants(req.prompt_ids[:length], variant):
            return
        pages = sched._pages_for(length)
        # only pages nobody needs soon: one per running request stays free for its next token
        if sched.kv.allocator.num_free - len(sched.running) < pages:
            return
        if len(cache.entries) >= cache.max_entries:
            self._drop_cached(cache.pop_lru())
        if not sched.states.num_free:
            return
        entry = CachedPrompt(list(req.prompt_ids[:length]), sched.kv.allocator.alloc(pages), sched.states.alloc(),
                             variant=variant)
        self.runner.copy_caches(req.pages[:pages], req.state_slot, entry.pages, entry.state_slot)
        sched.compressed.on_extend(0, entry.length)
        cache.add(entry)

    def _prefix_variant(self, req: Request, length: int) -> int | None:
        """What req's caches after its first `length` tokens depend on besides the tokens: None
        below dense_len (every chunk that computed them ended below it: dense attention), else its
        prompt's stage-1 class (SparseConfig.prompt_class: whether stage 1 hid an entry from its
        prompt tokens, reference.visible_count)."""
        sc = self.cfg.sparse
        return None if length < sc.dense_len else sc.prompt_class(req.num_prompt)

    def _can_reuse(self, req: Request, entry: CachedPrompt) -> bool:
        """Whether entry holds what req would compute for those tokens itself: the same prompt
        class, and, where that class hides an entry, no token of req's output in it (req computes
        its output tokens by the decode rule, the entry's prompt computed them as prompt tokens)."""
        if entry.variant is None:
            return True
        return (entry.variant == self._prefix_variant(req, entry.length)
                and (entry.variant == 0 or entry.length <= req.num_prompt))

    def _drop_cached(self, entry: CachedPrompt) -> None:
        self.scheduler.kv.allocator.free(entry.pages)
        self.scheduler.states.free(entry.state_slot)
        self.scheduler.compressed.on_release(entry.length)

    def _reclaim_pages(self, n: int) -> None:
        """The scheduler is short of n pages: cached prompts give theirs back, least recently used first."""
        freed = 0
        while freed < n and (entry := self.prefix_cache.pop_lru()) is not None:
            self._drop_cached(entry)
            freed += len(entry.pages)

    def _reuse_cached_prompts(self) -> None:
        """Waiting requests whose tokens start with a cached prompt start from a copy of it, in
        queue order, as far as the running limit, slots and pages allow: new requests, and
        preempted ones, which then recompute only the rest of their prompt and their output so far
        (requests that need per-chunk work, prompt logprobs or scoring, compute their whole
        prompt). New requests without a hit get their cache_split (PrefixCache.split_point)."""
        cache, sched = self.prefix_cache, self.scheduler
        if not cache.entries or not sched.waiting:
            return
        for req in sched.waiting[:sched.max_running]:  # (those that could start soon)
            if not sched.reuses_prefix(req) or req.prefix_checked == cache.version:
                continue
            if (entry := cache.lookup(req.tokens, lambda e: self._can_reuse(req, e))) is None:
                # no entry is a prefix of it, but its common prefix with one may be long enough to
                # keep: its prefill pauses there for a snapshot (the next such prompt reuses it)
                if req.num_output == 0:
                    req.cache_split = cache.split_point(req.prompt_ids)
                req.prefix_checked = cache.version  # (looked up again only when entries change)
                continue
            if not sched.adopt(req, len(entry.pages), may_reclaim=False):  # (a reclaim could drop this entry)
                break
            self.runner.copy_caches(entry.pages, entry.state_slot, req.pages, req.state_slot)
            self._advance(req, entry.length)
            req.cached_tokens = entry.length
            self.stats["cached_prompt_tokens"] += entry.length

    def _record_prompt_logprobs(self, req: Request, first: int, logits: torch.Tensor) -> None:
        """Logprobs of prompt tokens first + 1 .. first + len(logits) from the logits of positions
        first .. (log_softmax of the raw logits: no penalties, no temperature), one host read."""
        targets = req.tokens[first + 1:first + 1 + logits.shape[0]]
        k = req.params.top_logprobs
        _, lps, tops = read_logprobs(torch.log_softmax(logits.float(), dim=-1),
                                     torch.tensor(targets, device=logits.device), k)
        req.prompt_logprobs.extend((lp, tok, top if k else None) for lp, tok, top in zip(lps, targets, tops))
        req.prompt_lp_next = first + 1 + len(targets)

    # ---- overlap scheduling ------------------------------------------------------------------
    def _can_defer(self, req: Request) -> bool:
        """Whether req's token may stay on the GPU until the next step has been launched: its draw
        must not read its history, and the token must not be its last allowed one (the next
        step would schedule it again, past its length)."""
        return not needs_history(req.sampling) and req.num_output + 1 < self._max_new_tokens(req)

    def _launch_sample(self, logits: torch.Tensor, sampled: list[Request]) -> _InFlight:
        """Sample on the device, start the copy to the host, and put placeholders in the tokens."""
        tokens = self.sampler.sample_on_device(logits, [r.sampling for r in sampled])
        copied = None
        if tokens.is_cuda:
            if len(self._pinned) < 2 or self._pinned[0].numel() < tokens.numel():
                n = max(tokens.numel(), 256)
                self._pinned = [torch.empty(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._pinned.reverse()  # the other buffer than the step still in flight uses
            host = self._pinned[0][:tokens.numel()]
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = tokens
        positions = []
        for i, req in enumerate(sampled):
            positions.append(len(req.tokens))
            req.tokens.append(placeholder(i))
        return _InFlight(sampled, positions, tokens, host, copied)

    def _resolve(self) -> list[StepOutput]:
        """Read back the step in flight (if any): its tokens replace their placeholders, then the
        usual stop checks. Requests that ended meanwhile (aborted, or stopped by the previous
        step's token) drop theirs."""
        f, self._inflight = self._inflight, None
        if f is None:
            return []
        if f.copied is not None:
            f.copied.synchronize()
        outputs = []
        for req, pos, tok in zip(f.reqs, f.positions, f.host.tolist()):
            if req.status == Status.FINISHED or pos >= len(req.tokens) or req.tokens[pos] >= 0:
                continue
            req.tokens[pos] = tok
            req.sampling.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self.stats["generated_tokens"] += 1
            n = pos + 1 - req.num_prompt
            reason = self._stop_reason(req, tok, n)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(self._output(req, [tok], num_output=n))
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

    def _stop_reason(self, req: Request, tok: int, n: int | None = None) -> dict | None:
        """n: the request's output length with tok (default: as its tokens say)."""
        p = req.params
        n = req.num_output if n is None else n
        grammar = req.sampling.grammar
        if grammar is not None and grammar.is_terminated():  # the constrained output is complete
            return stop_reason(tok)
        if not p.ignore_eos and n >= p.min_new_tokens:
            if tok in self.eos_ids or (p.stop_token_ids and tok in p.stop_token_ids):
                return stop_reason(tok)
        if n >= self._max_new_tokens(req):
            return length_reason(n)
        return None

    # ---- introspection (tests, metrics) ------------------------------------------------------
    def _log_cold_paths(self) -> None:
        """Kernels compiled, autotuned or graphs captured by this step: start-up missed them."""
        events, self._builds_seen = WATCH.events[self._builds_seen:], len(WATCH.events)
        for e in events:
            if e.after_ready:
                log.warning("cold path after start-up: %s %s (%.2f s) %s", e.kind, e.name, e.seconds, e.detail[:300])

    def _trace_step(self, work: list[ScheduledWork]) -> None:
        """One JSON line per step (EngineArgs.step_trace): what the scheduler chose and what it
        left waiting; the host clock at launch (with overlap scheduling, a step's GPU time shows
        as the gap to the line after next)."""
        sched = self.scheduler
        decode = [w for w in work if w.req.is_decoding]
        prefill = [w for w in work if not w.req.is_decoding]
        self._trace.write(json.dumps({
            "t": round(time.time(), 4), "step": self.stats["steps"], "running": len(sched.running),
            "waiting": len(sched.waiting), "decode_rows": len(decode),
            "draft_tokens": sum(len(w.draft) for w in decode),
            "prefill_seqs": len(prefill), "prefill_tokens": sum(w.num_tokens for w in prefill),
            "pages_free": sched.kv.allocator.num_free, "cold_builds": WATCH.num_after_ready,
        }) + "\n")

    def resource_counters(self) -> dict:
        """What requests hold (back to its idle value when they are done: the leak checks) and
        what is free for them. The prefix cache's pages and slots count as free (it gives them
        back on demand); prefix_cache_counters has them."""
        c = self.runner.caches
        cached = self.prefix_cache.entries
        return {
            "pages_used": c.kv.allocator.num_used - self.prefix_cache.num_pages,
            "pages_free": c.kv.allocator.num_free + self.prefix_cache.num_pages,
            "compressed_entries": c.compressed.entries_in_use - sum(sum(c.compressed.counts(e.length)) for e in cached),
            "slots_used": c.states.num_used - len(cached),
            "slots_free": c.states.num_free + len(cached),
        }

    def prefix_cache_counters(self) -> dict:
        return {"prefix_cache_entries": len(self.prefix_cache.entries),
                "prefix_cache_pages": self.prefix_cache.num_pages,
                "cached_prompt_tokens": self.stats["cached_prompt_tokens"]}

    def reset_stats(self) -> None:
        """Zero the counters (after the start-up warm-up's requests)."""
        self.stats = dict.fromkeys(self.stats, 0)
        self.scheduler.num_preemptions = 0

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only when idle (False otherwise, nothing changed)."""
        if self.scheduler.has_work or self._inflight is not None:
            return False
        self._reclaim_pages(self.prefix_cache.num_pages)  # every entry holds at least one page
        return True
