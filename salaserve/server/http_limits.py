"""Limits at the HTTP layer, before any route runs: request head size, and how long a client may
take to send its request head and body.

uvicorn (h11) on its own waits forever for a body shorter than its Content-Length, and for a
request head that never ends; and it answers an oversized head with a plain-text 400 and an
immediate close, which resets the connection while the client is still sending, so the client
sees a TCP reset instead of the answer. Here:

- `GuardedH11Protocol`: a head over `MAX_HEAD_BYTES` gets a JSON 431 (other malformed heads a JSON
  400), then a lingering close: the answer is sent, our side of the connection is shut, and what
  the client still sends is read and dropped for up to `LINGER_S` so that the kernel does not
  reset the connection under the answer. A request head must arrive in full within the read
  timeout of its first byte (408 otherwise).
- `BodyReadTimeoutMiddleware`: the whole body must arrive within the read timeout (408 and the
  connection closed otherwise). Waits after the body (a handler watching for a disconnect) are
  not bounded.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from salaserve.server.protocol import error_body, error_response

MAX_HEAD_BYTES = 64 * 1024  # request line + headers; uvicorn's h11_max_incomplete_event_size
LINGER_S = 2.0  # how long a rejected client may go on sending before the connection is closed

STATUS_TEXT = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def path_of_head(head: bytes) -> str:
    """The request target of a (possibly partial) request head, to answer in its route's error shape."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].split(b"?", 1)[0].decode("latin-1") if len(parts) >= 2 else "/"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON answers to bad request heads, a lingering close after
    them, and a read timeout on request heads. `read_timeout_s` is set by `guarded_protocol`."""

    read_timeout_s: float = 60.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lingering = False
        self.head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # answered already: drop the rest of what the client sends
            return
        super().data_received(data)
        # h11 stays IDLE until a request head is complete: bound how long that may take
        waiting_for_head = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting_for_head and self.head_timer is None:
            self.head_timer = self.loop.call_later(self.read_timeout_s, self._head_timed_out)
        elif not waiting_for_head:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when h11 cannot parse the request head (h11 keeps what it received)."""
        head = self.conn.trailing_data[0]
        if len(head) > MAX_HEAD_BYTES:
            self._reject(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes", head)
        else:
            self._reject(400, "invalid HTTP request (malformed request line or headers)", head)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._reject(408, f"the request head did not arrive within {self.read_timeout_s:g} s",
                         self.conn.trailing_data[0])

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _reject(self, status: int, message: str, head: bytes) -> None:
        """Answer with `status` in the route's error shape, outside h11 (whose state may be
        ERROR), then close after a linger."""
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        body = json.dumps(error_body(path_of_head(head), status, message)).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n" % (status, STATUS_TEXT[status], len(body)) + body)
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then our FIN; the client's data still comes in
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def guarded_protocol(read_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn's Config(http=...), with this read timeout."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout_s": read_timeout_s})


class BodyReadTimeout(Exception):
    pass


class BodyReadTimeoutMiddleware:
    """408 for a request whose body does not arrive in full within `timeout_s` of its head."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False
        started = False

        async def timed_receive():
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyReadTimeout() from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, timed_receive, tracking_send)
        except BodyReadTimeout:
            if not started:
                msg = f"the request body did not arrive within {self.timeout_s:g} s"
                await error_response(scope["path"], 408, msg, headers={"Connection": "close"})(scope, receive, send)
