"""Tensor-parallel ranks 1..N-1: their processes, and the loop that follows rank 0's steps.

Rank 0 is the engine's own process: it schedules, samples, and owns the page and slot allocators.
Before each operation on the device caches (a forward, a cache copy, a verify commit) its runner
sends the operation to every other rank: the step's SeqWork list (host data, from which each rank
builds the same ForwardBatch; page lists as deltas, PageSync) and the state slots it zeroed for new
sequences since its last message. Each follower runs the operation on its shard, so all ranks join the same collectives in
the same order. Only rank 0 samples: after the all-reduces every rank has the same logits, so
there is nothing for the others to decide; sampled tokens reach them in the next step's SeqWork,
or (overlap scheduling) by a broadcast of rank 0's device tensor (runner.forward).

Why a pipe per follower for these messages, not a torch.distributed broadcast: a follower may
wait as long as the server is idle, which a collective would turn into a timeout; and a closed pipe
tells a follower that rank 0 is gone, so it exits instead of lingering.

Processes: multiprocessing 'spawn', not daemonic (a rank may start compiler processes of its own).
Each builds its ModelRunner (rank r on cuda:r, or the CPU), reports ready or its error, then loops.
Shutdown (Followers.stop): a stop message, a join with a timeout, then terminate and kill. A
follower that dies is reported by rank 0 at its next send (the process has an exit code, and its
last words if it could send them), or by the collective it left (gloo fails at once on the closed
connection; any collective gives up after --dist-timeout).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import signal
import time
import traceback

import torch

from salaserve.config import EngineArgs
from salaserve.core.batch import SeqWork
from salaserve.parallel.group import free_init_method

log = logging.getLogger("salaserve")

STARTED, READY, ERROR, STOP = "started", "ready", "error", "stop"


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed; the message says which and why."""


def rank_args(args: EngineArgs, rank: int, cuda_count: int | None = None) -> EngineArgs:
    """Rank `rank`'s engine arguments: on CUDA its own GPU, cuda:rank. Raises ValueError for a
    device that cannot hold tp_size ranks."""
    size = args.tp_size
    if size == 1:
        return args
    device = args.device
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device} names one GPU; with --tp-size {size} use --device cuda (rank i on "
                         "cuda:i) or cpu")
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device {device!r}: with --tp-size {size} use cuda, cpu or auto")
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and cuda_count == 0):
        return dataclasses.replace(args, device="cpu")
    if size > cuda_count:
        raise ValueError(f"--tp-size {size}: one GPU per rank, but {cuda_count} GPU(s) are visible "
                         "(CUDA_VISIBLE_DEVICES)")
    return dataclasses.replace(args, device=f"cuda:{rank}")


class PageSync:
    """Rank 0's side of the page lists: per state slot, the list the followers hold and how much of
    it, so that a step's message carries only the pages appended since (none for most decode steps;
    a 128K-token sequence has 2048 pages, which pickled whole for a batch of 32 cost ~1 ms to send
    and ~3 ms to read on the CPU). As PageTableMirror, it relies on a request's page list only
    growing, and a request that frees its pages getting a new list: a different list object, or a
    shorter one, is sent again from the start."""

    def __init__(self):
        self.owner: dict[int, list] = {}  # slot -> the list object last sent (held: its id is not reused)
        self.synced: dict[int, int] = {}

    def encode(self, seqs: list[SeqWork]) -> tuple[list[SeqWork], list[int]]:
        """seqs with only their new pages, and where each one's new pages start (0: from scratch)."""
        out, starts = [], []
        for w in seqs:
            s, pages = w.state_slot, w.pages
            if self.owner.get(s) is not pages or self.synced[s] > len(pages):
                self.owner[s], self.synced[s] = pages, 0
            k = self.synced[s]
            self.synced[s] = len(pages)
            out.append(dataclasses.replace(w, pages=pages[k:]))
            starts.append(k)
        return out, starts


