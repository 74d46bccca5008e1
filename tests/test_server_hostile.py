"""Generated hostile requests over both API families (hypothesis, 240 cases): each gets a JSON 4xx
in its route's shape or a valid 200, never a 500 nor a dropped connection; then a soak of a few
hundred requests over both families, a third of them dropped mid-request by their clients, after
which the engine's pages, compressed-key entries and state slots are back where they started.

Generated requests always bound their output (max_new_tokens / max_tokens of at most 6, or a
value the server refuses): the point is the request shape, not long generations."""

import asyncio
import json
import random
import time

import httpx
import pytest
from conftest import HARDENED_API_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

AUTH = {"authorization": f"Bearer {HARDENED_API_KEY}"}
CASES = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])

# ---- strategies ------------------------------------------------------------------------------------------------
# Each case is a valid request (its required fields and some optional ones) with up to two fields
# made hostile: wrong types, out-of-range numbers, NaN, text with lone surrogates or NUL, remote
# $refs. Near-valid requests get past the first checks, so the deeper ones are exercised too.
OK_TEXT = st.text(st.characters(categories=["L", "N", "P", "S", "Zs"]), min_size=1, max_size=24)
BAD_TEXT = st.tuples(OK_TEXT, st.sampled_from(["\ud800", "\udfff", "\x00", "\ud83d"]), OK_TEXT).map("".join) | st.text(
    st.characters(categories=["L", "N", "Zs", "Cc", "Cs", "Mn"]), max_size=24)
SCALAR_JUNK = st.one_of(st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                        BAD_TEXT)
JUNK = st.one_of(st.none(), SCALAR_JUNK, st.lists(SCALAR_JUNK, max_size=3), st.dictionaries(BAD_TEXT, SCALAR_JUNK,
                                                                                           max_size=2))
NOT_NULL_JUNK = st.one_of(SCALAR_JUNK, st.lists(SCALAR_JUNK, max_size=3))  # (null would mean "the default")
OK_IDS = st.lists(st.integers(3, 8000), min_size=1, max_size=8)
BAD_IDS = st.lists(st.integers(-3, 10**7), max_size=8) | st.lists(st.lists(st.integers(-3, 9000), max_size=3), max_size=3)
SCHEMAS = ['{"type": "object", "properties": {"a": {"type": "integer"}}}',
           '{"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}']
BAD_SCHEMAS = ['{"$ref": "https://example.com/x.json"}', '{"properties": {"a": {"$ref": "file:///etc/passwd"}}}',
               '{"$ref": "#/$defs/missing"}', '{"type": "nonsense"}', "not json", "{}" * 3]


def near_valid(required: dict, optional: dict, hostile: dict) -> st.SearchStrategy:
    def overrides(keys):
        return st.fixed_dictionaries({k: hostile[k] for k in keys})

    valid = st.fixed_dictionaries(required, optional=optional)
    bad = st.lists(st.sampled_from(sorted(hostile)), min_size=1, max_size=2, unique=True).flatmap(overrides)
    return st.tuples(valid, st.just({}) | bad).map(lambda t: {**t[0], **t[1]})


def hostile_too(valid: dict, extra: dict | None = None) -> dict:
    """Each field's hostile values: junk of any type, plus `extra` where given."""
    return {k: (extra[k] | NOT_NULL_JUNK) if extra and k in extra else NOT_NULL_JUNK for k in valid} | {
        k: v for k, v in (extra or {}).items() if k not in valid}


SAMPLING_OK = {"temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(1, 50),
               "min_p": st.floats(0, 0.5), "stop": st.lists(OK_TEXT, max_size=2), "stop_token_ids": OK_IDS,
               "ignore_eos": st.booleans(), "seed": st.integers(0, 2**63), "frequency_penalty": st.floats(-1, 1),
               "repetition_penalty": st.floats(0.5, 2),
               "logit_bias": st.dictionaries(st.integers(3, 8000).map(str), st.floats(-50, 50), max_size=2)}
SAMPLING_BAD = {"temperature": st.floats(allow_nan=True) | st.just(-1.0), "top_p": st.just(1.5), "top_k": st.just(-7),
                "stop": BAD_TEXT.map(lambda t: [t]), "stop_token_ids": BAD_IDS, "seed": st.just(2**70),
                "logit_bias": st.dictionaries(BAD_TEXT, SCALAR_JUNK, min_size=1, max_size=2)}
NATIVE_SAMPLING_OK = {**SAMPLING_OK, "n": st.integers(1, 3), "min_new_tokens": st.integers(0, 3),
                      "json_schema": st.sampled_from(SCHEMAS), "regex": st.sampled_from(["[0-9]+", "a{2,3}"])}
NATIVE_SAMPLING = near_valid(
    {"max_new_tokens": st.integers(1, 6)}, NATIVE_SAMPLING_OK,
    hostile_too(NATIVE_SAMPLING_OK, {**SAMPLING_BAD, "n": st.integers(-1, 300), "max_new_tokens": st.integers(-2, 0)
                                     | st.just(10**9), "json_schema": st.sampled_from(BAD_SCHEMAS),
                                     "regex": st.sampled_from(["(", "\\", "[z-a]"])}))
