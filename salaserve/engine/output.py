"""Turns a request's token ids into text: incremental detokenization and stop strings.

Runs beside the engine, not inside its step (in-process for `LLM`, in the server process for
HTTP). A stop string found here ends the request: the caller aborts it in the engine and reports
finish reason `stop` with the matched string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from salaserve.core.request import StepOutput, stop_reason
from salaserve.engine.detokenizer import IncrementalDetokenizer, StopRegexMatcher, StopStringMatcher


@dataclass
class GenerationOutput:
    """One finished request, as the offline API returns it."""

    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list | None = None  # per token: (logprob, [(id, logprob), ...] or None)
    # params.logprob_start_len >= 0: per prompt token from there, (logprob or None, id, top or None)
    prompt_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (or a twin's prefill)


@dataclass
class Delta:
    """What one engine step added to a request, as a stream consumer sees it."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: dict | None
    completion_tokens: int
    logprobs: list = field(default_factory=list)


class RequestStream:
    """Per-request text state: the detokenizer and the stop-string and stop-regex matchers."""

    def __init__(self, tokenizer, params, prompt_ids: list[int]):
        self.params = params
        self.prompt_ids = prompt_ids
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            spaces_between_special_tokens=params.spaces_between_special_tokens)
        stops = params.stop_strs
        self.stops = StopStringMatcher(stops, no_stop_trim=params.no_stop_trim) if stops else None
        regexes = params.stop_regexes
        self.regexes = StopRegexMatcher(regexes) if regexes else None
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.finished = False
        self.finish_reason: dict | None = None
        self.cached_tokens = 0

    def process(self, out: StepOutput) -> Delta:
        """Consume one StepOutput. If a stop string appears or a stop regex matches, the delta is
        final with reason `stop` (the caller must abort the request in the engine)."""
        if self.finished:
            return Delta("", [], True, self.finish_reason, len(self.token_ids))
        self.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        text = self.detok.add(out.new_token_ids)
        if out.finished:
            text += self.detok.flush()
        # the regexes see the text as generated (the stop-string matcher may hold a tail back)
        regex_hit = self.regexes is not None and self.regexes.feed(text)
        if self.stops is not None:
            text = self.stops.feed(text)
            if self.stops.stopped:
                self.finished = True
                self.finish_reason = stop_reason(self.stops.matched)
            elif out.finished or regex_hit:
                text += self.stops.flush()
        if regex_hit and not self.finished:
            self.finished = True
            self.finish_reason = stop_reason(self.regexes.matched)
        if out.finished and not self.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
        self.text += text
        return Delta(text, list(out.new_token_ids), self.finished, self.finish_reason, len(self.token_ids),
                     list(out.logprobs or []))

    def result(self, rid: str) -> GenerationOutput:
        return GenerationOutput(rid=rid, prompt_token_ids=self.prompt_ids, token_ids=list(self.token_ids),
                                text=self.text, finish_reason=self.finish_reason,
                                prompt_tokens=len(self.prompt_ids), completion_tokens=len(self.token_ids),
                                logprobs=self.logprobs or None, prompt_logprobs=self.prompt_logprobs,
                                cached_tokens=self.cached_tokens)