class PageLists:
    """A follower's side: every slot's page list, rebuilt from PageSync's deltas (extended in place,
    so the runner's PageTableMirror copies only the new entries)."""

    def __init__(self):
        self.lists: dict[int, list] = {}

    def decode(self, seqs: list[SeqWork], starts: list[int]) -> list[SeqWork]:
        out = []
        for w, start in zip(seqs, starts):
            if start == 0:
                self.lists[w.state_slot] = list(w.pages)
            else:
                held = self.lists.get(w.state_slot)
                if held is None or len(held) != start:
                    raise RuntimeError(f"slot {w.state_slot}: page list out of step with rank 0 "
                                       f"({None if held is None else len(held)} pages held, delta from {start})")
                held.extend(w.pages)
            out.append(dataclasses.replace(w, pages=self.lists[w.state_slot]))
        return out


class Followers:
    """Ranks 1..N-1 as seen from rank 0: start, send, check, stop."""

    def __init__(self, procs: list, conns: list, init_method: str):
        self.procs = procs
        self.conns = conns
        self.init_method = init_method
        self.errors: dict[int, str] = {}  # rank -> what it reported before it died
        self.pages = PageSync()

    @classmethod
    def start(cls, args: EngineArgs, model_dir: str, num_threads: int | None = None) -> "Followers":
        """Spawn ranks 1..tp_size-1 (they start loading at once); rank 0 then builds its own runner
        with init_method, where all ranks meet."""
        ctx = multiprocessing.get_context("spawn")
        init_method = free_init_method()
        procs, conns = [], []
        try:
            for rank in range(1, args.tp_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=follower_main, name=f"salaserve-tp{rank}",
                                args=(rank_args(args, rank), model_dir, rank, init_method, child, num_threads))
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
        except BaseException:
            cls(procs, conns, init_method).stop()
            raise
        return cls(procs, conns, init_method)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _collect(self) -> None:
        """Read whatever the followers reported (errors come as their last message)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll():
                    kind, text = conn.recv()
                    if kind == ERROR:
                        self.errors[rank] = text
            except (EOFError, OSError):
                pass

    def check(self) -> None:
        """Raise RankFailed if a follower has exited or reported an error."""
        self._collect()
        for rank, p in enumerate(self.procs, start=1):
            if rank in self.errors or p.exitcode is not None:
                raise RankFailed(self.describe(rank))

    def describe(self, rank: int) -> str:
        p = self.procs[rank - 1]
        state = f"exited with code {p.exitcode}" if p.exitcode is not None else "failed"
        err = self.errors.get(rank)
        return f"tensor-parallel rank {rank} {state}" + (f":\n{err}" if err else "")

    def describe_failures(self) -> str | None:
        """Every follower that died or failed, or None when all are well (after an error in rank 0's
        collectives, to say which rank left)."""
        self._collect()
        bad = [self.describe(r) for r, p in enumerate(self.procs, start=1) if r in self.errors or p.exitcode is not None]
        return "; ".join(bad) or None

    def raise_if_failed(self, error: BaseException, wait_s: float = 5.0) -> None:
        """After a collective failed on rank 0: raise RankFailed naming the rank that left it (it
        may take a moment to exit), or return if every follower is well."""
        deadline = time.monotonic() + wait_s
        while True:
            failed = self.describe_failures()
            if failed:
                raise RankFailed(failed) from error
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def wait_started(self, timeout_s: float) -> None:
        """Block until every follower is about to join the group: one that fails before (an import,
        its arguments) is reported here instead of leaving rank 0 in the rendezvous until the timeout."""
        self._wait_for(STARTED, timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every follower has built its runner (RankFailed if one fails or is silent)."""
        self._wait_for(READY, timeout_s)

    def _wait_for(self, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                try:
                    if conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                        kind, text = conn.recv()
                        if kind == what:
                            break
                        self.errors[rank] = text
                        raise RankFailed(self.describe(rank))
                except (EOFError, OSError):
                    raise RankFailed(self._died_before(rank, what)) from None
                if p.exitcode is not None:
                    raise RankFailed(self._died_before(rank, what))
                if time.monotonic() >= deadline:
                    raise RankFailed(f"tensor-parallel rank {rank} was not {what} after {timeout_s:.0f} s")

    def _died_before(self, rank: int, what: str) -> str:
        text = self.describe(rank)
        if what == STARTED and rank not in self.errors:  # it never reached follower_main's first line
            text += (" before it started: a script that makes LLM(tp_size=N) needs the `if __name__ == "
                     "'__main__':` guard ('spawn' imports the main module again in each rank)")
        return text

    def send(self, msg) -> None:
        """One operation (op, args, zeroed slots) to every follower; a forward's page lists go as deltas."""
        self.check()
        op, args, zeroed = msg
        starts = None
        if op == "forward":
            seqs, *rest = args
            seqs, starts = self.pages.encode(seqs)
            args = (seqs, *rest)
        msg = (op, args, zeroed, starts)
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                raise RankFailed(self.describe(rank)) from None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every follower and wait for it: politely, then terminate, then kill."""
        data = pickle.dumps((STOP, (), [], None))
        for conn in self.conns:
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                log.warning("tensor-parallel rank %s did not stop; terminating it", p.name)
                p.terminate()
                p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            conn.close()
        self.conns = []


def follower_main(args: EngineArgs, model_dir: str, rank: int, init_method: str, conn,
                  num_threads: int | None = None) -> None:
    """Entry point of rank `rank` (multiprocessing 'spawn')."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; rank 0 decides when to stop
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s")
    if num_threads:
        torch.set_num_threads(num_threads)
    runner = None
    try:
        from salaserve.engine.runner import ModelRunner

        conn.send((STARTED, None))
        runner = ModelRunner(args, model_dir, tp_rank=rank, tp_init=init_method)
        pages = PageLists()
        conn.send((READY, None))
        while True:
            try:
                op, op_args, zeroed, starts = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                log.warning("rank 0 closed the pipe; rank %d exits", rank)
                return
            if op == STOP:
                return
            if op == "forward":
                seqs, *rest = op_args
                op_args = (pages.decode(seqs, starts), *rest)
            runner.follow(op, op_args, zeroed)
    except BaseException:
        text = traceback.format_exc()
        log.error("tensor-parallel rank %d failed:\n%s", rank, text)
        try:
            conn.send((ERROR, text))
        except (BrokenPipeError, OSError):
            pass
        raise SystemExit(1)
    finally:
        if runner is not None:
            runner.tp.destroy()
        conn.close()


def check_layout(args: EngineArgs, model_dir: str) -> None:
    """ValueError (TPConfigError for the model) unless tp_size ranks fit the device and the model."""
    from salaserve.config import ModelConfig
    from salaserve.kernels import resolve_backend_name
    from salaserve.parallel.shard import check_tp, check_tp_backend

    device = torch.device(rank_args(args, 0).device)  # "cpu" or "cuda:0" by now
    cfg = ModelConfig.from_pretrained(model_dir)
    check_tp(cfg, args.tp_size)
    check_tp_backend(cfg, args.tp_size, resolve_backend_name(args.backend, device))


def start_runner(args: EngineArgs, model_dir: str):
    """Rank 0's ModelRunner, with ranks 1..tp_size-1 started and ready (tp_size > 1). A model that
    does not split tp_size ways is refused before any process starts; a rank that fails at start-up
    is reported (RankFailed) and every rank is stopped."""
    from salaserve.engine.runner import ModelRunner

    check_layout(args, model_dir)
    args0 = rank_args(args, 0)
    threads = max(1, torch.get_num_threads() // args.tp_size) if args0.device == "cpu" else None
    followers = Followers.start(args, model_dir, threads)
    try:
        followers.wait_started(args.dist_timeout)
        runner = ModelRunner(args0, model_dir, tp_rank=0, tp_init=followers.init_method, followers=followers)
        followers.wait_ready(args.dist_timeout)
    except BaseException as e:
        failed = followers.describe_failures()
        followers.stop()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        # rank 0's own errors (a config or weights it cannot split) speak for themselves; a failed
        # collective is explained by the rank that left it
        if failed and isinstance(e, RuntimeError) and not isinstance(e, RankFailed):
            raise RankFailed(failed) from e
        raise
    import weakref

    weakref.finalize(runner, followers.stop)  # an engine never shut down still stops its ranks at exit
    return runner
