"""Owns the model and its caches; turns a step's scheduled work into logits."""

from __future__ import annotations

import logging
import time

import torch

from salaserve.cache.budget import plan_caches
from salaserve.cache.compressed import CompressedKeyPool
from salaserve.cache.pages import KVPool, OutOfPages
from salaserve.cache.state import StatePool
from salaserve.config import EngineArgs, ModelConfig
from salaserve.core.batch import ForwardBatch, PageTableMirror, SeqWork
from salaserve.engine.scheduler import ScheduledWork
from salaserve.kernels import get_backend, resolve_backend_name, tree_pages
from salaserve.kernels.compile_ahead import parallel_autotune
from salaserve.kernels.compile_watch import WATCH
from salaserve.kernels.options import KernelOptions
from salaserve.model.loader import load_state_dict
from salaserve.model.sala import Caches, SalaModel, fuse_state_dict
from salaserve.parallel.group import SINGLE, backend_for, init_group, split_group
from salaserve.parallel.ops import TensorParallelOps
from salaserve.parallel.shard import check_tp, check_tp_backend, kv_replicas, shard_state_dict

log = logging.getLogger("salaserve")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def placeholder(i: int) -> int:
    """The token id that stands for row i of the previous step's sampled tokens (overlap
    scheduling: the next step is built before those tokens reach the host)."""
    return -1 - i


