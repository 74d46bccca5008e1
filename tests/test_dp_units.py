"""--dp-size without processes: the router's rule (load, prefix affinity, dead replicas), where
replicas go, how counters add up, and a replica that dies and cannot be restarted (reported, the
others serving, the server stopped only when none is left)."""

import asyncio

import pytest

from salaserve.config import EngineArgs
from salaserve.server import replicas as rp
from salaserve.server.engine_client import EngineUnavailable
from salaserve.server.router import NoReplica, PrefixAffinityRouter


def router(n=2, min_match=256, slack=4):
    return PrefixAffinityRouter(n, min_match_tokens=min_match, slack=slack)


def long_prompt(seed: int, length: int = 400) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(length)]


def test_least_loaded_wins_and_ties_spread():
    r = router()
    assert r.choose([1, 2, 3], [3, 1]) == 1
    r = router()
    # equal loads: the replica that got fewer requests so far (sequential traffic alternates)
    picks = [r.choose([1, 2, 3], [0, 0]) for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1] and picks[0] != picks[1]


def test_long_shared_prefix_follows_its_replica_unless_much_busier():
    r = router(slack=4)
    doc = long_prompt(1)
    first = r.choose(doc + [7], [0, 0])
    # same document, another question: its replica, though the other is as idle and got fewer requests
    assert r.choose(doc + [8, 9], [0, 0]) == first
    assert r.choose(doc + [10], [4, 0] if first == 0 else [0, 4]) == first  # busier by the slack: still
    other = 1 - first
    busy = [0, 0]
    busy[first] = 5  # busier by more than the slack: the least loaded one, which now owns the prefix
    assert r.choose(doc + [11], busy) == other
    assert r.choose(doc + [12], [0, 0]) == other
    assert r.affinity_hits == 3


def test_short_or_unrelated_prompts_have_no_affinity():
    r = router(min_match=256)
    short = list(range(10, 200))  # shorter than the prefix cache keeps: load decides
    a = r.choose(short, [0, 0])
    assert r.choose(short, [0, 0]) != a
    b = r.choose(long_prompt(2), [0, 0])
    assert r.choose(long_prompt(3), [0, 0]) != b  # no common prefix
    assert r.affinity_hits == 0
    off = router(min_match=0)  # no prefix cache (--disable-radix-cache): no affinity either
    c = off.choose(long_prompt(4), [0, 0])
    assert off.choose(long_prompt(4), [0, 0]) != c


def test_dead_replicas_get_nothing():
    r = router(n=3)
    doc = long_prompt(5)
    assert r.choose(doc, [0, None, 9]) == 0
    assert r.choose(doc, [None, 0, 9]) == 1  # its prefix's replica is down: the least loaded live one
    with pytest.raises(NoReplica):
        r.choose(doc, [None, None, None])


def test_affinity_memory_is_bounded():
    r = PrefixAffinityRouter(2, min_match_tokens=64, slack=0, lru_entries=16)
    for seed in range(20):
        r.choose(long_prompt(seed), [0, 0])
    assert len(r._owner) == 16


def test_replica_devices():
    assert rp.replica_devices("auto", 1) == ["auto"]
    assert rp.replica_devices("cpu", 3) == ["cpu"] * 3
    assert rp.replica_devices("auto", 2, cuda_count=0) == ["cpu", "cpu"]
    assert rp.replica_devices("cuda", 2, cuda_count=4) == ["cuda:0", "cuda:1"]
    assert rp.replica_devices("auto", 4, cuda_count=4) == [f"cuda:{i}" for i in range(4)]
    with pytest.raises(ValueError, match="1 GPU"):
        rp.replica_devices("cuda", 2, cuda_count=1)
    with pytest.raises(ValueError, match="names one device"):
        rp.replica_devices("cuda:1", 2, cuda_count=4)


def test_replica_engine_args():
    args = EngineArgs(device="auto", step_trace="/tmp/trace.jsonl", seed=3)
    one, = rp.replica_engine_args(args, ["auto"])
    assert one == args
    a, b = rp.replica_engine_args(args, ["cuda:0", "cuda:1"])
    assert (a.device, b.device) == ("cuda:0", "cuda:1") and a.seed == b.seed == 3
    assert (a.step_trace, b.step_trace) == ("/tmp/trace.jsonl.replica0", "/tmp/trace.jsonl.replica1")
    assert rp.replica_engine_args(EngineArgs(), ["cpu", "cpu"])[1].step_trace is None


