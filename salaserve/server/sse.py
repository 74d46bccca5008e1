"""Server-sent events as SGLang writes them: `data: {json}\\n\\n` lines, then `data: [DONE]\\n\\n`.
No comments, `event:` or `id:` lines: SGLang's benchmark client parses every line as JSON.

`EventStreamResponse` watches for the client going away while it streams, whatever the ASGI
server's version, and closes the event generator at once: the generator's `finally` then
aborts its engine requests, which frees their pages and slots without waiting for the next token.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.responses import StreamingResponse

log = logging.getLogger("salaserve.server")

DONE = b"data: [DONE]\n\n"


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def event(obj) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8") + b"\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, **kwargs):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            results = await asyncio.gather(stream, watcher, return_exceptions=True)
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
        err = results[0]
        if isinstance(err, Exception) and not isinstance(err, OSError):
            log.error("stream failed: %r", err)
