"""The server's handle on the engine process.

The engine runs in its own process ('spawn'), so model work never competes with the event loop
for the GIL. Two daemon threads move messages: one sends (a pipe write can block while the engine
is busy stepping), one receives and hands each `Update` to the event loop. Every engine request
is routed to an asyncio queue owned by its HTTP handler; one queue may serve several requests
(a batch, `n` siblings), each under its own tag. Each route also records which client started the
request (an opaque owner string), so that /abort_request stops only the caller's own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from salaserve.config import EngineArgs
from salaserve.core.request import StepOutput
from salaserve.server import engine_worker as w

log = logging.getLogger("salaserve.server")

THROUGHPUT_WINDOW_S = 5.0


class EngineUnavailable(RuntimeError):
    """The engine process is not running (failed to start or died)."""


@dataclass
class Route:
    """Where a running request's outputs go, and who started it."""

    inbox: asyncio.Queue
    tag: object
    owner: str | None


class ThroughputMeter:
    """Generated tokens per second over the last few seconds, from the engine's counter."""

    def __init__(self, window: float = THROUGHPUT_WINDOW_S):
        self.window = window
        self.points: deque[tuple[float, int]] = deque()

    def record(self, generated_total: int) -> None:
        now = time.monotonic()
        self.points.append((now, generated_total))
        while len(self.points) > 2 and now - self.points[1][0] > self.window:
            self.points.popleft()

    def value(self) -> float:
        if len(self.points) < 2 or time.monotonic() - self.points[-1][0] > self.window:
            return 0.0
        (t0, g0), (t1, g1) = self.points[0], self.points[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0


class EngineClient:
    def __init__(self, engine_args: EngineArgs, on_death: Callable[[str], None] | None = None, cpu_engines: int = 1):
        """cpu_engines: engine processes sharing this machine's cores (--dp-size on the CPU)."""
        self.engine_args = engine_args
        self.on_death = on_death
        self.cpu_engines = cpu_engines
        self.info: dict = {}  # static facts sent by the engine once it is up
        self.stats: dict = {}  # the latest counters (one snapshot per engine step)
        self.throughput = ThroughputMeter()
        self.dead: str | None = None
        self.closing = False
        self.process = None
        self._routes: dict[str, Route] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._close_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Spawn the engine and wait until its model is loaded. Raises EngineUnavailable."""
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        to_engine_r, to_engine_w = ctx.Pipe(duplex=False)
        from_engine_r, from_engine_w = ctx.Pipe(duplex=False)
        # Not daemonic: the engine may start helper processes of its own (compilers).
        self.process = ctx.Process(target=w.main, args=(self.engine_args, to_engine_r, from_engine_w, self.cpu_engines),
                                   name="salaserve-engine")
        self.process.start()
        # Keep only our ends, so each side sees EOF when the other goes away.
        to_engine_r.close()
        from_engine_w.close()
        self._send_conn, self._recv_conn = to_engine_w, from_engine_r
        first = await self._loop.run_in_executor(None, self._receive_first)
        if first[0] != w.READY:
            self.dead = first[1]
            self.process.join(timeout=10)
            raise EngineUnavailable(f"the engine failed to start: {first[1]}")
        self.info = first[1]
        self.stats = {"num_running_reqs": 0, "num_queue_reqs": 0, **self.info["initial_counters"]}
        threading.Thread(target=self._send_loop, name="engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="engine-receive", daemon=True).start()
        return self.info

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def in_flight(self) -> int:
        """Requests sent to the engine and not finished: its running + queued, known without
        waiting for its next step's counters."""
        return len(self._routes)

    def _receive_first(self) -> tuple:
        process = self.process  # (close() may drop it meanwhile)
        try:
            return self._recv_conn.recv()
        except (EOFError, OSError):
            process.join(timeout=10)
            return (w.FAILED, f"the engine process exited (code {process.exitcode}) before it was ready")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process; safe to call again, from any thread (a replica being
        restarted may be closed by its restart and by the server's shutdown at once)."""
        with self._close_lock:
            if self.process is None:
                return
            self.closing = True
            if self.info:  # up and listening: ask it to stop
                self._outgoing.put((w.SHUTDOWN,))
                self._outgoing.put(None)  # stops the sender thread after the shutdown message
                self.process.join(timeout)
                if self.process.is_alive():
                    log.warning("engine process did not stop in %.0f s; terminating it", timeout)
            elif self.process.is_alive():  # still loading the model: it reads no messages yet
                log.info("stopping the engine process before it finished starting")
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join()
            self.process = None

    # ---- threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (msg := self._outgoing.get()) is not None:
            try:
                self._send_conn.send(msg)
            except OSError:  # the engine is gone; the receiver reports it
                return

    def _receive_loop(self) -> None:
        while True:
            try:
                msg = self._recv_conn.recv()
            except (EOFError, OSError):
                self._call_soon(self._on_engine_exit)
                return
            self._call_soon(self._dispatch, msg)

    def _call_soon(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    # ---- on the event loop -------------------------------------------------------------------
    def _dispatch(self, msg: tuple) -> None:
        if msg[0] != w.UPDATE:
            log.error("unexpected message from the engine: %r", msg[0])
            return
        update: w.Update = msg[1]
        for rid, error in update.acks:
            fut = self._acks.pop(rid, None)
            if error is not None:
                self._routes.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(error)
        for out in update.outputs:
            route = self._routes.get(out.rid)
            if route is None:  # its handler gave up (cancelled); nothing waits for it
                continue
            route.inbox.put_nowait((route.tag, out))
            if out.finished:
                del self._routes[out.rid]
        for token, value in update.replies:
            fut = self._replies.pop(token, None)
            if fut is not None and not fut.done():
                fut.set_result(value)
        if update.stats:
            self.stats = update.stats
            self.throughput.record(update.stats.get("engine_generated_tokens", 0))

    def _on_engine_exit(self) -> None:
        if self.closing or self.process is None or self.dead:  # a clean shutdown, or handled
            return
        self.process.join(timeout=1)
        code = self.process.exitcode
        self.dead = f"the engine process exited unexpectedly (code {code})"
        log.error("%s", self.dead)
        reason = w.error_reason(self.dead)
        for rid, route in self._routes.items():
            route.inbox.put_nowait((route.tag, StepOutput(rid=rid, new_token_ids=[], finished=True, finish_reason=reason,
                                              num_prompt=0, num_output=0)))
        self._routes.clear()
        for fut in [*self._acks.values(), *self._replies.values()]:
            if not fut.done():
                fut.set_exception(EngineUnavailable(self.dead))
        self._acks.clear()
        self._replies.clear()
        if self.on_death is not None:
            self.on_death(self.dead)

    # ---- requests ----------------------------------------------------------------------------------
    async def add(self, rid: str, prompt_ids: list[int], params, priority: int, inbox: asyncio.Queue,
                  tag: object, share_rank: int = 0, owner: str | None = None) -> None:
        """Queue a request in the engine; its outputs go to `inbox` as (tag, StepOutput).
        share_rank: its position within the client's request (Request.share_rank); owner: who may
        abort it (None: only the admin). Raises ValueError when the engine rejects it (the message
        names the field)."""
        if self.dead:
            raise EngineUnavailable(self.dead)
        if rid in self._routes:
            raise ValueError(f"rid: a request with id {rid!r} is already running")
        fut = self._loop.create_future()
        self._acks[rid] = fut
        self._routes[rid] = Route(inbox, tag, owner)
        self._outgoing.put((w.ADD, rid, prompt_ids, params, priority, share_rank))
        try:
            error = await fut
        except asyncio.CancelledError:
            self.cancel(rid)
            raise
        if error is not None:
            raise ValueError(error)

    def cancel(self, rid: str) -> None:
        """The handler gives up on `rid` (client gone, stop string, error): stop routing its
        outputs and have the engine free its pages and slot."""
        self._acks.pop(rid, None)
        if self._routes.pop(rid, None) is not None and not self.dead:
            self._outgoing.put((w.ABORT, rid))

    def abort(self, rid: str, owner: str | None) -> bool:
        """/abort_request: the engine ends `rid` if `owner` started it (owner None: whoever did,
        for the admin); its handler sees finish reason `abort`. False if there was none to end."""
        route = self._routes.get(rid)
        if route is None or (owner is not None and route.owner != owner):
            return False
        if not self.dead:
            self._outgoing.put((w.ABORT, rid))
        return True

    def abort_all(self) -> None:
        """/abort_request with abort_all (admin only): the engine ends every request."""
        if not self.dead:
            self._outgoing.put((w.ABORT_ALL,))

    def is_active(self, rid: str) -> bool:
        return rid in self._routes

    async def flush_cache(self) -> bool:
        if self.dead:
            raise EngineUnavailable(self.dead)
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._replies[token] = fut
        self._outgoing.put((w.FLUSH, token))
        return bool(await fut)
