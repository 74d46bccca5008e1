"""Malformed and hostile requests (tests/data/bad_requests.jsonl) each get the right 4xx with a
JSON error in the route's shape, and the server keeps serving afterwards.

Corpus rows: name, method, path, status, and optionally body (raw text), body_b64 (raw bytes),
headers (merged over `content-type: application/json` + the API key; null removes one),
pad ({marker, unit, count}: the marker in body becomes unit * count), chunked (send the body
with Transfer-Encoding: chunked), auth (false: no API key).
"""

import base64
import json
import os

import httpx
import pytest
from server_utils import run_server, tiny_server_args

CORPUS = os.path.join(os.path.dirname(__file__), "data", "bad_requests.jsonl")
API_KEY = "test-key"
# Small limits so that the corpus can reach them with small files.
SERVER_FLAGS = ("--api-key", API_KEY, "--context-length", "4096", "--max-total-tokens", "2048",
                "--max-request-mb", "0.1", "--max-running-requests", "4", "--skip-server-warmup")


def load_corpus() -> list[dict]:
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


ROWS = load_corpus()


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir, tmp_path_factory):
    with run_server(tiny_server_args(tiny_model_dir, *SERVER_FLAGS), str(tmp_path_factory.mktemp("logs"))) as s:
        yield s


@pytest.fixture(scope="module")
def http(strict_server):
    with httpx.Client(base_url=strict_server.url, timeout=60) as c:
        yield c


def build_request(row: dict) -> dict:
    if "body_b64" in row:
        content = base64.b64decode(row["body_b64"])
    elif "body" in row:
        text = row["body"]
        if "pad" in row:
            pad = row["pad"]
            text = text.replace(pad["marker"], pad["unit"] * pad["count"])
        content = text.encode("utf-8")
    else:
        content = None
    headers = {"content-type": "application/json"}
    if row.get("auth", True):
        headers["authorization"] = f"Bearer {API_KEY}"
    for k, v in (row.get("headers") or {}).items():
        headers.pop(k.lower(), None)
        if v is not None:
            headers[k.lower()] = v
    if row.get("chunked") and content is not None:
        data = content

        def pieces():
            for i in range(0, len(data), 8192):
                yield data[i:i + 8192]

        content = pieces()
    return {"method": row["method"], "url": row["path"], "headers": headers, "content": content}


def test_corpus_is_large_enough():
    assert len(ROWS) >= 100
    assert len({r["name"] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_bad_request(http, row):
    r = http.request(**build_request(row))
    assert r.status_code == row["status"], r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if row["path"].startswith("/v1/"):
        assert body["object"] == "error" and body["code"] == row["status"]
        assert isinstance(body["message"], str) and body["message"] and "type" in body
    else:
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_still_serving_after_the_corpus(http, strict_server):
    auth = {"authorization": f"Bearer {API_KEY}"}
    assert http.get("/health").status_code == 200  # probes need no key
    r = http.post("/generate", headers=auth, json={"text": "still alive?",
                                                   "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 5
    r = http.post("/v1/chat/completions", headers=auth,
                  json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    # every rejected request left the engine as it was
    info = http.get("/get_server_info", headers=auth).json()
    initial, state = info["initial_counters"], info["internal_states"][0]
    assert state["pages_used"] == initial["pages_used"] and state["slots_used"] == initial["slots_used"]
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0


def test_native_routes_take_curl_default_content_type(http):
    """`curl -d` sends application/x-www-form-urlencoded; native routes read it as JSON (the
    OpenAI routes do not, as in SGLang)."""
    r = http.post("/generate", content=b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}',
                  headers={"content-type": "application/x-www-form-urlencoded",
                           "authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
