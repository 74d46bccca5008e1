"""A request's life in the engine: its tokens, resources and finish reason."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is an entity: identity, not field-by-field equality
class Request:
    rid: str
    prompt_ids: list[int]
    params: Any  # SamplingParams
    priority: int = 0  # higher first; FCFS among equals
    # this sequence's position within its client's request (a batch's prompts times n): within a
    # priority, lower ranks are admitted first, so one request's many sequences cannot keep a later
    # request's first one waiting behind all of them (each request gets its share of the slots)
    share_rank: int = 0
    arrival: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_counter))

    tokens: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V and state are in the caches
    pages: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: dict | None = None
    sampling: Any = None  # the sampler's per-request state
    num_preemptions: int = 0
    drafter: Any = None  # speculative decoding: the request's n-gram index
    spec_k: int = 0  # current draft length (adaptive)
    spec_verify_ct: int = 0  # verify steps run for this request
    spec_accepted: int = 0  # draft tokens accepted over them
    first_token_time: float | None = None
    # Prompt logprobs (params.logprob_start_len >= 0): per prompt token from that index on,
    # (logprob or None for the first token, token id, [(id, logprob), ...] or None); filled by
    # the prefill chunks, which compute the logprobs of prompt tokens from prompt_lp_next on.
    prompt_logprobs: list | None = None
    prompt_lp_next: int = 0
    prompt_lp_sent: bool = False
    score_only: bool = False  # nothing to generate (max_new_tokens 0, or no room): the prompt is only scored
    # prefix cache: a prefill chunk ends here and the caches are kept as an entry (the prompt's
    # common prefix with an earlier one, see Engine._reuse_cached_prompts); 0: none
    cache_split: int = 0
    cached_tokens: int = 0  # prompt tokens copied in (prefix cache or a twin's prefill), not computed
    prefix_checked: int = -1  # the prefix cache's version when this request last found no entry in it

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next sample (1 while decoding, more while (re)prefilling)."""
        return len(self.tokens) - self.num_computed

    @property
    def prompt_lp_pending(self) -> bool:
        """Prompt tokens whose logprobs are still to be computed."""
        return self.prompt_logprobs is not None and self.prompt_lp_next < self.num_prompt

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_output > 0

    def sort_key(self):
        return (-self.priority, self.share_rank, self.arrival, self.order)


def _fcfs(req: Request):
    return req.sort_key()


def _longest_output_first(req: Request):
    """Within a priority and share rank, the request that may generate the most tokens first (no
    limit counts as the most), then arrival. With many requests queued at once, the long decodes
    start early and run beside the later prefills instead of trailing after the last one."""
    limit = req.params.max_new_tokens
    return (-req.priority, req.share_rank, -(limit if limit is not None else float("inf")), req.arrival, req.order)


# --schedule-policy: the order waiting requests are admitted in (SGLang's names)
ADMISSION_ORDERS: dict[str, Callable[[Request], tuple]] = {"fcfs": _fcfs, "lof": _longest_output_first}


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict | None
    num_prompt: int
    num_output: int
    logprobs: list | None = None  # per new token: (logprob, [(id, logprob), ...] or None)
    # the request's prompt logprobs (Request.prompt_logprobs), once, in its first output after them
    prompt_logprobs: list | None = None
    spec_verify_ct: int = 0  # cumulative speculative verify steps of the request
    spec_accepted: int = 0  # cumulative accepted draft tokens
    cached_tokens: int = 0  # prompt tokens the request did not compute (SGLang's meta_info.cached_tokens)
    num_preemptions: int = 0  # times the request was preempted so far (SGLang's meta_info.total_retractions)


def length_reason(n: int) -> dict:
    return {"type": "length", "length": n}


def stop_reason(matched) -> dict:
    return {"type": "stop", "matched": matched}


ABORT_REASON = {"type": "abort"}