def resolve_placeholders(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids with every placeholder(i) replaced by prev_tokens[i], on the device (no sync)."""
    rows = (-1 - input_ids).clamp_(0, prev_tokens.numel() - 1)
    return torch.where(input_ids < 0, prev_tokens[rows], input_ids)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class ModelRunner:
    def __init__(self, args: EngineArgs, model_dir: str, tp_rank: int = 0, tp_init: str | None = None,
                 followers=None):
        """Tensor parallelism (args.tp_size > 1): this is rank tp_rank of the group that meets at
        tp_init (a tcp:// address); its model and caches hold its shard. Rank 0 also gets
        `followers` (engine/tp_workers.py), to which it sends every operation on the device caches
        before running it, so that the other ranks run it too."""
        args.validate()
        t0 = time.perf_counter()
        WATCH.install()  # what start-up builds (the engine marks when start-up is over)
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.cfg = ModelConfig.from_pretrained(model_dir)
        self.followers = followers
        self.tp = SINGLE
        self._zeroed: list[int] = []  # state slots zeroed since the last message to the followers
        self.backend_name = resolve_backend_name(args.backend, self.device)
        if args.tp_size > 1:
            check_tp(self.cfg, args.tp_size)
            check_tp_backend(self.cfg, args.tp_size, self.backend_name)
            if self.device.type == "cuda":  # NCCL works on the current device: this rank's GPU
                torch.cuda.set_device(self.device)
            self.tp = init_group(tp_rank, args.tp_size, backend_for(self.device), tp_init, args.dist_timeout)
        backend = get_backend(self.backend_name, self.device, KernelOptions.from_engine_args(args))
        if self.tp.size > 1:
            # replicated KV heads: the ranks sharing one sum its stage-1 scores (created by every rank)
            kv_group = None
            if kv_replicas(self.cfg, self.tp.size) > 1:
                kv_group = split_group(self.tp, self.cfg.num_key_value_heads)
            backend = TensorParallelOps(backend, self.tp, kv_group)
        weights = load_state_dict(model_dir, self.cfg, dtype=self.dtype, device=self.device,
                                  load_format=args.load_format, seed=args.seed, quantization=args.quantization,
                                  quantize_lm_head=args.quantize_lm_head)
        weights = shard_state_dict(self.cfg, weights, self.tp.rank, self.tp.size)
        self.model = SalaModel(self.cfg, fuse_state_dict(self.cfg, weights), backend, self.dtype, self.device,
                               tp_rank=self.tp.rank, tp_size=self.tp.size)
        self.load_seconds = time.perf_counter() - t0
        # seconds per start-up phase, in order (logged at the end; micro and profile_step print them)
        self.startup_phases: dict[str, float] = {"load": self.load_seconds}

        if hasattr(backend, "prepare_weights"):  # kernel-specific weight copies, before the memory plan
            t = time.perf_counter()
            backend.prepare_weights(self.model.p, self.device)
            self.startup_phases["prepare weights"] = time.perf_counter() - t
        cfg, sc = self.model.cfg, self.cfg.sparse  # this rank's heads: the caches hold only those
        kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else self.dtype
        state_dtype = DTYPES[args.state_dtype]
        self.plan = plan_caches(cfg, args, self.device, kv_dtype, state_dtype, compressed_dtype=self.dtype)
        # every rank must hold the pages rank 0 hands out: the fewest any rank has room for
        self.plan.num_pages = self.tp.min_int(self.plan.num_pages, self.device)
        n_sparse = len(cfg.sparse_layers)
        self.caches = Caches(
            kv=KVPool(n_sparse, self.plan.num_pages, sc.block_size, cfg.num_key_value_heads, cfg.head_dim,
                      kv_dtype, self.device, compute_dtype=self.dtype),
            compressed=CompressedKeyPool(sc, n_sparse, self.plan.num_pages, cfg.num_key_value_heads,
                                         cfg.head_dim, self.dtype, self.device),  # compressed keys: model dtype
            states=StatePool(self.plan.num_slots, len(cfg.lightning_layers), cfg.lightning_nh,
                             cfg.lightning_head_dim, state_dtype, self.device),
        )
        log.info("model %s loaded in %.1f s on %s (%s, backend %s); %s", model_dir, self.load_seconds,
                 self.device, str(self.dtype).replace("torch.", ""), self.backend_name,
                 self.plan.describe(sc.block_size))
        self.context_length = args.context_length or cfg.max_position_embeddings
        # rows grow on demand past 1024 pages (64K tokens at 64 per page), so a 1M context with
        # many slots does not reserve its full width up front
        self.page_mirror = PageTableMirror(self.plan.num_slots, min(1024, -(-self.context_length // sc.block_size)))
        self.graphs = None
        self.scratch = None
        # Tokens per sequence that verify steps are padded up to (the captured verify graphs);
        # None: no padding. real_rows: the logit rows of real tokens in the last padded step.
        self.verify_buckets: list[int] | None = None
        self.real_rows: torch.Tensor | None = None
        # EAGLE-3: the target layers whose hidden states each forward also returns at its logit
        # rows (in last_aux, [M, 3*hidden], rows as the logits'); None: none, at no cost
        self.aux_layers: tuple[int, ...] | None = None
        self.last_aux: torch.Tensor | None = None
        # ... and at the prompt's last aux_context positions (before the last: a logit row), for
        # the drafter's K/V of the recent prompt; last_aux_context [E, 3*hidden], in work order
        # (`prompt_aux_rows` gives each chunk's share)
        self.aux_context = 0
        self.last_aux_context: torch.Tensor | None = None
        self._aux_rows: list[int] = []
        if hasattr(backend, "prepare"):
            t = time.perf_counter()
            tokens_per_seq = 1 + args.speculative_num_draft_tokens if args.speculative_algorithm else 1
            backend.prepare(cfg, self.device, self.model.p, max_rows=args.max_running_requests * tokens_per_seq,
                            max_context=self.context_length)
            self.startup_phases["calibration"] = time.perf_counter() - t
        with parallel_autotune(args.parallel_compile):  # the warm-up's autotune searches compile in threads
            if self.device.type == "cuda":
                self.startup_phases["warm-up"] = self.warmup()
            if self.device.type == "cuda" and self.backend_name == "triton" and args.enable_cuda_graph:
                t = time.perf_counter()
                self._capture_graphs()
                self.startup_phases["graph capture"] = time.perf_counter() - t
        if self.followers is not None:  # rank 0: the slots it zeroes for new sequences, the others zero too
            self.caches.states.on_alloc = self._zeroed.append
        log.info("start-up %.1f s: %s", time.perf_counter() - t0, self.describe_startup())

    def describe_startup(self) -> str:
        """The start-up phases' seconds, e.g. 'load 12.0 s, calibration 61.2 s, ...'."""
        return ", ".join(f"{name} {sec:.1f} s" for name, sec in self.startup_phases.items())

    @torch.no_grad()
    def warmup(self) -> float:
        """One dense and one sparse prefill chunk on scratch pages and a scratch slot, so that
        kernel compilation and fla's autotuning (tens of seconds on a first call) happen at
        start-up instead of in the first request. Returns the seconds it took."""
        t0 = time.perf_counter()
        sc = self.cfg.sparse
        length = min(sc.dense_len + sc.block_size, self.capacity_tokens - sc.block_size)
        chunk = max(1, min(self.args.chunked_prefill_size, length))
        kv, states = self.caches.kv, self.caches.states
        pages = kv.allocator.alloc(-(-length // sc.block_size))
        slot = states.alloc()
        try:
            ids = [3 + (i * 7919) % max(1, self.cfg.vocab_size - 16) for i in range(length)]
            done = 0
            while done < length:  # chunks: dense while below dense_len, then a sparse one
                n = min(chunk, length - done)
                work = [SeqWork(state_slot=slot, pages=pages, cache_len=done, token_ids=ids[done:done + n],
                                need_logits=done + n == length)]
                self.model.forward(ForwardBatch.build(work, sc.block_size, sc.dense_len, self.device), self.caches)
                done += n
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            kv.allocator.free(pages)
            states.free(slot)
        seconds = time.perf_counter() - t0
        log.info("warm-up prefill of %d tokens (kernel compilation, autotuning) took %.1f s", length, seconds)
        return seconds

    def _scratch(self) -> tuple[int, int]:
        """One page and one state slot that padding rows and filler tokens may scribble on."""
        if self.scratch is None:
            self.scratch = (self.caches.kv.allocator.alloc(1)[0], self.caches.states.alloc())
        return self.scratch

    def _capture_graphs(self) -> None:
        from salaserve.engine.cuda_graph import StepGraphs

        sc = self.cfg.sparse
        scratch_page, scratch_slot = self._scratch()
        self.graphs = StepGraphs(
            self.model, self.caches, max_bs=self.args.cuda_graph_max_bs or self.args.max_running_requests,
            max_pages=-(-self.context_length // sc.block_size), dense_pages=-(-sc.dense_len // sc.block_size),
            scratch_page=scratch_page, scratch_slot=scratch_slot, device=self.device,
            max_verify_tokens=1 + self.args.speculative_num_draft_tokens if self.args.speculative_algorithm else 1,
            verify_max_bs=self.args.speculative_max_batch if self.args.speculative_algorithm else 0)
        self.graphs.capture()
        if self.graphs.verify_ns:
            self.enable_verify_padding(self.graphs.verify_ns)

    def enable_verify_padding(self, buckets: list[int]) -> None:
        """Pad all-verify steps to the next of these tokens-per-sequence counts (filler tokens on
        the scratch page), so that they run as one captured graph."""
        self._scratch()
        self.verify_buckets = sorted(buckets)

    @property
    def capacity_tokens(self) -> int:
        return self.plan.num_pages * self.cfg.sparse.block_size

    def _verify_length(self, work: list[ScheduledWork]) -> int | None:
        """Tokens per sequence to pad an all-verify step to: the smallest bucket that holds its
        longest draft (None: no padding)."""
        if not self.verify_buckets or not all(w.draft for w in work) or any(w.tree for w in work):
            return None  # (trees run eagerly: the verify graphs take chains)
        longest = max(1 + len(w.draft) for w in work)
        return next((n for n in self.verify_buckets if n >= longest), None)

    def build_batch(self, work: list[ScheduledWork]) -> ForwardBatch:
        seqs = []
        pad_to = self._verify_length(work)
        real_rows = []
        self._aux_rows, offset = [], 0  # rows of the prompt context; the flat row of each seq's first token
        for w in work:
            r = w.req
            start = r.num_computed
            if seqs:
                offset += len(seqs[-1].token_ids)
            if w.draft:  # verify: the pending token, then the drafts; logits at every position
                ids = r.tokens[start:start + 1] + w.draft
                pad = (pad_to - len(ids)) if pad_to else 0
                base = len(seqs) * pad_to if pad_to else 0
                real_rows.extend(range(base, base + len(ids)))
                seqs.append(SeqWork(state_slot=r.state_slot, pages=r.pages, cache_len=start,
                                    token_ids=ids + [ids[-1]] * pad, need_logits=True,
                                    num_logits=len(ids) + pad, verify=True, pad_tokens=pad,
                                    prompt_len=r.num_prompt,
                                    tree_parents=w.tree.parents if w.tree is not None else None))
                continue
            if self.aux_layers and self.aux_context:
                lo, hi = prompt_aux_rows(r, start, w.num_tokens, self.aux_context)
                self._aux_rows.extend(range(offset + lo, offset + hi))
            seqs.append(SeqWork(state_slot=r.state_slot, pages=r.pages, cache_len=start,
                                token_ids=r.tokens[start:start + w.num_tokens],
                                need_logits=start + w.num_tokens == len(r.tokens) and not r.score_only,
                                prompt_rows=prompt_logit_rows(r, start, w.num_tokens),
                                # prompt tokens, the first time or recomputed after a preemption,
                                # get the prompt's stage-1 rule; output tokens the decode rule
                                prompt_len=r.num_prompt))
        sc = self.cfg.sparse
        padded = any(s.pad_tokens for s in seqs)
        pad_slot = self._scratch()[0] * sc.block_size if padded else None
        self.real_rows = torch.tensor(real_rows, device=self.device) if padded else None
        scratch = self._tree_scratch(seqs)
        self._step = (seqs, pad_slot, scratch)  # what the other tensor-parallel ranks build this batch from
        return self._build(seqs, pad_slot, scratch)

    def _build(self, seqs: list[SeqWork], pad_slot: int | None, scratch: list[int] | None) -> ForwardBatch:
        sc = self.cfg.sparse
        batch = ForwardBatch.build(seqs, sc.block_size, sc.dense_len, self.device, pad_slot=pad_slot,
                                   pages=self.page_mirror)
        if scratch is not None:
            batch.tree_scratch = tree_pages.Scratch(scratch, sc)
        return batch

    def _tree_scratch(self, seqs: list[SeqWork]) -> list[int] | None:
        """Pages a tree step's rows copy the pages their paths rewrite into (kernels/tree_pages.py),
        for backends that want them; rank 0's allocator hands them out and `forward` returns them.
        None: no tree, or too few free pages (the backend then runs the torch ground truth)."""
        trees = [s.tree_parents for s in seqs]
        if not getattr(self.model.ops, "wants_tree_scratch", False) or all(t is None for t in trees):
            return None
        need = tree_pages.scratch_pages_needed([s.cache_len for s in seqs], trees, self.cfg.sparse)
        try:
            return self.caches.kv.allocator.alloc(need)
        except OutOfPages:
            log.warning("tree verify: %d scratch pages not free, this step's sparse layers run in torch", need)
            return None

    def forward(self, work: list[ScheduledWork], prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [M, vocab] fp32 for the requests of `work` that sample this step, in order
        (filler rows of a padded verify step dropped); a request's prompt-logprob rows
        (`prompt_logit_rows`) come before its sampled row. prev_tokens: the token ids the previous
        step sampled, still on the device (overlap scheduling): a request's token id -1 - i in
        `work` stands for prev_tokens[i]."""
        batch = self.build_batch(work)
        try:
            logits = self._forward_built(work, batch, prev_tokens)
        finally:
            if self._step[2]:  # a tree step's scratch pages: free again once its kernels are queued
                self.caches.kv.allocator.free(self._step[2])
        if self.aux_layers:
            logits, aux = logits
            m = batch.logits_indices.numel()
            aux, self.last_aux_context = aux[:m], aux[m:]
            self.last_aux = aux if self.real_rows is None else aux[self.real_rows]
        return logits if self.real_rows is None else logits[self.real_rows]

    def _forward_built(self, work: list[ScheduledWork], batch: ForwardBatch, prev_tokens):
        """forward's model run on its built batch (the followers told first)."""
        # placeholders only ever stand last in a request's tokens (drafts are not in them)
        placeholders = any(w.req.tokens[w.req.num_computed + w.num_tokens - len(w.draft) - 1] < 0 for w in work)
        if placeholders and prev_tokens is None:
            raise RuntimeError("a placeholder token id without the previous step's tokens")
        if self.followers is not None:  # the other ranks build the same batch; the tokens they stand for follow
            self._mirror("forward", *self._step, prev_tokens.numel() if placeholders else None)
            if placeholders:
                self.tp.broadcast(prev_tokens.to(torch.int64).contiguous())
        if placeholders:
            batch.input_ids = resolve_placeholders(batch.input_ids, prev_tokens)
        self.last_batch = batch
        try:
            logits = self.run_batch(batch)
        except RuntimeError as e:  # a collective that a dead rank left: say which rank
            if self.followers is not None:
                self.followers.raise_if_failed(e)
            raise
        return logits

    def run_batch(self, batch: ForwardBatch):
        """The model on a built batch: its CUDA graph when one was captured for it, else eagerly.
        With aux_layers set: (logits, aux), always eager (the graphs do not capture aux)."""
        if self.aux_layers:
            rows = torch.tensor(self._aux_rows, dtype=torch.long, device=self.device) if self._aux_rows else None
            return self.model.forward(batch, self.caches, aux_layers=self.aux_layers, aux_rows=rows)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self.model.forward(batch, self.caches)

    def copy_caches(self, src_pages: list[int], src_slot: int, dst_pages: list[int], dst_slot: int) -> None:
        """dst_pages and dst_slot get the K/V (and fp8 scales), compressed keys and Lightning state
        of src_pages and src_slot, page for page (prefill sharing, the prefix cache)."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"copy_caches: {len(src_pages)} source pages for {len(dst_pages)}")
        self._mirror("copy_caches", src_pages, src_slot, dst_pages, dst_slot)
        kv, comp, states = self.caches.kv, self.caches.compressed, self.caches.states
        a = torch.tensor(src_pages, dtype=torch.long, device=self.device)
        b = torch.tensor(dst_pages, dtype=torch.long, device=self.device)
        tensors = [kv.k, kv.v, comp.c1, comp.c2] + ([kv.k_scale, kv.v_scale] if kv.fp8 else [])
        for t in tensors:  # [layers, pages, ...]
            t[:, b] = t[:, a]
        states.state[dst_slot] = states.state[src_slot]

    def commit_verified(self, commits: list[tuple]) -> None:
        """After a verify step (before the next forward): advance the Lightning states of the
        verified sequences by their accepted tokens. commits: (index in the step's work, state
        slot, number of tokens), or for a tree verify (..., the accepted path's verify rows), whose
        sparse-layer K/V and compressed keys are written now too."""
        self._mirror("commit_verified", commits)
        ops = self.model.ops
        ops.commit_verified(self.caches.states, self.last_batch, commits, self.model.log_decay)
        trees = [c for c in commits if not isinstance(c[2], int)]
        if trees:
            ops.commit_tree_kv(self.caches.kv, self.caches.compressed, self.last_batch, trees)

    # ---- tensor parallelism: rank 0 sends each operation on the caches to the other ranks ------
    def _mirror(self, op: str, *args) -> None:
        """Rank 0: send `op` to the other ranks before running it (nothing elsewhere)."""
        if self.followers is not None:
            zeroed = list(self._zeroed)
            self._zeroed.clear()  # in place: the state pool's on_alloc appends to this list
            self.followers.send((op, args, zeroed))

    def follow(self, op: str, args: tuple, zeroed: list[int]) -> None:
        """Ranks 1..N-1: run rank 0's `op` on this rank's shard, after zeroing the state slots rank 0
        handed to new sequences since its last message."""
        for slot in zeroed:
            self.caches.states.state[slot].zero_()
        if op == "forward":
            self._follow_forward(*args)
        elif op in ("copy_caches", "commit_verified"):
            getattr(self, op)(*args)
        else:
            raise ValueError(f"unknown tensor-parallel operation {op!r}")

    def _follow_forward(self, seqs: list[SeqWork], pad_slot: int | None, scratch: list[int] | None,
                        num_prev: int | None) -> None:
        batch = self._build(seqs, pad_slot, scratch)
        if num_prev is not None:  # overlap scheduling: rank 0's sampled tokens, still on its device
            prev = self.tp.broadcast(torch.empty(num_prev, dtype=torch.int64, device=self.device))
            batch.input_ids = resolve_placeholders(batch.input_ids, prev)
        self.last_batch = batch
        self.run_batch(batch)  # the logits are rank 0's to sample

    def shutdown(self) -> None:
        """Rank 0: stop the other ranks. Every rank: leave the process group."""
        if self.followers is not None:
            self.followers.stop()
            self.followers = None
        self.tp.destroy()


def prompt_aux_rows(req, start: int, n: int, context: int) -> tuple[int, int]:
    """Offsets [lo, hi) in a chunk of n tokens from position start that hold the EAGLE-3 drafter's
    prompt context: positions len(tokens) - context .. len(tokens) - 2 of the sequence being
    prefilled (the last position is its logit row, captured anyway). A chunk may hold part of them."""
    if req.score_only:
        return 0, 0
    end = len(req.tokens) - 1
    lo, hi = max(start, end - context + 1), min(start + n, end)
    return (lo - start, hi - start) if hi > lo else (0, 0)


def prompt_logit_rows(req, start: int, n: int) -> tuple[int, int]:
    """Offsets [lo, hi) in a chunk of n tokens from position start whose logits give prompt
    logprobs: position p predicts prompt token p + 1, for the tokens from req.prompt_lp_next on."""
    if not req.prompt_lp_pending:
        return 0, 0
    lo = max(start, req.prompt_lp_next - 1)
    hi = min(start + n, req.num_prompt - 1)
    return (lo - start, hi - start) if hi > lo else (0, 0)
