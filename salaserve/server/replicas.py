"""Engine replicas (--dp-size N): N engine processes, each an `EngineClient`, behind the one HTTP
front end. The server tokenizes once and hands each request group to one replica, chosen by
router.PrefixAffinityRouter; the routes see this pool as they saw a single engine client (add,
cancel, abort, flush, info, stats).

A replica whose engine process dies has its requests ended with an error (EngineClient), takes no
new ones, and is restarted (with the server's warm-up) up to `restart_attempts` times in a row;
if none succeeds it is reported as failed in /get_server_info and the others go on serving.
With no replica left serving the server stops (`on_fatal`), as a single engine's death does:
with --dp-size 1 there is nothing to serve meanwhile, so it is not restarted (restart_attempts 0).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from salaserve.config import EngineArgs
from salaserve.server.engine_client import EngineClient, EngineUnavailable
from salaserve.server.engine_worker import SPEC_ACCEPT_KEY
from salaserve.server.router import NoReplica, PrefixAffinityRouter

log = logging.getLogger("salaserve.server")

RESTART_ATTEMPTS = 3  # engine starts tried in a row for a replica that died, before it is given up

STARTING, SERVING, RESTARTING, FAILED = "starting", "serving", "restarting", "failed"
# engine facts that add up over replicas (the server's capacity)
CAPACITY_KEYS = ("max_total_num_tokens", "num_pages", "num_state_slots", "weight_bytes", "kv_cache_bytes",
                 "state_bytes")


def replica_devices(device: str, dp_size: int, cuda_count: int | None = None) -> list[str]:
    """The device of each replica: `device` itself for one; for several, replica i on cuda:i (device
    'cuda', or 'auto' with a GPU) or all on the CPU. Raises ValueError for a layout that cannot be
    served. cuda_count: visible GPUs (None: ask torch)."""
    if dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {dp_size}")
    if dp_size == 1:
        return [device]
    if device == "cpu":
        return ["cpu"] * dp_size
    if device not in ("auto", "cuda"):
        raise ValueError(f"--device {device} names one device; with --dp-size {dp_size} use --device cuda "
                         "(replica i on cuda:i), auto or cpu")
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto" and cuda_count == 0:
        return ["cpu"] * dp_size
    if dp_size > cuda_count:
        raise ValueError(f"--dp-size {dp_size}: one GPU per replica, but {cuda_count} GPU(s) are visible "
                         "(CUDA_VISIBLE_DEVICES)")
    return [f"cuda:{i}" for i in range(dp_size)]


def replica_engine_args(engine_args: EngineArgs, devices: list[str]) -> list[EngineArgs]:
    """Each replica's engine arguments: its device and, with several replicas, a step trace file of
    its own. The seed stays the same: it also draws --load-format dummy weights, which all replicas
    must share."""
    if len(devices) == 1:
        return [dataclasses.replace(engine_args, device=devices[0])]
    return [dataclasses.replace(engine_args, device=device,
                                step_trace=engine_args.step_trace and f"{engine_args.step_trace}.replica{i}")
            for i, device in enumerate(devices)]


def sum_stats(snapshots: list[dict]) -> dict:
    """Counters added up over replicas; the speculative accept length recomputed from the sums."""
    out: dict = {}
    for snap in snapshots:
        for key, value in snap.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            else:
                out.setdefault(key, value)
    if SPEC_ACCEPT_KEY in out:
        steps = out.get("engine_spec_verify_steps", 0)
        out[SPEC_ACCEPT_KEY] = (out.get("engine_spec_accepted_tokens", 0) + steps) / steps if steps else 0.0
    return out


@dataclass
class Replica:
    index: int
    engine_args: EngineArgs
    client: EngineClient
    status: str = STARTING
    info: dict = dataclasses.field(default_factory=dict)  # as its engine reported when it last started
    restarts: int = 0  # engine starts after a death
    last_error: str | None = None  # why it last died, or why its restart failed

    def report(self, routed: int) -> dict:
        return {"index": self.index, "device": self.info.get("device", self.engine_args.device),
                "status": self.status, "pid": self.client.pid, "restarts": self.restarts,
                "last_error": self.last_error, "routed_requests": routed, "in_flight": self.client.in_flight,
                "stats": dict(self.client.stats)}


class EngineReplicas:
    def __init__(self, replica_args: list[EngineArgs], on_fatal: Callable[[str], None] | None = None,
                 warm_up: Callable[[int], Awaitable[None]] | None = None, restart_attempts: int = 0):
        """replica_args: one EngineArgs per replica (its device set); on_fatal: called once no
        replica is left; warm_up(index): run on a restarted replica before it takes requests."""
        self.on_fatal = on_fatal
        self.warm_up = warm_up
        self.restart_attempts = restart_attempts
        self.closing = False
        self.replicas = [Replica(i, args, None) for i, args in enumerate(replica_args)]
        for r in self.replicas:
            r.client = self._new_client(r)
        first = replica_args[0]
        affinity = first.prefix_cache_slots > 0 and len(replica_args) > 1  # (no prompt hashing for one replica)
        self.router = PrefixAffinityRouter(
            len(replica_args), min_match_tokens=first.prefix_cache_min_tokens if affinity else 0,
            # "much busier": a quarter of a replica's running slots more in flight than the least loaded
            slack=max(2, first.max_running_requests // 4))
        self._restarts: set[asyncio.Task] = set()

    def _new_client(self, replica: Replica) -> EngineClient:
        client = EngineClient(replica.engine_args, cpu_engines=len(self.replicas))
        client.on_death = functools.partial(self._on_death, replica, client)
        return client

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> dict:
        """Start every replica's engine at once; their facts (replica 0's). Raises
        EngineUnavailable if any fails (the others are stopped)."""
        results = await asyncio.gather(*(r.client.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            for r, result in zip(self.replicas, results):
                r.status, r.last_error = FAILED, str(result) if isinstance(result, BaseException) else None
            await asyncio.get_running_loop().run_in_executor(None, self.close)
            raise errors[0]
        for r, info in zip(self.replicas, results):
            r.info, r.status = info, SERVING
        return self.info

    def close(self) -> None:
        """Stop every engine (blocking). With restarts possible, use aclose."""
        self.closing = True
        for r in self.replicas:
            r.client.close()

    async def aclose(self) -> None:
        """Stop restarts first, so that no engine starts after the others stopped, then every engine."""
        self.closing = True
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def _on_death(self, replica: Replica, client: EngineClient, message: str) -> None:
        """A replica's engine process died (its requests already ended with an error)."""
        if self.closing or replica.client is not client or replica.status != SERVING:
            return  # (dying while it restarts: its restart attempt sees that)
        replica.last_error = message
        if self.restart_attempts > 0:
            replica.status = RESTARTING
            task = asyncio.get_running_loop().create_task(self._restart(replica))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)
        else:
            replica.status = FAILED
            self._stop_if_none_left()

    async def _restart(self, replica: Replica) -> None:
        replica.client.close()  # its process has exited: this only ends its sender thread
        for attempt in range(1, self.restart_attempts + 1):
            if self.closing:
                return
            log.warning("dp replica %d died (%s); restarting its engine on %s (attempt %d of %d)", replica.index,
                        replica.last_error, replica.engine_args.device, attempt, self.restart_attempts)
            replica.restarts += 1
            client = replica.client = self._new_client(replica)
            try:
                replica.info = await client.start()
                if self.warm_up is not None:
                    await self.warm_up(replica.index)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                replica.last_error = f"restart failed: {e}"
                log.error("dp replica %d: %s", replica.index, replica.last_error)
                await asyncio.get_running_loop().run_in_executor(None, client.close)
                continue
            if client.dead:  # died during its warm-up
                continue
            replica.status = SERVING
            log.info("dp replica %d serving again (pid %s)", replica.index, client.pid)
            return
        replica.status = FAILED
        log.error("dp replica %d: gave up after %d restart attempts; %d of %d replicas serving", replica.index,
                  self.restart_attempts, self.num_serving, len(self.replicas))
        self._stop_if_none_left()

    def _stop_if_none_left(self) -> None:
        if all(r.status == FAILED for r in self.replicas) and self.on_fatal is not None:
            self.on_fatal(self.dead)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def num_serving(self) -> int:
        return sum(r.status == SERVING for r in self.replicas)

    @property
    def dead(self) -> str | None:
        """Why no replica can take requests, or None while one can (or all are starting)."""
        if any(r.status in (STARTING, SERVING) for r in self.replicas):
            return None
        if len(self.replicas) == 1:
            return self.replicas[0].last_error or "the engine is not running"
        if any(r.status == RESTARTING for r in self.replicas):
            return "no engine replica is serving (restarting)"
        return "no engine replica is left: " + "; ".join(f"replica {r.index}: {r.last_error}" for r in self.replicas)

    @property
    def info(self) -> dict:
        """The engine's facts (limits, model), as one replica reports them."""
        return self.replicas[0].info

    def capacity(self) -> dict:
        """Pages, slots and bytes added up over the serving replicas."""
        live = [r.info for r in self.replicas if r.status == SERVING]
        return {key: sum(info.get(key, 0) for info in live) for key in CAPACITY_KEYS}

    @property
    def stats(self) -> dict:
        """The engines' latest counters, added up over the serving replicas."""
        if len(self.replicas) == 1:
            return self.replicas[0].client.stats
        return sum_stats([r.client.stats for r in self.replicas if r.status == SERVING])

    def gen_throughput(self) -> float:
        return sum(r.client.throughput.value() for r in self.replicas if r.status == SERVING)

    def report(self) -> list[dict]:
        """Per replica: device, status, pid, restarts, routing counts, its engine's counters."""
        return [r.report(self.router.routed[r.index]) for r in self.replicas]

    # ---- requests ------------------------------------------------------------------------------
    def route(self, prompt_ids: list[int]) -> int:
        """The serving replica for a request group whose first prompt is `prompt_ids`."""
        loads = [r.client.in_flight if r.status == SERVING else None for r in self.replicas]
        try:
            return self.router.choose(prompt_ids, loads)
        except NoReplica:
            raise EngineUnavailable(self.dead or "no engine replica is serving") from None

    async def add(self, rid: str, prompt_ids: list[int], params, priority: int, inbox: asyncio.Queue,
                  tag: object, share_rank: int = 0, owner: str | None = None, replica: int = 0) -> None:
        """EngineClient.add on `replica` (from route); a rid running on any replica is refused."""
        if any(r.client.is_active(rid) for r in self.replicas):
            raise ValueError(f"rid: a request with id {rid!r} is already running")
        await self.replicas[replica].client.add(rid, prompt_ids, params, priority, inbox, tag,
                                                share_rank=share_rank, owner=owner)

    def cancel(self, rid: str) -> None:
        for r in self.replicas:  # only the one that runs it knows it
            r.client.cancel(rid)

    def abort(self, rid: str, owner: str | None) -> bool:
        return any([r.client.abort(rid, owner) for r in self.replicas])

    def abort_all(self) -> None:
        for r in self.replicas:
            r.client.abort_all()

    def is_active(self, rid: str) -> bool:
        return any(r.client.is_active(rid) for r in self.replicas)

    async def flush_cache(self) -> bool:
        """Every serving replica's prefix cache; True only if all flushed (each refuses while busy)."""
        live = [r.client for r in self.replicas if r.status == SERVING]
        if not live:
            raise EngineUnavailable(self.dead or "no engine replica is serving")
        return all(await asyncio.gather(*(c.flush_cache() for c in live)))
