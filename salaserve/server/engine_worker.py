"""The engine process: owns the `Engine` and talks to the server over two one-way pipes.

Its loop: take every waiting message (blocking only while the engine is idle, so it never spins),
run one engine step, and send back one `Update` (acks of new requests, the step's outputs,
replies, counters). Tokenization, detokenization and HTTP all live in the server process, so
nothing here ever waits on a client.

A step that raises does not end the process: the requests it was running are aborted with an
error finish (status 500) and the loop goes on with the others.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass, field

from salaserve.core.request import ABORT_REASON, StepOutput
from salaserve.kernels.compile_watch import WATCH

log = logging.getLogger("salaserve.engine")

# server -> engine messages (tuples whose first item is one of these)
ADD = "add"  # (ADD, rid, prompt_ids, SamplingParams, priority, share_rank)
ABORT = "abort"  # (ABORT, rid)
ABORT_ALL = "abort_all"  # (ABORT_ALL,)
FLUSH = "flush"  # (FLUSH, reply_token)
SHUTDOWN = "shutdown"  # (SHUTDOWN,)
# engine -> server messages
READY = "ready"  # (READY, info dict)
FAILED = "failed"  # (FAILED, message)
UPDATE = "update"  # (UPDATE, Update)

# Engine.stats key that a speculating engine fills; SGLang's bench reads it from /get_server_info.
SPEC_ACCEPT_KEY = "avg_spec_accept_length"


@dataclass
class Update:
    acks: list[tuple[str, str | None]] = field(default_factory=list)  # (rid, rejection message or None)
    outputs: list[StepOutput] = field(default_factory=list)
    replies: list[tuple[int, object]] = field(default_factory=list)  # (reply token, value)
    stats: dict = field(default_factory=dict)


def error_reason(message: str) -> dict:
    """Finish reason of a request that an engine error ended (SGLang's abort shape)."""
    return {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"}


def engine_info(engine) -> dict:
    """Static facts the server needs (limits for validation, /get_model_info, /get_server_info)."""
    cfg, runner = engine.cfg, engine.runner
    return {
        "model_dir": engine.model_dir,
        "context_length": engine.context_length,
        "max_total_num_tokens": runner.capacity_tokens,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": list(cfg.eos_token_ids),
        "model_type": cfg.model_type,
        "architectures": list(cfg.architectures),
        "max_running_requests": engine.args.max_running_requests,
        "num_pages": runner.plan.num_pages,
        "page_size": cfg.sparse.block_size,
        "num_state_slots": runner.plan.num_slots,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "backend": runner.backend_name,
        "load_seconds": runner.load_seconds,
        "startup_phases": dict(runner.startup_phases),
        "weight_bytes": cfg.num_parameters() * runner.dtype.itemsize,  # unquantized estimate
        "kv_cache_bytes": runner.plan.num_pages * runner.plan.page_bytes,
        "state_bytes": runner.plan.num_slots * runner.plan.slot_bytes,
    }


class EngineWorker:
    def __init__(self, engine, inbox, outbox):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox

    def serve_forever(self) -> None:
        try:
            while self.run_once():
                pass
        except (EOFError, BrokenPipeError, ConnectionResetError):
            log.info("server went away; engine process exits")

    def run_once(self) -> bool:
        """One loop turn; False once told to shut down."""
        update = Update()
        msgs = self._receive(block=not self.engine.has_unfinished())
        for msg in msgs:
            if msg[0] == SHUTDOWN:
                return False
            self._handle(msg, update)
        stepped = self.engine.has_unfinished()
        if stepped:
            update.outputs.extend(self.step())
        if msgs or stepped:
            update.stats = self.stats()
            self.outbox.send((UPDATE, update))
        return True

    def _receive(self, block: bool) -> list:
        if block:
            self.inbox.poll(None)  # wakes on a message or on EOF (the server is gone)
        msgs = []
        while self.inbox.poll(0):
            msgs.append(self.inbox.recv())
        return msgs

    def _handle(self, msg: tuple, update: Update) -> None:
        kind = msg[0]
        if kind == ADD:
            _, rid, prompt_ids, params, priority, share_rank = msg
            try:
                self.engine.add_request(rid, prompt_ids, params, priority, share_rank)
                update.acks.append((rid, None))
            except ValueError as e:
                update.acks.append((rid, str(e)))
            except Exception as e:  # a bug, not bad input: still answer, never die
                log.exception("add_request(%s) failed", rid)
                update.acks.append((rid, f"internal error: {e}"))
        elif kind == ABORT:
            update.outputs.extend(self._abort(msg[1], ABORT_REASON))
        elif kind == ABORT_ALL:
            for rid in list(self.engine.requests):
                update.outputs.extend(self._abort(rid, ABORT_REASON))
        elif kind == FLUSH:
            update.replies.append((msg[1], self.engine.flush_cache()))
        else:
            log.error("unknown message %r", kind)

    def _abort(self, rid: str, reason: dict) -> list[StepOutput]:
        """Abort and report it (the engine itself emits nothing for an aborted request)."""
        req = self.engine.requests.get(rid)
        if req is None or not self.engine.abort(rid):
            return []
        return [StepOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=dict(reason),
                           num_prompt=req.num_prompt, num_output=req.num_output,
                           num_preemptions=req.num_preemptions)]

    def step(self) -> list[StepOutput]:
        try:
            return self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting the running requests")
            victims = [r.rid for r in self.engine.scheduler.running] or list(self.engine.requests)
            reason = error_reason(f"engine error: {type(e).__name__}: {e}")
            return [out for rid in victims for out in self._abort(rid, reason)]

    def stats(self) -> dict:
        sched, engine_stats = self.engine.scheduler, self.engine.stats
        out = {
            "num_running_reqs": len(sched.running),
            "num_queue_reqs": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            **self.engine.resource_counters(),
            **self.engine.prefix_cache_counters(),
            **{f"engine_{k}": v for k, v in engine_stats.items() if k != SPEC_ACCEPT_KEY},
            # kernels compiled / autotuned and graphs captured after start-up (cold paths; 0 expected)
            "cold_builds_after_ready": WATCH.num_after_ready,
        }
        accept = self.engine.avg_spec_accept_length
        if accept is not None:  # with speculative decoding: SGLang's key
            out[SPEC_ACCEPT_KEY] = accept
        return out


def limit_cpu_threads(engine_args, cpu_engines: int = 1) -> None:
    """On CPU, leave half the cores to the HTTP process and its clients, shared out among the
    `cpu_engines` engine processes: intra-op threads that outnumber the free cores spin-wait,
    and a tiny-model step got 13x slower on 2 busy cores. An explicit OMP_NUM_THREADS wins."""
    import torch

    on_cpu = engine_args.device == "cpu" or (engine_args.device == "auto" and not torch.cuda.is_available())
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2 // cpu_engines))


def main(engine_args, inbox, outbox, cpu_engines: int = 1) -> None:
    """Entry point of the engine process (multiprocessing 'spawn')."""
    # Ctrl-C reaches the whole process group; the server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, engine_args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from salaserve.engine.engine import Engine

        limit_cpu_threads(engine_args, cpu_engines)
        engine = Engine(engine_args)
        info = engine_info(engine)
        info["initial_counters"] = engine.resource_counters()
    except Exception as e:
        log.error("engine failed to start:\n%s", traceback.format_exc())
        outbox.send((FAILED, f"{type(e).__name__}: {e}"))
        return
    outbox.send((READY, info))
    try:
        EngineWorker(engine, inbox, outbox).serve_forever()
    finally:
        engine.shutdown()  # the tensor-parallel ranks stop with the engine
