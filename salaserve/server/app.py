"""The FastAPI application: routes, error handlers, the body size limit, the body read timeout
(http_limits.py) and the API-key check (auth.py).

Every error leaves as JSON in the shape of its route (OpenAI on /v1/*, SGLang's elsewhere), and
the server keeps serving after any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from salaserve.config import EngineArgs
from salaserve.server import routes_native, routes_openai
from salaserve.server.args import ServerArgs
from salaserve.server.auth import ApiKeyMiddleware
from salaserve.server.http_limits import BodyReadTimeoutMiddleware
from salaserve.server.protocol import ApiError, error_response
from salaserve.server.state import ServerState

log = logging.getLogger("salaserve.server")


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for a body over the limit, whether announced by Content-Length or streamed (chunked)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                return await error_response(path, 400, "invalid Content-Length header")(scope, receive, send)
            if too_big:
                return await self._reject(path, scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._reject(path, scope, receive, send)

    async def _reject(self, path, scope, receive, send):
        msg = f"request body too large: the limit is {self.max_bytes} bytes"
        await error_response(path, 413, msg, headers={"Connection": "close"})(scope, receive, send)


def create_app(server_args: ServerArgs, engine_args: EngineArgs, on_fatal=None,
               devices: list[str] | None = None) -> FastAPI:
    """devices: one per engine replica (replicas.replica_devices); None: one engine on engine_args.device."""
    state = ServerState(server_args, engine_args, on_fatal=on_fatal, devices=devices)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        boot = asyncio.create_task(state.boot())
        try:
            yield
        finally:
            boot.cancel()
            await state.shutdown()

    app = FastAPI(title="salaserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(routes_native.router)
    app.include_router(routes_openai.router)
    if server_args.enable_metrics:
        @app.get("/metrics")
        async def metrics():
            return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(request.url.path, e.status, e.message, e.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return error_response(request.url.path, e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(request.url.path, 400, str(e.errors()[:3]))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}")

    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_bytes)
    app.add_middleware(BodyReadTimeoutMiddleware, timeout_s=server_args.request_read_timeout)
    if server_args.api_key:  # (outermost: a client without the key is turned away before its body is read)
        app.add_middleware(ApiKeyMiddleware, api_key=server_args.api_key, admin_api_key=server_args.admin_api_key,
                           metrics_no_auth=server_args.metrics_no_auth)
    return app
