"""Our benchmark client: one tier run exactly as `sglang.bench_serving --backend sglang
--dataset-name custom --flush-cache` runs it (serving_protocol.md sections 1.2, 1.3 and 1.5).

Sequence per tier: one untimed warm-up request (the first request, max_new_tokens capped at 32;
all warm-ups failing aborts the tier), `POST /flush_cache` (answer ignored), sleep 1 s, then the
timed window: every request released at once behind a semaphore of `max_concurrency` (none for
Smax), gather, one `GET /get_server_info`, stop the clock.

Each request opens its own aiohttp session (6 h total timeout, 10 MB read buffer) and parses the
stream line by line: `data: ` prefix removed, `[DONE]` ignored, anything else must be JSON; only
chunks with a non-empty cumulative `text` count; `meta_info.completion_tokens` is the cumulative
length; TTFT at the first counted chunk; a later chunk with k new tokens adds k inter-token
latencies of gap/k; a chunk with no new tokens is skipped without moving the clock; E2E latency
is the time of the last line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from salaserve.bench.dataset import BenchRequest

SESSION_TIMEOUT_S = 6 * 60 * 60
READ_BUFSIZE = 10 * 1024 ** 2
WARMUP_MAX_TOKENS = 32
FLUSH_SLEEP_S = 1.0


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    success: bool = False
    completion_tokens: int = 0  # last meta_info.completion_tokens seen (requested if none)
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # E2E seconds: time of the last stream line
    itl: list[float] = field(default_factory=list)  # seconds, one per token after the first
    start_time: float = 0.0  # perf_counter at send
    error: str = ""
    text: str = ""


@dataclass
class TierRun:
    duration: float  # the official "Benchmark duration (s)"
    results: list[RequestResult]  # (start_time - window_start: when each request was sent)
    accept_length: float | None
    max_concurrency: int | None
    window_start: float = 0.0  # perf_counter when the timed window opened


def auth_headers() -> dict[str, str]:
    """The client's auth: `Bearer $OPENAI_API_KEY`, else the raw `$API_KEY`, else none."""
    if key := os.environ.get("OPENAI_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    if key := os.environ.get("API_KEY"):
        return {"Authorization": key}
    return {}


def generate_payload(prompt: str, max_new_tokens: int) -> dict:
    """The exact `/generate` body the official client sends with the toolkit's flags."""
    return {"text": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False,
            "return_routed_experts": False, "logprob_start_len": -1}


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SESSION_TIMEOUT_S),
                                 read_bufsize=READ_BUFSIZE)


async def stream_request(api_url: str, prompt: str, prompt_len: int, output_len: int) -> RequestResult:
    """One streamed `/generate` request, timed and parsed as the official client does."""
    out = RequestResult(prompt_len=prompt_len, output_len=output_len)
    async with _session() as session:
        n_tokens, last_n, ttft, latency, text = output_len, 0, 0.0, 0.0, ""
        st = time.perf_counter()
        out.start_time = recent = st
        try:
            async with session.post(api_url, json=generate_payload(prompt, output_len),
                                    headers=auth_headers()) as resp:
                if resp.status != 200:
                    out.error = (resp.reason or "") + ": " + await resp.text()
                    return out
                async for raw in resp.content:
                    line = raw.strip()
                    if not line:
                        continue
                    chunk = line.decode("utf-8")
                    chunk = chunk[len("data: "):] if chunk.startswith("data: ") else chunk
                    latency = time.perf_counter() - st
                    if chunk == "[DONE]":
                        continue
                    data = json.loads(chunk)
                    if not ("text" in data and data["text"]):
                        continue  # e.g. an error chunk: ignored, as the official client does
                    now = time.perf_counter()
                    text = data["text"]
                    n_tokens = data["meta_info"]["completion_tokens"]
                    if ttft == 0.0:
                        ttft = now - st
                    else:
                        new = n_tokens - last_n
                        if new == 0:
                            continue
                        out.itl.extend([(now - recent) / new] * new)
                    recent, last_n = now, n_tokens
            out.success, out.latency, out.ttft = True, latency, ttft
            out.completion_tokens, out.text = n_tokens, text
        except Exception:  # noqa: BLE001 - any failure marks the request failed, like the official client
            out.ttft = ttft
            out.error = traceback.format_exc()
    return out


async def _post_ignore(url: str) -> None:
    async with _session() as s, s.post(url, headers=auth_headers()) as r:
        await r.read()


async def _accept_length(url: str) -> float | None:
    """`GET /get_server_info` as the official client reads it inside the timed window."""
    async with _session() as s, s.get(url, headers=auth_headers()) as r:
        if r.status != 200:
            return None
        info = await r.json(content_type=None)
    if "decode" in info:
        info = info["decode"][0]
    states = info.get("internal_states")
    return states[0].get("avg_spec_accept_length") if states else None


async def run_tier_async(base_url: str, requests: list[BenchRequest], max_concurrency: int | None,
                         flush_cache: bool = True, warmup_requests: int = 1,
                         on_start: Callable[[], None] | None = None,
                         on_done: Callable[[RequestResult], None] | None = None) -> TierRun:
    base = base_url.rstrip("/")
    api = base + "/generate"
    if not requests:
        raise ValueError("no requests to run (every row was pruned or the file is empty)")
    first = requests[0]
    warm = await asyncio.gather(*(stream_request(api, first.prompt, first.prompt_len,
                                                 min(first.output_len, WARMUP_MAX_TOKENS))
                                  for _ in range(warmup_requests)))
    if warmup_requests > 0 and not any(w.success for w in warm):
        raise RuntimeError(f"warm-up failed: {warm[0].error}")
    if flush_cache:
        await _post_ignore(base + "/flush_cache")
    # the official client blocks here with time.sleep; nothing else runs on its loop either
    time.sleep(FLUSH_SLEEP_S)

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(r: BenchRequest) -> RequestResult:
        if sem is None:
            res = await stream_request(api, r.prompt, r.prompt_len, r.output_len)
        else:
            async with sem:
                res = await stream_request(api, r.prompt, r.prompt_len, r.output_len)
        if on_done:
            on_done(res)
        return res

    if on_start:
        on_start()
    start = time.perf_counter()
    tasks = [asyncio.create_task(one(r)) for r in requests]
    results = list(await asyncio.gather(*tasks))
    accept = await _accept_length(base + "/get_server_info")
    duration = time.perf_counter() - start
    return TierRun(duration, results, accept, max_concurrency, window_start=start)


def run_tier(base_url: str, requests: list[BenchRequest], max_concurrency: int | None,
             progress: bool = True, desc: str = "") -> TierRun:
    """`run_tier_async` with a progress bar over the timed requests."""
    bars = []

    def start() -> None:  # the bar's clock starts with the timed window, not the warm-up
        from tqdm import tqdm

        bars.append(tqdm(total=len(requests), desc=desc or None, file=sys.stderr, unit="req"))

    try:
        return asyncio.run(run_tier_async(base_url, requests, max_concurrency,
                                          on_start=start if progress else None,
                                          on_done=(lambda _r: bars[0].update(1)) if progress else None))
    finally:
        for bar in bars:
            bar.close()
