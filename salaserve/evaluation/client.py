"""Async OpenAI-chat client that sends eval rows the way the SOAR `eval_model.py` does.

Per serving_protocol.md section 2: one non-streaming `POST /v1/chat/completions` per row with
`{"model", "messages": [{"role": "user", "content": question}], "temperature": 0.0,
"max_tokens": 65536, "stop": [...]}`, nothing else; the prediction is
`choices[0].message.content` (`null` -> ""); any error or non-2xx becomes "" (scored 0).
Stop words are the decoded `eos_token_id`s of the model's generation config plus the
tokenizer's `eos_token`, de-duplicated (for MiniCPM-SALA `["</s>", "<|im_end|>"]`).

Unlike the toolkit, connection errors (server not up yet, restarting, dropped socket) are
retried with backoff, so a flaky start does not silently cost accuracy; HTTP errors are not.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

DEFAULT_MAX_TOKENS = 65536
DEFAULT_STOP = ["</s>", "<|im_end|>"]  # what the toolkit derives for MiniCPM-SALA
READ_TIMEOUT_S = 3000.0  # the toolkit's requests timeout: a per-read limit


@dataclass
class Prediction:
    content: str  # "" when the request failed
    error: str | None = None
    latency_s: float = 0.0
    attempts: int = 1
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def load_stop_words(model_dir: str, trust_remote_code: bool = False) -> list[str]:
    """Stop strings as eval_model.py builds them from the local model directory (its own
    tokenizer code runs only with trust_remote_code)."""
    from transformers import GenerationConfig

    from salaserve.model.hf_tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    words: list[str] = []
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    for i in ([] if eos is None else eos if isinstance(eos, list) else [eos]):
        words.append(tok.decode(i))
    if tok.eos_token:
        words.append(tok.eos_token)
    return list(dict.fromkeys(w for w in words if w))


def stop_words_for(model: str, model_path: str | None = None, trust_remote_code: bool = False) -> list[str]:
    """Stops from `model_path`, else from `model` when that id is a local directory (as the
    platform's is), else the MiniCPM-SALA defaults."""
    for d in (model_path, model):
        if d and os.path.isdir(d):
            return load_stop_words(d, trust_remote_code)
    return list(DEFAULT_STOP)


async def fetch_model_id(url: str, timeout_s: float = 10.0) -> str:
    """`data[0].id` of `GET /v1/models`, as the toolkit picks the model name."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.get(f"{url.rstrip('/')}/v1/models") as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]


def chat_payload(model: str, question: str, max_tokens: int, stop: list[str]) -> dict:
    """The exact request body eval_model.py sends."""
    return {"model": model, "messages": [{"role": "user", "content": question}],
            "temperature": 0.0, "max_tokens": max_tokens, "stop": stop}


def row_prompt(row: dict) -> str:
    """The text to send: `question` (the public set's field), else `input` or `prompt`."""
    for k in ("question", "input", "prompt"):
        if row.get(k) is not None:
            return str(row[k])
    raise KeyError("row has no question, input or prompt")


async def _one(session: aiohttp.ClientSession, url: str, payload: dict, retries: int,
               retry_delay_s: float) -> Prediction:
    t0 = time.perf_counter()
    attempt = 0
    while True:
        attempt += 1
        try:
            async with session.post(url, json=payload) as r:
                if r.status >= 400:
                    body = (await r.text())[:500]
                    return Prediction("", f"HTTP {r.status}: {body}", time.perf_counter() - t0, attempt)
                data = await r.json(content_type=None)
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return Prediction(choice["message"].get("content") or "", None,
                              time.perf_counter() - t0, attempt, choice.get("finish_reason"),
                              usage.get("prompt_tokens"), usage.get("completion_tokens"))
        except (aiohttp.ClientConnectionError, ConnectionError) as e:
            if attempt > retries:
                return Prediction("", f"connection: {e!r}", time.perf_counter() - t0, attempt)
            await asyncio.sleep(retry_delay_s * 2 ** (attempt - 1))
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError,
                TypeError) as e:
            return Prediction("", f"{type(e).__name__}: {e}", time.perf_counter() - t0, attempt)


async def run_eval(url: str, model: str, rows: list[dict], concurrency: int = 8,
                   max_tokens: int = DEFAULT_MAX_TOKENS, stop: list[str] | None = None,
                   retries: int = 5, retry_delay_s: float = 1.0,
                   read_timeout_s: float = READ_TIMEOUT_S,
                   on_done: Callable[[int, Prediction], None] | None = None) -> list[Prediction]:
    """Predictions for `rows` (each with a `question`), in row order, `concurrency` at a time.

    `on_done(index, prediction)` is called as each finishes, for progress output.
    """
    endpoint = f"{url.rstrip('/')}/v1/chat/completions"
    stop = list(DEFAULT_STOP) if stop is None else stop
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def task(i: int, row: dict) -> Prediction:
            async with sem:
                p = await _one(session, endpoint, chat_payload(model, row_prompt(row), max_tokens, stop),
                               retries, retry_delay_s)
            if on_done:
                on_done(i, p)
            return p

        return list(await asyncio.gather(*(task(i, r) for i, r in enumerate(rows))))
