"""Offline API: `LLM(model=dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools

from salaserve.config import EngineArgs
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.engine.output import GenerationOutput, RequestStream


def load_tokenizer(model_dir: str):
    from salaserve.model.hf_tokenizer import load_tokenizer as load

    return load(model_dir)


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        self.engine = Engine(EngineArgs(model=model, **kwargs))
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel ranks (--tp-size > 1); a no-op for one rank."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def config(self):
        return self.engine.cfg

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer(prompt).input_ids  # BOS + text, as SGLang tokenizes `text`
        return list(prompt)

    def chat_ids(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of `messages` rendered by the model's chat template, with the generation prompt."""
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 **template_kwargs)
        return ids if isinstance(ids, list) else list(ids["input_ids"])  # transformers 5: a BatchEncoding

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: int | list[int] = 0) -> list[GenerationOutput]:
        """One output per prompt (str or token-id list), in order. Bad input raises ValueError
        naming the field before anything runs."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        prios = priority if isinstance(priority, list) else [priority] * n
        if len(params) != n or len(prios) != n:
            raise ValueError("sampling_params / priority: one per prompt")
        encoded = [self.encode(p) for p in prompts]
        rids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, ids, p, prio in zip(rids, encoded, params, prios):
                self.engine.add_request(rid, ids, p, prio)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            raise
        streams = {rid: RequestStream(self.tokenizer, p, ids) for rid, ids, p in zip(rids, encoded, params)}
        self.run_until_done(streams)
        return [streams[rid].result(rid) for rid in rids]

    def run_until_done(self, streams: dict[str, RequestStream]) -> None:
        pending = set(streams)
        while pending:
            for out in self.engine.step():
                stream = streams.get(out.rid)
                if stream is None:
                    continue
                delta = stream.process(out)
                if delta.finished:
                    if not out.finished:  # a stop string ended it: free its resources now
                        self.engine.abort(out.rid, reason=stream.finish_reason)
                    pending.discard(out.rid)
