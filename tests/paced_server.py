"""A stand-in SGLang server whose generation speed is fixed, for timing tests of benchmark clients.

It speaks just what `sglang.bench_serving --backend sglang` uses (`/v1/models`, streaming
`/generate`, `/flush_cache`, `/get_server_info`) and emits token k of a request at
`start + ttft + k * itl` (absolute deadlines, so a busy CPU does not stretch the run). Any two
clients that time the same window measure the same duration against it, whatever the machine's
load, which a real model on a shared CPU cannot offer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

from aiohttp import web


class PacedServer:
    def __init__(self, model_id: str, ttft_s: float = 0.02, itl_s: float = 0.01, fail_generate: bool = False):
        self.model_id, self.ttft_s, self.itl_s = model_id, ttft_s, itl_s
        self.fail_generate = fail_generate  # answer /generate with 500, to test failure handling
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[dict] = []  # bodies of /generate calls, in arrival order
        self.calls: list[str] = []  # "METHOD /path" of every call
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        body = await request.json()
        self.requests.append(body)
        if self.fail_generate:
            return web.json_response({"error": {"message": "engine down"}}, status=500)
        n = body["sampling_params"]["max_new_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(n):
            await asyncio.sleep(max(0.0, start + self.ttft_s + k * self.itl_s - time.perf_counter()))
            event = {"text": "x" * (k + 1), "meta_info": {"completion_tokens": k + 1}}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _app(self) -> web.Application:
        @web.middleware
        async def record(request, handler):
            self.calls.append(f"{request.method} {request.path}")
            return await handler(request)

        async def models(_r):
            return web.json_response({"object": "list", "data": [{"id": self.model_id, "object": "model"}]})

        async def flush(_r):
            return web.Response(text="Cache flushed.\n")

        async def info(_r):
            return web.json_response({"model_path": self.model_id,
                                      "internal_states": [{"avg_spec_accept_length": None}]})

        app = web.Application(middlewares=[record])
        app.router.add_get("/v1/models", models)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/flush_cache", flush)
        app.router.add_get("/get_server_info", info)
        return app

    def start(self) -> PacedServer:
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            runner = web.AppRunner(self._app())
            self._loop.run_until_complete(runner.setup())
            self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
