"""`salaserve serve --dp-size 2` on the tiny checkpoint (two CPU engine processes behind one HTTP
server): requests spread over both replicas, long shared prefixes stay on one, counters add up,
/flush_cache and /abort_request reach every replica (ownership still holds), greedy outputs equal
a single engine's, and a replica whose process is killed fails only its own requests and comes back.
"""

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_utils import run_server, tiny_server_args

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
DEADLINE_S = 60


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    args = tiny_server_args(tiny_model_dir, "--dp-size", "2", "--enable-metrics", "--api-key", "user-key",
                            "--admin-api-key", "admin-key")
    with run_server(args, str(tmp_path_factory.mktemp("dp-logs"))) as server:
        yield server


def server_info(server) -> dict:
    return httpx.get(server.url + "/get_server_info", headers=USER, timeout=10).json()


def routed(server) -> list[int]:
    return [r["routed_requests"] for r in server_info(server)["dp_replicas"]]


def generate(server, body: dict, headers=USER) -> dict:
    r = httpx.post(server.url + "/generate", json=body, headers=headers, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(max_new_tokens: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def events(lines) -> "iter[dict | str]":
    """The SSE data events of a /generate stream: dicts, then 'DONE'."""
    for line in lines:
        if line.startswith("data: "):
            yield "DONE" if line == "data: [DONE]" else json.loads(line[6:])


def open_stream(client: httpx.Client, body: dict, headers=USER):
    """Starts a streaming /generate and returns (response, its event iterator) once the first
    event with text has arrived, i.e. the request is running in its replica."""
    resp = client.send(client.build_request("POST", "/generate", json={**body, "stream": True}, headers=headers),
                       stream=True)
    assert resp.status_code == 200
    it = events(resp.iter_lines())
    first = next(it)
    assert isinstance(first, dict) and first.get("text"), first
    return resp, it


def wait_for(predicate, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"not {what} after {timeout} s")


def test_requests_spread_over_both_replicas_and_counters_add_up(dp_server):
    before = routed(dp_server)
    prompts = [f"Request number {i} asks about" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: generate(dp_server, {"text": p, "sampling_params": greedy(8)}), prompts))
    assert all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
    info = server_info(dp_server)
    reps = info["dp_replicas"]
    assert info["dp_size"] == 2 and [r["status"] for r in reps] == ["serving", "serving"]
    assert len({r["pid"] for r in reps}) == 2
    assert sum(r["routed_requests"] for r in reps) - sum(before) == 6
    assert all(r["routed_requests"] > b for r, b in zip(reps, before))  # both got some
    assert all(r["stats"]["engine_finished"] >= 1 for r in reps)
    total = info["internal_states"][0]
    for key in ("engine_finished", "engine_generated_tokens", "pages_free", "slots_free"):
        assert total[key] == sum(r["stats"][key] for r in reps)
    assert total["num_running_reqs"] == 0 and total["pages_used"] == 0
    assert total["memory_usage"]["token_capacity"] == 2 * info["max_total_num_tokens"]
    metrics = httpx.get(dp_server.url + "/metrics", headers=USER, timeout=10).text
    assert f'sglang:max_total_num_tokens{{model_name="{info["served_model_name"] or info["model_path"]}"}} ' \
           f'{float(2 * info["max_total_num_tokens"])}' in metrics
    assert "sglang:num_requests_total" in metrics


def test_long_shared_prefix_stays_on_one_replica_and_flush_reaches_both(dp_server):
    doc = [1] + [(i * 37) % 4000 + 20 for i in range(320)]  # longer than --prefix-cache-min-tokens (256)
    before = routed(dp_server)
    hits = server_info(dp_server)["dp_affinity_hits"]
    outs = [generate(dp_server, {"input_ids": doc + [100 + q, 200 + q], "sampling_params": greedy(2)})
            for q in range(4)]
    gained = [a - b for a, b in zip(routed(dp_server), before)]
    assert sorted(gained) == [0, 4]  # all four on one replica (load alone would alternate)
    assert server_info(dp_server)["dp_affinity_hits"] - hits == 3
    assert max(o["meta_info"]["cached_tokens"] for o in outs) >= 256  # and its prefix cache served them
    cached = [r["stats"]["prefix_cache_entries"] for r in server_info(dp_server)["dp_replicas"]]
    assert max(cached) > 0
    r = httpx.post(dp_server.url + "/flush_cache", headers=USER, timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert [r["stats"]["prefix_cache_entries"] for r in server_info(dp_server)["dp_replicas"]] == [0, 0]


def test_greedy_outputs_equal_a_single_engine(dp_server, tiny_server):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    body = {"text": prompts, "sampling_params": greedy(12)}
    single = httpx.post(tiny_server.url + "/generate", json=body, timeout=DEADLINE_S).json()
    before = routed(dp_server)
    with ThreadPoolExecutor(4) as pool:  # one request each, so that both replicas answer some
        dp = list(pool.map(lambda p: generate(dp_server, {"text": p, "sampling_params": greedy(12)}), prompts))
    assert all(a > b for a, b in zip(routed(dp_server), before))
    assert [o["output_ids"] for o in dp] == [o["output_ids"] for o in single]
    assert [o["text"] for o in dp] == [o["text"] for o in single]


def test_abort_reaches_the_replica_that_runs_the_request_and_only_its_owner_may(dp_server):
    long = greedy(1000)
    with httpx.Client(base_url=dp_server.url, timeout=DEADLINE_S) as client:
        user_resp, user_events = open_stream(client, {"text": "user", "rid": "dp-user", "sampling_params": long})
        admin_resp, admin_events = open_stream(client, {"text": "admin", "rid": "dp-admin", "sampling_params": long},
                                               headers=ADMIN)
        try:
            assert [r["in_flight"] for r in server_info(dp_server)["dp_replicas"]] == [1, 1]  # one on each
            # the user cannot end the admin's request: 200, no effect
            assert client.post("/abort_request", json={"rid": "dp-admin"}, headers=USER).status_code == 200
            assert client.post("/abort_request", json={"rid": "dp-user"}, headers=USER).status_code == 200
            user_last = [e for e in user_events if e != "DONE"][-1]
            assert user_last["meta_info"]["finish_reason"]["type"] == "abort"
            for _ in range(3):  # the admin's request goes on
                event = next(admin_events)
                assert event["meta_info"]["finish_reason"] is None
            assert client.post("/abort_request", json={"rid": "dp-admin"}, headers=ADMIN).status_code == 200
            admin_last = [e for e in admin_events if e != "DONE"][-1]
            assert admin_last["meta_info"]["finish_reason"]["type"] == "abort"
            assert admin_last["meta_info"]["completion_tokens"] < 1000
        finally:
            user_resp.close()
            admin_resp.close()
    wait_for(lambda: server_info(dp_server)["internal_states"][0]["num_running_reqs"] == 0, "idle")


def test_a_killed_replica_fails_only_its_requests_and_is_restarted(dp_server):
    body = {"sampling_params": greedy(300)}
    with httpx.Client(base_url=dp_server.url, timeout=DEADLINE_S) as client:
        streams = [open_stream(client, {**body, "text": text}) for text in ("first stream", "second stream")]
        reps = server_info(dp_server)["dp_replicas"]
        assert [r["in_flight"] for r in reps] == [1, 1]
        victim_pid = reps[0]["pid"]
        os.kill(victim_pid, signal.SIGKILL)
        ends = []
        for resp, it in streams:
            rest = list(it)
            resp.close()
            assert rest[-1] == "DONE"
            ends.append(rest[:-1][-1])
    errors = [e for e in ends if "error" in e]
    finished = [e for e in ends if "meta_info" in e]
    assert len(errors) == 1 and "exited unexpectedly" in errors[0]["error"]["message"]
    assert len(finished) == 1 and finished[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert httpx.get(dp_server.url + "/health", timeout=10).status_code == 200  # the other one serves

    # while it restarts, new requests go to the other replica
    info = server_info(dp_server)
    if info["dp_replicas"][0]["status"] == "restarting":
        generate(dp_server, {"text": "meanwhile", "sampling_params": greedy(2)})
        after = server_info(dp_server)["dp_replicas"]
        if after[0]["status"] == "restarting":
            assert after[0]["routed_requests"] == info["dp_replicas"][0]["routed_requests"]
            assert after[1]["routed_requests"] == info["dp_replicas"][1]["routed_requests"] + 1

    back = wait_for(lambda: (r := server_info(dp_server)["dp_replicas"][0])["status"] == "serving" and r,
                    "restarted")
    assert back["restarts"] == 1 and back["pid"] != victim_pid and "exited unexpectedly" in back["last_error"]
    assert "dp replica 0 died" in dp_server.log() and "dp replica 0 serving again" in dp_server.log()
    before = routed(dp_server)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: generate(dp_server, {"text": f"after {i}", "sampling_params": greedy(4)}),
                             range(4)))
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in outs)
    assert all(a > b for a, b in zip(routed(dp_server), before))  # the restarted one serves again
