"""Issue 43, one test per point: hostile input gets a 400 in its route's shape on a connection that
stays open; limits apply before expensive work; one client's large request does not hold up
another's; /abort_request stops only the caller's own requests; the API key guards every route
but the probes; total_retractions counts preemptions; a schema with a remote $ref is refused;
a short body or a stalled head gets a 408, an oversized head a 431.

All against the `hardened_server` fixture (tests/conftest.py)."""

import asyncio
import json
import socket
import time

import httpx
import pytest
from conftest import HARDENED_ADMIN_KEY, HARDENED_API_KEY

AUTH = {"authorization": f"Bearer {HARDENED_API_KEY}"}
ADMIN = {"authorization": f"Bearer {HARDENED_ADMIN_KEY}"}
SHORT = {"max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(hardened_server):
    with httpx.Client(base_url=hardened_server.url, headers=AUTH, timeout=120) as c:
        yield c


def assert_error_shape(path: str, r: httpx.Response | tuple, status: int) -> str:
    code, headers, body = (r.status_code, r.headers, r.content) if isinstance(r, httpx.Response) else r
    assert code == status, body[:300]
    assert headers["content-type"].startswith("application/json")
    data = json.loads(body)
    if path.startswith("/v1/"):
        assert data["object"] == "error" and data["code"] == status and data["message"]
        return data["message"]
    assert data["error"]["message"]
    return data["error"]["message"]


# ---- raw HTTP/1.1 on one socket, to see whether the server keeps the connection ----------------------
class RawConnection:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.rfile = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple:
        head = {"host": "test", "content-type": "application/json", "content-length": str(len(body)), **AUTH,
                **(headers or {})}
        self.send(f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(
            f"{k}: {v}\r\n".encode() for k, v in head.items()) + b"\r\n" + body)
        return self.response()

    def response(self) -> tuple:
        """(status, headers, body) of a response with a Content-Length; status 0 if the server closed."""
        status_line = self.rfile.readline()
        if not status_line:
            return 0, {}, b""
        headers = {}
        while (line := self.rfile.readline().rstrip(b"\r\n")):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = self.rfile.read(int(headers.get("content-length", 0)))
        return int(status_line.split()[1]), headers, body

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


BAD_TEXT_CASES = [  # (path, raw JSON body): lone surrogates and NUL where a prompt is expected
    ("/generate", b'{"text": "\\ud800"}'),
    ("/generate", b'{"text": ["fine", "bad \\udfff end"], "sampling_params": {"max_new_tokens": 2}}'),
    ("/generate", b'{"text": "nul \\u0000 inside"}'),
    ("/generate", b'{"text": "ok", "rid": "\\ud834"}'),
    ("/generate", b'{"text": "ok", "sampling_params": {"stop": ["\\udc00"], "max_new_tokens": 2}}'),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["a", "\\u0000"], "max_tokens": 2}'),
    ("/v1/tokenize", b'{"prompt": "\\ud800x"}'),
    ("/v1/tokenize", b'{"prompt": ["a", "b\\ud800"]}'),
    ("/tokenize", b'{"prompt": "\\udbff"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\u0000b"}], "max_tokens": 2}'),
]


@pytest.mark.parametrize("path,body", BAD_TEXT_CASES, ids=[f"{p} {b[:40]!r}" for p, b in BAD_TEXT_CASES])
def test_bad_text_is_a_400_and_the_connection_stays_open(hardened_server, path, body):
    conn = RawConnection(hardened_server.port)
    try:
        assert_error_shape(path, conn.request("POST", path, body), 400)
        # the same connection serves the next request
        ok = conn.request("POST", "/generate", json.dumps({"text": "after", "sampling_params": SHORT}).encode())
        assert ok[0] == 200 and json.loads(ok[2])["meta_info"]["completion_tokens"] == 3
    finally:
        conn.close()


def test_valid_surrogate_pairs_still_pass(http):
    r = http.post("/generate", content=b'{"text": "emoji \\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}')
    assert r.status_code == 200


# ---- limits before expensive work -------------------------------------------------------------------------
def test_a_prompt_too_long_in_characters_is_refused_without_tokenizing(http, hardened_server):
    info = http.get("/get_server_info").json()
    ctx = info["context_length"]
    cap = ctx * 80  # the tiny tokenizer's longest vocabulary entry has 80 characters
    for path, body in (("/generate", {"text": "x" * (cap + 1)}),
                       ("/v1/completions", {"prompt": "y" * (cap + 1), "max_tokens": 1}),
                       ("/v1/tokenize", {"prompt": "z" * (cap + 1)})):
        t0 = time.perf_counter()
        r = http.post(path, json=body)
        msg = assert_error_shape(path, r, 400)
        assert f"over {cap} characters" in msg and str(ctx) in msg
        assert time.perf_counter() - t0 < 5  # (tokenizing 5M characters here takes several seconds)


