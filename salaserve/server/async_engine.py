"""Async streaming API: the engine in its own process, driven from asyncio.

    engine = AsyncEngine(model=dir)
    await engine.start()
    async for delta in engine.stream("def f(x):", SamplingParams(max_new_tokens=32)):
        print(delta.text, end="")
    engine.close()

The same machinery as the HTTP server (server/replicas.py, server/generation.py): the
engine loop runs in a separate process and never waits on this one; tokenization and
detokenization happen here. Leaving the loop early (break, cancellation) aborts the request and
frees its pages and state slot.
"""

from __future__ import annotations

from salaserve.config import EngineArgs
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.llm import load_tokenizer
from salaserve.engine.output import Delta
from salaserve.model.default import default_model_dir


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        from salaserve.server.replicas import EngineReplicas

        self.args = args or EngineArgs(**kwargs)
        if self.args.model is None:
            self.args.model = default_model_dir()
        self.tokenizer = load_tokenizer(self.args.model)
        self.client = EngineReplicas([self.args])  # one engine process

    async def start(self) -> dict:
        """Spawn the engine process and wait until the model is loaded."""
        return await self.client.start()

    def close(self) -> None:
        self.client.close()

    async def stream(self, prompt: str | list[int], params: SamplingParams | None = None, priority: int = 0):
        """Yields a Delta per engine update until the request finishes; bad input raises
        ValueError naming the field."""
        from salaserve.server.generation import RequestGroup

        params = params or SamplingParams()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            prompt = self.tokenizer(prompt).input_ids  # BOS + text, as SGLang tokenizes `text`
        group = RequestGroup(self.client, self.tokenizer)
        seq = group.add(list(prompt), params, priority)
        await group.start()
        try:
            async for updates in group.updates():
                for u in updates:
                    yield Delta(text=u.text, token_ids=list(u.token_ids), finished=u.finished,
                                finish_reason=u.finish_reason, completion_tokens=u.completion_tokens,
                                logprobs=list(u.logprobs))
        finally:
            if not seq.finished:
                group.cancel("stream closed")