GENERATE_OK = {"stream": st.booleans(), "rid": OK_TEXT.map(lambda t: f"rid-{t}"), "return_logprob": st.booleans(),
               "top_logprobs_num": st.integers(0, 5), "logprob_start_len": st.integers(-1, 3),
               "priority": st.integers(-3, 3), "return_text_in_logprobs": st.booleans()}
GENERATE = st.one_of(
    near_valid({"text": OK_TEXT | st.lists(OK_TEXT, min_size=1, max_size=4), "sampling_params": NATIVE_SAMPLING},
               GENERATE_OK, hostile_too(GENERATE_OK, {"text": BAD_TEXT | st.lists(BAD_TEXT, max_size=10),
                                                      "input_ids": OK_IDS, "lora_path": st.just("a"),
                                                      "image_data": st.just("x")})),
    near_valid({"input_ids": OK_IDS | st.lists(OK_IDS, min_size=1, max_size=4), "sampling_params": NATIVE_SAMPLING},
               GENERATE_OK, hostile_too(GENERATE_OK, {"input_ids": BAD_IDS})))
ABORT = near_valid({}, {"rid": OK_TEXT}, {"rid": NOT_NULL_JUNK, "abort_all": st.booleans() | NOT_NULL_JUNK})
OPENAI_OK = {**SAMPLING_OK, "n": st.integers(1, 3), "model": OK_TEXT, "stream": st.booleans(),
             "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": OK_TEXT,
             "min_tokens": st.integers(0, 3)}
OPENAI_BAD = {**SAMPLING_BAD, "n": st.integers(-1, 300), "max_tokens": st.integers(-2, 0) | st.just(10**9),
              "stream_options": JUNK}
COMPLETION_OK = {**OPENAI_OK, "echo": st.booleans(), "logprobs": st.integers(0, 5)}
COMPLETION = near_valid(
    {"prompt": OK_TEXT | st.lists(OK_TEXT, min_size=1, max_size=4) | OK_IDS, "max_tokens": st.integers(1, 6)},
    COMPLETION_OK, hostile_too(COMPLETION_OK, {**OPENAI_BAD, "prompt": BAD_TEXT | st.lists(BAD_TEXT, max_size=10)
                                               | BAD_IDS, "suffix": OK_TEXT, "logprobs": st.integers(-3, 40)}))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": OK_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": OK_TEXT}), max_size=2)})
BAD_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["robot", "user"]) | NOT_NULL_JUNK,
                                     "content": BAD_TEXT | st.lists(st.fixed_dictionaries(
                                         {"type": st.sampled_from(["image_url", "text"]), "text": SCALAR_JUNK}),
                                         max_size=2) | NOT_NULL_JUNK})
RESPONSE_FORMATS = st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                    {"type": "json_schema", "json_schema": {"name": "t", "schema": json.loads(SCHEMAS[1])}}])
BAD_RESPONSE_FORMATS = st.sampled_from(BAD_SCHEMAS).map(
    lambda s: {"type": "json_schema", "json_schema": {"schema": json.loads(s) if s.startswith("{\"") else s}}) | \
    st.sampled_from([{"type": "xml"}, {"type": "json_schema"}])
CHAT_OK = {**OPENAI_OK, "logprobs": st.booleans(), "response_format": RESPONSE_FORMATS,
           "continue_final_message": st.booleans()}
CHAT = near_valid(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)}, CHAT_OK,
    hostile_too(CHAT_OK, {**OPENAI_BAD, "messages": st.lists(MESSAGE | BAD_MESSAGE, max_size=3),
                          "response_format": BAD_RESPONSE_FORMATS, "top_logprobs": st.integers(-3, 40),
                          "chat_template_kwargs": st.dictionaries(BAD_TEXT, SCALAR_JUNK, max_size=2),
                          "tools": NOT_NULL_JUNK}))
TOKENIZE_OK = {"add_special_tokens": st.booleans()}
TOKENIZE = near_valid({"prompt": OK_TEXT | st.lists(OK_TEXT, min_size=1, max_size=4)}, TOKENIZE_OK,
                      hostile_too(TOKENIZE_OK, {"prompt": BAD_TEXT | st.lists(BAD_TEXT, max_size=10)}))
DETOKENIZE = near_valid({"tokens": OK_IDS | st.lists(OK_IDS, min_size=1, max_size=4)}, {}, {"tokens": BAD_IDS | JUNK})

NATIVE_CASES = st.one_of(st.tuples(st.just("/generate"), GENERATE), st.tuples(st.just("/generate"), GENERATE),
                         st.tuples(st.just("/abort_request"), ABORT), st.tuples(st.just("/tokenize"), TOKENIZE),
                         st.tuples(st.just("/detokenize"), DETOKENIZE))