@pytest.mark.parametrize("path,body,needle", [
    ("/generate", {"text": [f"p{i}" for i in range(9)]}, "--max-batch-prompts"),
    ("/generate", {"input_ids": [[1, 2]] * 9}, "--max-batch-prompts"),
    ("/generate", {"text": ["a", "b", "c", "d"], "sampling_params": {"n": 17}}, "--max-request-sequences"),
    ("/v1/completions", {"prompt": [f"p{i}" for i in range(9)]}, "--max-batch-prompts"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 22}, "--max-request-sequences"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, "--max-request-sequences"),
    ("/v1/tokenize", {"prompt": [f"p{i}" for i in range(9)]}, "--max-batch-prompts"),
    ("/v1/detokenize", {"tokens": [[1, 2]] * 9}, "--max-batch-prompts"),
])
def test_requests_over_the_size_caps_are_400(http, path, body, needle):
    assert needle in assert_error_shape(path, http.post(path, json=body), 400)


def test_a_request_at_the_caps_is_served(http):
    r = http.post("/generate", json={"text": [f"p{i}" for i in range(8)], "sampling_params": {**SHORT, "n": 8}})
    assert r.status_code == 200 and len(r.json()) == 64


# ---- fair share ------------------------------------------------------------------------------------------------
def test_a_long_prompt_being_tokenized_does_not_hold_up_a_short_request(hardened_server):
    """A 4M-character prompt (under the character cap, far over the context in tokens) takes
    seconds to tokenize before its 400; a short request sent while that runs is answered first."""
    big = {"text": "word " * 800_000, "sampling_params": {"max_new_tokens": 1}}

    async def run():
        async with httpx.AsyncClient(base_url=hardened_server.url, headers=AUTH, timeout=120) as c:
            done = {}

            async def send(name, body, delay):
                await asyncio.sleep(delay)
                t0 = time.perf_counter()
                r = await c.post("/generate", json=body)
                done[name] = (time.perf_counter(), time.perf_counter() - t0, r.status_code)

            await asyncio.gather(send("big", big, 0), send("small", {"text": "hi", "sampling_params": SHORT}, 0.5))
            return done

    done = asyncio.run(run())
    assert done["big"][2] == 400 and done["small"][2] == 200
    assert done["small"][0] < done["big"][0], done  # answered while the long prompt was still being tokenized
    assert done["small"][1] < 1.5, done


def test_one_requests_many_sequences_do_not_hold_up_another_request(hardened_server):
    """8 prompts x n=8 (64 sequences, 8 running at a time) take 8 rounds; a 3-token request sent
    just after waits for one round at most, not for all 64 (at b223a38 it came last)."""
    batch = {"text": [f"batch prompt {i}" for i in range(8)],
             "sampling_params": {"n": 8, "max_new_tokens": 24, "ignore_eos": True}}

    async def run():
        async with httpx.AsyncClient(base_url=hardened_server.url, headers=AUTH, timeout=300) as c:
            done = {}

            async def send(name, body, delay):
                await asyncio.sleep(delay)
                t0 = time.perf_counter()
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                done[name] = (time.perf_counter(), time.perf_counter() - t0)

            await asyncio.gather(send("batch", batch, 0), send("small", {"text": "hi", "sampling_params": SHORT}, 0.3))
            return done

    done = asyncio.run(run())
    assert done["small"][0] < done["batch"][0], done
    assert done["small"][1] < 0.5 * done["batch"][1], done


# ---- ownership -------------------------------------------------------------------------------------------------
def stream_events(client: httpx.Client, body: dict):
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


def test_abort_stops_only_the_callers_own_requests(hardened_server, http):
    other = httpx.Client(base_url=hardened_server.url, timeout=60,  # another client: another address
                         transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    body = {"text": "long", "rid": "owned-by-a",
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0}}
    try:
        events = stream_events(http, body)
        first = next(events)["meta_info"]["completion_tokens"]
        # another client, even with the API key: neither the rid nor abort_all stops it
        assert other.post("/abort_request", json={"rid": "owned-by-a"}, headers=AUTH).status_code == 200
        r = other.post("/abort_request", json={"abort_all": True}, headers=AUTH)
        assert "admin" in assert_error_shape("/abort_request", r, 403)
        assert http.post("/abort_request", json={"abort_all": True}).status_code == 403  # the owner neither
        later = None
        for e in events:
            later = e["meta_info"]
            if later["completion_tokens"] >= first + 40:
                break
        assert later["finish_reason"] is None, later  # still running, 40 tokens after both aborts
        # the owner may stop it
        assert http.post("/abort_request", json={"rid": "owned-by-a"}).status_code == 200
        last = list(events)[-1]["meta_info"]
        assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 900

        # the admin key may stop anyone's, and everything
        events = stream_events(http, {**body, "rid": "owned-by-a-2"})
        next(events)
        assert other.post("/abort_request", json={"rid": "owned-by-a-2"}, headers=ADMIN).status_code == 200
        assert list(events)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        events = stream_events(http, {**body, "rid": "owned-by-a-3"})
        next(events)
        assert other.post("/abort_request", json={"abort_all": True}, headers=ADMIN).status_code == 200
        assert list(events)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        other.close()


