"""SGLang-native routes of `salaserve serve` on the tiny model: /generate in all its forms, the
stream byte format, and the service routes."""

import asyncio
import json
import time

import httpx
import pytest

META_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions", "completion_tokens",
             "cached_tokens"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir, trust_remote_code=False)


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as c:
        yield c


def generate(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def read_stream(client, body) -> list:
    """The raw SSE lines of a streamed /generate: every one must be `data: ...` + blank line."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    chunks = raw.split("\n\n")
    assert chunks[-1] == ""
    lines = chunks[:-1]
    assert all(line.startswith("data: ") and "\n" not in line for line in lines), raw[:500]
    return [line[len("data: "):] for line in lines]


def test_generate_text_and_ids(client, tokenizer, tiny_model_dir):
    text = "def fibonacci(n):"
    out = generate(client, text=text, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    meta = out["meta_info"]
    assert list(meta)[:len(META_KEYS)] == META_KEYS and "e2e_latency" in meta
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id  # BOS + text, as SGLang tokenizes `text`
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == 12 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["weight_version"] == "default" and meta["cached_tokens"] == 0
    # the same ids give the same greedy tokens, and they match the offline engine
    by_ids = generate(client, input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12,
                                                              "ignore_eos": True})
    assert by_ids["output_ids"] == out["output_ids"] and by_ids["text"] == out["text"]
    from salaserve.core.sampling_params import SamplingParams
    from salaserve.engine.llm import LLM

    llm = LLM(tiny_model_dir, device="cpu", dtype="float32", backend="torch")
    offline = llm.generate(text, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    assert offline.token_ids == out["output_ids"] and offline.text == out["text"]


def test_batch_and_n(client):
    sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": 3, "sampling_seed": 7}
    outs = generate(client, text="Once upon a time", sampling_params=sp)
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1  # siblings get distinct seeds
    again = generate(client, text="Once upon a time", sampling_params=sp)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # ... deterministically

    batch = generate(client, text=["a b c", "hello there"],
                     sampling_params=[{"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
                                      {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}])
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [3, 5]
    ids_batch = generate(client, input_ids=[[1, 5, 6], [1, 7]], sampling_params={"max_new_tokens": 2})
    assert len(ids_batch) == 2 and all(o["meta_info"]["completion_tokens"] <= 2 for o in ids_batch)


def test_stream_format(client, tokenizer):
    body = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 20,
                                                               "ignore_eos": True},
            "lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1}
    lines = read_stream(client, body)
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    prev_text, prev_n = "", 0
    for e in events:
        assert e["text"] and e["text"].startswith(prev_text)  # cumulative, never empty
        n = e["meta_info"]["completion_tokens"]
        assert n >= prev_n and len(e["output_ids"]) == n
        assert list(e["meta_info"])[:len(META_KEYS)] == META_KEYS
        prev_text, prev_n = e["text"], n
    last = events[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert last["meta_info"]["completion_tokens"] == 20 and "e2e_latency" in last["meta_info"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    full = generate(client, **{**body, "stream": False})
    assert last["text"] == full["text"]

    # a batch stream tags every event with its prompt's index
    lines = read_stream(client, {"text": ["x y", "z"], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                           "ignore_eos": True}})
    events = [json.loads(x) for x in lines[:-1]]
    assert {e["index"] for e in events} == {0, 1}
    finals = [e for e in events if e["meta_info"]["finish_reason"]]
    assert sorted(e["index"] for e in finals) == [0, 1]


def test_stop_string_and_logprobs(client):
    base = {"text": "import numpy as np", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    full = generate(client, **base)["text"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop string")
    out = generate(client, text=base["text"], sampling_params={**base["sampling_params"], "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[:full.index(stop)]
    streamed = [json.loads(x) for x in read_stream(client, {"text": base["text"],
                                                           "sampling_params": {**base["sampling_params"],
                                                                               "stop": stop}})[:-1]]
    assert streamed[-1]["text"] == out["text"] and streamed[-1]["meta_info"]["finish_reason"]["matched"] == stop

    lp = generate(client, text="a b", sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                  return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True)
    meta = lp["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    for (logprob, tid, text), top, out_id in zip(meta["output_token_logprobs"], meta["output_top_logprobs"],
                                                 lp["output_ids"]):
        assert tid == out_id and logprob <= 0 and isinstance(text, str)
        assert len(top) == 3 and top[0][1] == tid  # greedy: the chosen token is the most likely


def test_service_routes(client, tiny_server, tiny_model_dir):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    r = client.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert client.get("/flush_cache").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == tiny_model_dir and info["is_generation"] is True
    assert info["model_type"] == "minicpm_sala" and info["architectures"] == ["MiniCPMSALAForCausalLM"]
    assert client.get("/model_info").json() == info
    t0 = time.perf_counter()
    si = client.get("/get_server_info").json()
    assert time.perf_counter() - t0 < 1.0
    assert isinstance(si["internal_states"], list) and isinstance(si["internal_states"][0], dict)
    assert si["status"] == "ready" and si["version"] and si["max_total_num_tokens"] > 0
    assert "last_gen_throughput" in si["internal_states"][0]
    assert client.get("/server_info").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == tiny_model_dir
    assert client.get(f"/v1/models/{tiny_model_dir}").json()["id"] == tiny_model_dir
    tok = client.post("/v1/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    detok = client.post("/v1/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["text"] == "hello world"
    assert client.post("/tokenize", json={"prompt": ["a", "b c"]}).json()["count"][1] >= 2


def test_metrics(client):
    generate(client, text="metrics", sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    text = client.get("/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_requests_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
                 "sglang:e2e_request_latency_seconds_bucket", "sglang:max_total_num_tokens"):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("sglang:generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3


def test_prefix_cache_reports_cached_tokens(client):
    """A prompt that extends an earlier one (the next turn of a conversation) starts from the
    earlier one's caches: meta_info.cached_tokens says how many prompt tokens were not computed,
    the output is what the flushed cache gives, and the cache hit rate metric moves."""
    first = [(7 * i) % 5000 + 3 for i in range(300)]  # >= --prefix-cache-min-tokens (256)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    out = generate(client, input_ids=first, sampling_params=params)
    assert out["meta_info"]["cached_tokens"] == 0
    turn = first + out["output_ids"] + [11, 12, 13]
    cached = generate(client, input_ids=turn, sampling_params=params)
    assert cached["meta_info"]["cached_tokens"] == len(first)
    assert client.post("/flush_cache").status_code == 200
    whole = generate(client, input_ids=turn, sampling_params=params)
    assert whole["meta_info"]["cached_tokens"] == 0 and whole["output_ids"] == cached["output_ids"]
    rate = [line for line in client.get("/metrics").text.splitlines() if line.startswith("sglang:cache_hit_rate")]
    assert rate and float(rate[0].split()[-1]) > 0


def test_abort_request_and_duplicate_rid(client, tiny_server):
    initial = tiny_server.server_info()["initial_counters"]
    body = {"text": "long", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True, "temperature": 0}}
    with client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[6:])["meta_info"]["id"] == "abort-me"
        dup = client.post("/generate", json={**body, "stream": False})
        assert dup.status_code == 400 and "rid" in dup.json()["error"]["message"]
        assert client.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 5000
    wait_for_counters(tiny_server, initial)


def test_requests_beyond_the_running_limit_queue(tiny_server):
    """24 concurrent requests against --max-running-requests 16: none rejected, all complete."""

    async def run():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/generate", json={
                "text": f"request {i}", "sampling_params": {"max_new_tokens": 4 + i % 5, "ignore_eos": True}})
                for i in range(24)))
        return rs

    for i, r in enumerate(asyncio.run(run())):
        assert r.status_code == 200
        assert r.json()["meta_info"]["completion_tokens"] == 4 + i % 5


def wait_for_counters(server, initial, timeout=30.0):
    deadline = time.monotonic() + timeout
    want = {"pages_used": initial["pages_used"], "compressed_entries": initial["compressed_entries"],
            "slots_used": initial["slots_used"], "num_running_reqs": 0, "num_queue_reqs": 0}
    while True:
        got = server.counters()
        if got == want or time.monotonic() > deadline:
            assert got == want
            return
        time.sleep(0.1)


def test_logit_bias(client):
    """SGLang's sampling_params.logit_bias (token ids as JSON strings): +100 on a token makes the
    greedy output that token; a banned token never appears; bad maps are a 400 naming the field."""
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    plain = generate(client, text="The capital of France is", sampling_params=sp)["output_ids"]
    favoured = (plain[0] + 1) % 8000 + 3
    out = generate(client, text="The capital of France is", sampling_params={**sp, "logit_bias": {str(favoured): 100}})
    assert out["output_ids"] == [favoured] * 8
    banned = generate(client, text="The capital of France is",
                      sampling_params={**sp, "logit_bias": {str(t): -100 for t in set(plain)}})["output_ids"]
    assert not set(banned) & set(plain)
    r = client.post("/generate", json={"text": "x", "sampling_params": {"logit_bias": {"not-a-token": 1}}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_prompt_logprobs(client, tokenizer):
    """return_logprob with logprob_start_len: the prompt tokens' logprobs from that index (the
    first token has none); max_new_tokens=0 scores the prompt only. A prompt token's logprob equals
    the output logprob of the same token generated after the same prefix."""
    ids = tokenizer("The quick brown fox jumps over").input_ids
    gen = generate(client, input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
                   return_logprob=True)
    (lp_out, tok, _), = gen["meta_info"]["output_token_logprobs"]
    full = ids + [tok]
    scored = generate(client, input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                      logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    inp = meta["input_token_logprobs"]
    assert [tid for _, tid, _ in inp] == full and inp[0][0] is None and meta["input_top_logprobs"][0] is None
    assert all(lp <= 0 for lp, _, _ in inp[1:]) and all(isinstance(t, str) for _, _, t in inp)
    assert abs(inp[-1][0] - lp_out) <= 1e-4
    assert all(len(top) == 2 and top[0][0] >= top[1][0] and top[0][0] >= lp for top, (lp, _, _) in
               zip(meta["input_top_logprobs"][1:], inp[1:]))
    tail = generate(client, input_ids=full, sampling_params={"temperature": 0, "max_new_tokens": 2}, return_logprob=True,
                    logprob_start_len=len(full) - 2)["meta_info"]
    assert [tid for _, tid, _ in tail["input_token_logprobs"]] == full[-2:]
    assert max(abs(a[0] - b[0]) for a, b in zip(tail["input_token_logprobs"], inp[-2:])) <= 1e-4
    assert len(tail["output_token_logprobs"]) == 2
    r = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": -2})
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


def test_structured_output(client):
    """SGLang's sampling_params json_schema / regex; a bad one is a 400 naming the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = generate(client, text="Answer:", sampling_params={"temperature": 0.7, "max_new_tokens": 40,
                                                            "json_schema": json.dumps(schema)})
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and isinstance(json.loads(out["text"])["ok"], bool)
    out = generate(client, text="Code:", sampling_params={"temperature": 0, "max_new_tokens": 40, "regex": "[A-Z]{3}"})
    assert len(out["text"]) == 3 and out["text"].isupper()
    r = client.post("/generate", json={"text": "x", "sampling_params": {"regex": "(oops"}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("sampling_params.regex: ")