OPENAI_CASES = st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION),
                         st.tuples(st.just("/v1/chat/completions"), CHAT),
                         st.tuples(st.just("/v1/tokenize"), TOKENIZE), st.tuples(st.just("/v1/detokenize"), DETOKENIZE))


# ---- checks ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(hardened_server):
    with httpx.Client(base_url=hardened_server.url, headers=AUTH, timeout=120) as c:
        yield c


def send(http: httpx.Client, path: str, body: dict) -> tuple[int, str, bytes]:
    """POST the body as JSON (lone surrogates as \\u escapes, NaN as NaN, as Python writes them)."""
    raw = json.dumps(body).encode()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        return r.status_code, r.headers.get("content-type", ""), r.read()


def check_answer(path: str, status: int, content_type: str, raw: bytes) -> None:
    assert status == 200 or 400 <= status < 500, (status, raw[:300])
    if status != 200:
        assert content_type.startswith("application/json"), raw[:300]
        body = json.loads(raw)
        if path.startswith("/v1/"):
            assert body["object"] == "error" and body["code"] == status and body["message"], body
        else:
            assert body["error"]["message"], body
        return
    if content_type.startswith("text/event-stream"):
        lines = [x for x in raw.decode().split("\n") if x]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
        return
    if path == "/abort_request":
        return
    body = json.loads(raw)
    if path == "/generate":
        for out in body if isinstance(body, list) else [body]:
            assert isinstance(out["text"], str) and out["meta_info"]["finish_reason"] is not None
    elif path in ("/v1/completions", "/v1/chat/completions"):
        assert body["choices"] and all(c["finish_reason"] for c in body["choices"])
    elif path.endswith("/tokenize"):
        assert "tokens" in body
    elif path.endswith("/detokenize"):
        assert "text" in body


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "still here?", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


@CASES
@given(case=NATIVE_CASES)
def test_generated_native_requests(http, case):
    path, body = case
    check_answer(path, *send(http, path, body))


@CASES
@given(case=OPENAI_CASES)
def test_generated_openai_requests(http, case):
    path, body = case
    check_answer(path, *send(http, path, body))


def wait_for_initial_counters(http: httpx.Client, timeout: float = 60.0) -> dict:
    info = http.get("/get_server_info").json()
    initial = info["initial_counters"]
    want = {"pages_used": initial["pages_used"], "compressed_entries": initial["compressed_entries"],
            "slots_used": initial["slots_used"], "num_running_reqs": 0, "num_queue_reqs": 0}
    deadline = time.monotonic() + timeout
    while True:
        state = http.get("/get_server_info").json()["internal_states"][0]
        got = {k: state[k] for k in want}
        if got == want or time.monotonic() > deadline:
            assert got == want
            return state
        time.sleep(0.2)


def test_still_serving_after_the_generated_requests(http):
    assert_still_serving(http)
    wait_for_initial_counters(http)


# ---- soak: both families, random disconnects -------------------------------------------------------------------
N_SOAK = 300


async def soak_one(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    kind = rng.choice(["generate", "completions", "chat", "bad"])
    new = rng.randrange(4, 60)
    drop = rng.random() < 0.35
    stream = drop or rng.random() < 0.5
    if kind == "generate":
        path, body = "/generate", {"text": f"soak {i} " + "word " * rng.randrange(1, 30), "stream": stream,
                                   "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "n": rng.choice([1, 2])}}
    elif kind == "completions":
        path, body = "/v1/completions", {"prompt": f"soak {i}", "max_tokens": new, "ignore_eos": True, "stream": stream}
    elif kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"soak {i}"}],
                                              "max_tokens": new, "ignore_eos": True, "stream": stream}
    else:
        path, body = rng.choice([("/generate", {"text": "\ud800"}), ("/v1/completions", {"prompt": [], "max_tokens": 2}),
                                 ("/v1/chat/completions", {"messages": "hi", "max_tokens": 2})])
        r = await client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        return "bad"
    if drop and rng.random() < 0.3:  # a non-streaming client that gives up while it waits
        try:
            await asyncio.wait_for(client.post(path, json={**body, "stream": False}), timeout=rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            return "dropped"
        return "finished"
    if not stream:
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        return "finished"
    leave_after = rng.randrange(0, 6) if drop else None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                assert '"error"' not in line[:12], line
                events += 1
                if leave_after is not None and events > leave_after:
                    return "dropped"  # leaving the block closes the connection mid-stream
    return "finished"


def test_soak_with_random_disconnects_returns_every_resource(http, hardened_server):
    rng = random.Random(43)

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=hardened_server.url, headers=AUTH, timeout=300, limits=limits) as c:
            sem = asyncio.Semaphore(48)

            async def limited(i):
                async with sem:
                    return await soak_one(c, i, rng)

            return await asyncio.gather(*(limited(i) for i in range(N_SOAK)))

    outcomes = asyncio.run(run())
    assert outcomes.count("dropped") > N_SOAK // 10 and outcomes.count("finished") > N_SOAK // 3
    state = wait_for_initial_counters(http)
    assert state["engine_aborted"] > 0
    assert_still_serving(http)