# ---- auth ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [
    ("GET", "/health_generate"), ("GET", "/metrics"), ("GET", "/get_server_info"), ("GET", "/get_model_info"),
    ("GET", "/v1/models"), ("POST", "/flush_cache"), ("POST", "/generate"), ("POST", "/abort_request"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/tokenize"), ("GET", "/healthz"),
])
def test_every_route_but_the_probes_needs_the_key(hardened_server, method, path):
    r = httpx.request(method, hardened_server.url + path, json={}, timeout=30)
    assert_error_shape(path, r, 401)


def test_the_probes_answer_without_the_key_and_the_rest_with_it(hardened_server):
    url = hardened_server.url
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert httpx.get(url + "/ping", timeout=30).text == "pong"
    assert httpx.get(url + "/health_generate", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(url + "/health_generate", headers=ADMIN, timeout=30).status_code == 200
    assert "sglang:num_requests" in httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    bad = {"authorization": f"Bearer {HARDENED_API_KEY}x"}
    assert httpx.get(url + "/v1/models", headers=bad, timeout=30).status_code == 401


# ---- total_retractions ----------------------------------------------------------------------------------------------
def test_total_retractions_counts_preemptions(http, hardened_server):
    """8 requests of ~210 tokens in a 1024-token KV pool: the engine preempts; every preemption
    shows in the meta_info of the request it hit."""
    before = http.get("/get_server_info").json()["internal_states"][0]["num_preemptions"]

    async def run():
        async with httpx.AsyncClient(base_url=hardened_server.url, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(*(c.post("/generate", json={
                "text": f"request number {i} of eight", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
                for i in range(8)))

    metas = [r.json()["meta_info"] for r in asyncio.run(run())]
    assert all(m["completion_tokens"] == 200 for m in metas)
    preempted = http.get("/get_server_info").json()["internal_states"][0]["num_preemptions"] - before
    assert preempted > 0
    assert sum(m["total_retractions"] for m in metas) == preempted


# ---- structured output: $ref --------------------------------------------------------------------------------------
@pytest.mark.parametrize("ref", ["https://example.com/schemas/thing.json", "file:///etc/passwd", "other.json#/a"])
def test_a_schema_with_a_non_local_ref_is_400(http, ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    r = http.post("/generate", json={"text": "x", "sampling_params": {**SHORT, "json_schema": json.dumps(schema)}})
    assert ref in assert_error_shape("/generate", r, 400)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
    assert ref in assert_error_shape("/v1/chat/completions", r, 400)


def test_a_schema_with_a_local_ref_is_served(http):
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}
    r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 3,
                                                                       "json_schema": json.dumps(schema)}})
    assert r.status_code == 200


# ---- the HTTP layer: read timeouts, oversized heads ---------------------------------------------------------------
def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_body_shorter_than_declared_gets_408_and_the_connection_closes(hardened_server):
    with socket.create_connection(("127.0.0.1", hardened_server.port)) as s:
        t0 = time.perf_counter()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + HARDENED_API_KEY.encode() + b"\r\ncontent-length: 1000\r\n\r\n{\"pro")
        data = read_until_closed(s, 30)  # (recv raises if the server never answers)
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b'"code":408' in data.replace(b" ", b"")  # OpenAI shape on /v1
    assert 1.5 < time.perf_counter() - t0 < 10  # the server's --request-read-timeout is 2 s


def test_a_stalled_request_head_gets_408(hardened_server):
    with socket.create_connection(("127.0.0.1", hardened_server.port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nhost: t\r\n")
        data = read_until_closed(s, 30)
    assert data.startswith(b"HTTP/1.1 408 ") and b'"error"' in data, data[:200]


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_an_oversized_head_gets_431_not_a_reset(hardened_server, path):
    r = httpx.post(hardened_server.url + path, json={"text": "x"}, timeout=30,
                   headers={**AUTH, "x-padding": "a" * 200_000})
    assert_error_shape(path, r, 431)
    assert httpx.get(hardened_server.url + "/health", timeout=30).status_code == 200
