"""The eval client against a fake OpenAI-chat server on loopback, and the `eval` CLI end to end."""

import asyncio
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from bpe_tokenizer import build_bpe_tokenizer
from salaserve.evaluation.cli import main
from salaserve.evaluation.client import load_stop_words, run_eval, stop_words_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Answers each question with the text after 'echo:' (null for 'null', HTTP 500 for 'fail')."""

    def __init__(self, port: int | None = None, delay_s: float = 0.0):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.payloads: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.delay_s = delay_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ready = threading.Event()

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def chat(self, request):
        body = await request.json()
        self.payloads.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        q = body["messages"][0]["content"]
        if q == "fail":
            return web.Response(status=500, text="boom")
        content = None if q == "null" else q.split("echo:", 1)[-1]
        return web.json_response({"id": "x", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": content}}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def start(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server():
    s = FakeServer(delay_s=0.05).start()
    yield s
    s.stop()


def test_payload_order_and_failures(server):
    rows = [{"question": f"q{i} echo:ans{i}"} for i in range(6)] + \
        [{"question": "null"}, {"question": "fail"}]
    preds = asyncio.run(run_eval(server.url, "m", rows, concurrency=2, max_tokens=123,
                                 stop=["</s>", "<|im_end|>"]))
    assert [p.content for p in preds[:6]] == [f"ans{i}" for i in range(6)]
    assert preds[6].content == "" and preds[6].error is None  # null content -> ""
    assert preds[7].content == "" and "HTTP 500" in preds[7].error and preds[7].attempts == 1
    assert preds[0].completion_tokens == 3 and preds[0].finish_reason == "stop"
    assert server.max_in_flight <= 2
    p = server.payloads[0]
    assert p == {"model": "m", "messages": [{"role": "user", "content": p["messages"][0]["content"]}],
                 "temperature": 0.0, "max_tokens": 123, "stop": ["</s>", "<|im_end|>"]}


def test_retries_until_server_is_up():
    s = FakeServer()
    timer = threading.Timer(0.4, s.start)
    timer.start()
    try:
        t0 = time.perf_counter()
        preds = asyncio.run(run_eval(s.url, "m", [{"question": "echo:late"}], retries=6,
                                     retry_delay_s=0.1))
        assert preds[0].content == "late" and preds[0].attempts > 1
        assert time.perf_counter() - t0 < 10
    finally:
        timer.join()
        s.stop()


def test_connection_errors_exhaust_retries():
    url = f"http://127.0.0.1:{_free_port()}"
    preds = asyncio.run(run_eval(url, "m", [{"question": "x"}], retries=1, retry_delay_s=0.01))
    assert preds[0].content == "" and preds[0].error.startswith("connection") and preds[0].attempts == 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    build_bpe_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 1]}))
    return d


def test_stop_words_from_model_dir(model_dir, tmp_path):
    assert load_stop_words(str(model_dir)) == ["</s>", "<s>"]
    assert stop_words_for(str(model_dir)) == ["</s>", "<s>"]
    assert stop_words_for("not-a-dir") == ["</s>", "<|im_end|>"]


def test_cli_eval_end_to_end(server, tmp_path, capsys):
    rows = [{"task": "niah", "question": "echo:the number is 42", "gold": ["42"]},
            {"task": "mcq", "question": "echo:<think>A?</think>ANSWER: B", "gold": "B"},
            {"task": "cwe", "question": "echo:x1 x2", "gold": ["x1", "x2", "x3", "x4"]},
            {"task": "qa", "question": "fail", "gold": ["y"]}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    assert main(["--data", str(data), "--url", server.url, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| niah | 1 | 100.00 |" in text and "| qa | 1 | 0.00 | 1 |" in text
    res = json.loads(out.read_text())
    assert res["summary"]["model"] == "fake-model"  # from GET /v1/models
    assert res["summary"]["ori_accuracy"] == 62.5 and res["summary"]["overall_accuracy"] == 78.12
    assert [r["score"] for r in res["rows"]] == [1.0, 1.0, 0.5, 0.0]
    assert server.payloads[0]["stop"] == ["</s>", "<|im_end|>"] and server.payloads[0]["max_tokens"] == 65536


def test_cli_no_server(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"task": "qa", "question": "q", "gold": ["a"]}) + "\n")
    assert main(["--data", str(data), "--url", f"http://127.0.0.1:{_free_port()}"]) == 1


def test_cli_make_synthetic(model_dir, tmp_path):
    out = tmp_path / "syn.jsonl"
    argv = ["make-synthetic", "--out", str(out), "--model", str(model_dir), "--lengths", "400,900",
            "--per-task", "1", "--seed", "2"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [r["task"] for r in rows] == ["niah", "qa", "cwe", "fwe"] * 2
    assert [r["target_tokens"] for r in rows] == [400] * 4 + [900] * 4
