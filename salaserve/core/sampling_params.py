"""Per-request sampling parameters, with SGLang's field names, defaults and JSON keys.

`SamplingParams.from_dict` parses the `sampling_params` object of SGLang's `/generate` request;
`validate` checks ranges and types and raises `ValueError` naming the field and the bad value,
so the server can answer 400 with that message as is.

Logprob options live here too (`logprobs`, `top_logprobs`): SGLang passes them as top-level
request fields (`return_logprob`, `top_logprobs_num`); the HTTP layer maps them onto these.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is greedy (SGLang's _SAMPLING_EPS): sampled as top_k=1.
GREEDY_EPS = 1e-6
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # OpenAI's range for frequency/presence penalties
# logit_bias values: OpenAI documents -100..100, SGLang sets no bound. Accepted up to this
# magnitude, which keeps a biased fp32 logit finite after division by the smallest sampled
# temperature (1e-6): 1e9 / 1e-6 = 1e15.
MAX_ABS_LOGIT_BIAS = 1e9

# SGLang sampling_params keys that salaserve does not implement. A request that sets one of them
# (to anything but null) is rejected rather than silently served without the constraint.
UNSUPPORTED_KEYS: dict[str, str] = {}
# SGLang keys that are accepted and ignored: they do not change what is generated.
IGNORED_KEYS = frozenset({"stream_interval", "custom_params"})
_BOOL_FIELDS = (
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "logprobs"
)
# SGLang spelling -> our field.
ALIASES = {"sampling_seed": "seed"}


# sampling_params keys, in the order they are checked: at most one may be set
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def grammar_spec(params) -> tuple[str, str] | None:
    """(key, value) of the request's structured-output constraint, or None; ValueError if more
    than one is set or the value is not a string."""
    set_keys = [k for k in GRAMMAR_KEYS if getattr(params, k) is not None]
    if not set_keys:
        return None
    if len(set_keys) > 1:
        raise ValueError(f"sampling_params: set one of {', '.join(GRAMMAR_KEYS)}, got {', '.join(set_keys)}")
    key = set_keys[0]
    value = getattr(params, key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"sampling_params.{key}: must be a non-empty string, got {value!r}")
    return key, value


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128  # None: up to the context limit (the scheduler clamps)
    temperature: float = 1.0  # < GREEDY_EPS: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    # SGLang's stop_regex: generation ends at the token that completes a match of any pattern in
    # the output text (output.StopRegexMatcher); the text is kept whole, as SGLang does
    stop_regex: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # True: keep the matched stop string in the output text
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # top alternatives per position, 0..MAX_TOP_LOGPROBS
    # SGLang's logprob_start_len: >= 0 also returns the logprobs of the prompt tokens from this
    # index on (the first prompt token has none); -1: none
    logprob_start_len: int = -1
    n: int = 1
    # token id -> added to its logit before sampling (OpenAI / SGLang `logit_bias`; JSON gives the
    # ids as strings, `validate` makes them ints)
    logit_bias: dict[int, float] | None = None
    # structured output (engine/grammar.py): at most one of a JSON schema (as a JSON string), a
    # regular expression, an EBNF grammar (xgrammar's dialect, root rule `root`)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's (a JSON string): free text with tagged JSON structures
    # Accepted SGLang keys we do not act on (kept so a request can be echoed back).
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # --- derived views -------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature ~ 0 (SGLang maps it to top_k=1) or top_k == 1."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    # --- parsing -----------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        d: dict[str, Any] | None,
        vocab_size: int | None = None,
        max_new_tokens_cap: int | None = None,
    ) -> "SamplingParams":
        """Parse and validate SGLang's JSON `sampling_params`.

        A null value means "default" (clients often send every key). Unknown keys and set
        unsupported keys raise `ValueError` naming them.
        """
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        unknown = []
        for key, value in d.items():
            if key in UNSUPPORTED_KEYS:
                if value is not None:
                    raise ValueError(f"sampling_params.{key}: {UNSUPPORTED_KEYS[key]}")
            elif key in IGNORED_KEYS:
                extra[key] = value
            elif key in names or key in ALIASES:
                name = ALIASES.get(key, key)
                if value is None:
                    continue
                if name in kwargs and kwargs[name] != value:
                    raise ValueError(
                        f"sampling_params.{key} conflicts with {name}={kwargs[name]!r}"
                    )
                kwargs[name] = value
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"unknown sampling_params key(s): {', '.join(sorted(unknown))}")
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            kwargs["max_new_tokens"] = None
        params = cls(**kwargs, extra=extra)
        params.validate(vocab_size=vocab_size, max_new_tokens_cap=max_new_tokens_cap)
        return params

    # --- validation --------------------------------------------------------------------

    def validate(
        self, vocab_size: int | None = None, max_new_tokens_cap: int | None = None
    ) -> None:
        """Raise `ValueError("<field> ...: got <value>")` for the first bad field."""
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _check_float("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        rp_max = MAX_REPETITION_PENALTY
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, rp_max, low_open=True)
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, 0, max_new_tokens_cap)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        _check_int("logprob_start_len", self.logprob_start_len, -1)
        _check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**64 - 1)
        self._validate_stop(vocab_size)
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias, vocab_size)
        grammar_spec(self)  # types and exclusivity; the engine compiles it

    def _validate_stop(self, vocab_size: int | None) -> None:
        stop = self.stop
        if stop is not None:
            if not isinstance(stop, (str, list, tuple)):
                raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
            strs = [stop] if isinstance(stop, str) else list(stop)
            if len(strs) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(strs)}"
                )
            for s in strs:
                if not isinstance(s, str):
                    raise ValueError(f"stop entries must be strings, got {s!r}")
                if not s:
                    raise ValueError(f"stop strings must be non-empty, got {s!r}")
        if self.stop_regex is not None:
            pats = self.stop_regex
            if not isinstance(pats, (str, list, tuple)):
                raise ValueError(f"stop_regex must be a string or a list of strings, got {pats!r}")
            pats = [pats] if isinstance(pats, str) else list(pats)
            if len(pats) > MAX_STOP_STRINGS:
                raise ValueError(f"stop_regex must have at most {MAX_STOP_STRINGS} patterns, got {len(pats)}")
            for p in pats:
                if not isinstance(p, str) or not p:
                    raise ValueError(f"stop_regex entries must be non-empty strings, got {p!r}")
                try:
                    re.compile(p)
                except re.error as e:
                    raise ValueError(f"stop_regex: {p!r} is not a valid regular expression ({e})") from None
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple, set)):
                raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
            for t in ids:
                _check_int("stop_token_ids", t, 0, None if vocab_size is None else vocab_size - 1)


def _checked_logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float] | None:
    """logit_bias as {token id: float} (ids may come as JSON strings), or ValueError naming the
    bad entry; an empty map is no bias (None)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {bias!r}")
    out: dict[int, float] = {}
    hi = None if vocab_size is None else vocab_size - 1
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            text = key.strip()
            token = int(text) if text.lstrip("+-").isdigit() else None
        if not _is_int(token):
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        _check_int("logit_bias token id", token, 0, hi)
        _check_float(f"logit_bias[{token}]", value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
        if token in out:  # e.g. "5" and "05"
            raise ValueError(f"logit_bias lists token {token} more than once")
        out[token] = float(value)
    return out or None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> None:
    if not _is_int(v):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {v!r}")


def _check_float(name: str, v: Any, lo: float, hi: float, low_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v!r}")
    if (v <= lo if low_open else v < lo) or v > hi:
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{lo}, {hi}], got {v!r}")
