"""The engine process loop (EngineWorker), run in-process over real pipes: acks and rejections,
aborts, flush, a step that raises (its requests end with an error, the loop keeps serving), and
exit when the server goes away."""

import multiprocessing

import pytest

from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.server import engine_worker as w


@pytest.fixture
def worker(tiny_model_dir):
    engine = Engine(model=tiny_model_dir, device="cpu", dtype="float32", backend="torch", max_total_tokens=1024)
    inbox_r, inbox_w = multiprocessing.Pipe(duplex=False)
    outbox_r, outbox_w = multiprocessing.Pipe(duplex=False)
    worker = w.EngineWorker(engine, inbox_r, outbox_w)
    yield worker, inbox_w, outbox_r
    for c in (inbox_r, inbox_w, outbox_r, outbox_w):
        c.close()


def drain(worker, outbox, turns=200) -> list:
    """Run the loop until the engine is idle; every Update it sent."""
    updates = []
    for _ in range(turns):
        if not worker.engine.has_unfinished() and not worker.inbox.poll(0):
            break
        assert worker.run_once()
        while outbox.poll(0):
            kind, update = outbox.recv()
            assert kind == w.UPDATE
            updates.append(update)
    return updates


def greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def test_acks_outputs_and_rejections(worker):
    worker, inbox, outbox = worker
    inbox.send((w.ADD, "good", [1, 5, 6], greedy(4), 0, 0))
    inbox.send((w.ADD, "too-long", [1] * 2000, greedy(4), 0, 0))  # more than the 1024-token KV cache
    inbox.send((w.ADD, "bad-id", [1, 10**7], greedy(4), 0, 0))
    updates = drain(worker, outbox)
    acks = dict(a for u in updates for a in u.acks)
    assert acks["good"] is None
    assert "KV cache" in acks["too-long"] and "vocabulary" in acks["bad-id"]
    outs = [o for u in updates for o in u.outputs]
    assert sum(len(o.new_token_ids) for o in outs if o.rid == "good") == 4
    assert outs[-1].finish_reason == {"type": "length", "length": 4}
    stats = updates[-1].stats
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["num_running_reqs"] == 0


def test_abort_and_flush(worker):
    worker, inbox, outbox = worker
    inbox.send((w.ADD, "long", [1, 5, 6], greedy(500), 0, 0))
    assert worker.run_once()
    inbox.send((w.FLUSH, 7))  # busy: not flushed
    inbox.send((w.ABORT, "long"))
    inbox.send((w.ABORT, "unknown"))
    updates = drain(worker, outbox)
    assert [r for u in updates for r in u.replies] == [(7, False)]
    aborted = [o for u in updates for o in u.outputs if o.finished]
    assert [(o.rid, o.finish_reason) for o in aborted] == [("long", {"type": "abort"})]
    inbox.send((w.FLUSH, 8))
    updates = drain(worker, outbox)
    assert [r for u in updates for r in u.replies] == [(8, True)]
    assert worker.stats()["pages_used"] == 0


def test_step_error_aborts_running_requests_and_keeps_serving(worker):
    worker, inbox, outbox = worker
    engine = worker.engine
    forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(work, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return forward(work, **kw)

    engine.runner.forward = flaky
    inbox.send((w.ADD, "a", [1, 5, 6], greedy(20), 0, 0))
    inbox.send((w.ADD, "b", [1, 7], greedy(20), 0, 0))
    updates = drain(worker, outbox)
    ends = {o.rid: o.finish_reason for u in updates for o in u.outputs if o.finished}
    assert set(ends) == {"a", "b"}
    for reason in ends.values():
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert "simulated kernel failure" in reason["message"]
    assert worker.stats()["pages_used"] == 0 and worker.stats()["slots_used"] == 0
    # the loop goes on: a new request completes normally
    inbox.send((w.ADD, "c", [1, 8], greedy(3), 0, 0))
    updates = drain(worker, outbox)
    assert [o.finish_reason for u in updates for o in u.outputs if o.finished] == [{"type": "length", "length": 3}]


def test_shutdown_and_server_gone(worker):
    worker, inbox, outbox = worker
    inbox.send((w.SHUTDOWN,))
    assert worker.run_once() is False
    inbox.close()  # the server is gone: serve_forever returns instead of blocking
    worker.serve_forever()


def test_speculation_accept_length_is_reported_as_sglang_names_it(worker):
    worker, _, _ = worker
    assert "avg_spec_accept_length" not in worker.stats()
    # what a speculating engine counts: 4 verify steps that accepted 6 draft tokens in all
    worker.engine.stats["spec_verify_steps"] = 4
    worker.engine.stats["spec_accepted_tokens"] = 6
    stats = worker.stats()
    assert stats["avg_spec_accept_length"] == 2.5 and "engine_avg_spec_accept_length" not in stats
    worker.engine.stats["spec_verify_steps"] = worker.engine.stats["spec_accepted_tokens"] = 0