def test_counters_add_up_and_accept_length_is_recomputed():
    a = {"num_running_reqs": 2, "pages_used": 10, "engine_spec_verify_steps": 4, "engine_spec_accepted_tokens": 6,
         "avg_spec_accept_length": 2.5, "note": "x"}
    b = {"num_running_reqs": 1, "pages_used": 5, "engine_spec_verify_steps": 1, "engine_spec_accepted_tokens": 4,
         "avg_spec_accept_length": 5.0}
    total = rp.sum_stats([a, b])
    assert total["num_running_reqs"] == 3 and total["pages_used"] == 15 and total["note"] == "x"
    assert total["avg_spec_accept_length"] == (10 + 5) / 5


class FakeClient:
    """An EngineClient whose engine 'starts' as told and 'dies' on request."""

    start_fails = False
    start_hangs = False
    pids = iter(range(1000, 2000))

    def __init__(self, engine_args, cpu_engines=1):
        self.engine_args, self.on_death = engine_args, None
        self.info, self.stats, self.dead, self.pid, self.in_flight = {}, {}, None, None, 0
        self.closed = False

    async def start(self):
        if FakeClient.start_fails:
            raise EngineUnavailable("the engine failed to start: no GPU memory")
        if FakeClient.start_hangs:
            await asyncio.Event().wait()
        self.pid = next(self.pids)
        self.info = {"device": self.engine_args.device, "num_pages": 10}
        return self.info

    def die(self):
        self.dead = "the engine process exited unexpectedly (code -9)"
        self.on_death(self.dead)

    def close(self):
        self.closed = True

    def is_active(self, rid):
        return False


def test_a_replica_that_cannot_restart_is_reported_and_the_others_serve(monkeypatch):
    monkeypatch.setattr(rp, "EngineClient", FakeClient)
    fatal, warmed = [], []

    async def warm_up(index):
        warmed.append(index)

    async def scenario():
        pool = rp.EngineReplicas([EngineArgs(device="cpu"), EngineArgs(device="cpu")], on_fatal=fatal.append,
                                 warm_up=warm_up, restart_attempts=2)
        await pool.start()
        assert pool.capacity()["num_pages"] == 20
        # replica 0 dies and restarts: warmed up before it takes requests again
        pool.replicas[0].client.die()
        assert pool.replicas[0].status == rp.RESTARTING and pool.route([1]) == 1
        await asyncio.gather(*pool._restarts)
        assert pool.replicas[0].status == rp.SERVING and pool.replicas[0].restarts == 1 and warmed == [0]
        # it dies again and no start succeeds: given up after 2 attempts, reported, 1 keeps serving
        FakeClient.start_fails = True
        pool.replicas[0].client.die()
        await asyncio.gather(*pool._restarts)
        r0 = pool.report()[0]
        assert r0["status"] == "failed" and r0["restarts"] == 3 and "no GPU memory" in r0["last_error"]
        assert pool.dead is None and not fatal and pool.capacity()["num_pages"] == 10
        assert {pool.route(long_prompt(s)) for s in range(5)} == {1}
        # the last one dies: no replica left, the server stops
        pool.replicas[1].client.die()
        await asyncio.gather(*pool._restarts)
        assert fatal and "no engine replica is left" in fatal[0]
        with pytest.raises(EngineUnavailable):
            pool.route([1])

    try:
        asyncio.run(scenario())
    finally:
        FakeClient.start_fails = False


def test_one_replica_is_not_restarted(monkeypatch):
    """--dp-size 1: nothing would serve meanwhile, so the server stops (its supervisor restarts it)."""
    monkeypatch.setattr(rp, "EngineClient", FakeClient)
    fatal = []

    async def scenario():
        pool = rp.EngineReplicas([EngineArgs(device="cpu")], on_fatal=fatal.append)
        await pool.start()
        pool.replicas[0].client.die()
        assert not pool._restarts and pool.replicas[0].status == rp.FAILED

    asyncio.run(scenario())
    assert fatal == ["the engine process exited unexpectedly (code -9)"]


def test_shutdown_stops_a_restart_in_progress(monkeypatch):
    """No engine may start after the server stopped the others."""
    monkeypatch.setattr(rp, "EngineClient", FakeClient)

    async def scenario():
        pool = rp.EngineReplicas([EngineArgs(device="cpu"), EngineArgs(device="cpu")], restart_attempts=3)
        await pool.start()
        pool.replicas[0].client.die()
        FakeClient.start_hangs = True
        await asyncio.sleep(0)  # the restart is now waiting for its engine
        starting = pool.replicas[0].client
        await pool.aclose()
        assert not pool._restarts and starting.closed and pool.replicas[1].client.closed
        assert pool.replicas[0].client is starting and pool.replicas[0].restarts == 1

    try:
        asyncio.run(scenario())
    finally:
        FakeClient.start_hangs = False
