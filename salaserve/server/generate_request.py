"""SGLang's `/generate` request body (GenerateReqInput), checked and split into one item per prompt.

Exactly one of `text` (str or list of str) or `input_ids` (list of ints or list of lists) is
given; a list makes it a batch, and then `sampling_params`, `rid`, `return_logprob` and
`top_logprobs_num` may be lists with one entry per prompt. Fields that ask for something
salaserve does not do (LoRA, images, input embeddings, prompt logprobs) are rejected; fields
that change nothing (`lora_path: null`, `return_routed_experts: false`, ...) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from salaserve.server.protocol import ApiError

REJECTED_IF_SET = {
    "input_embeds": "input_embeds are not supported",
    "image_data": "image inputs are not supported",
    "video_data": "video inputs are not supported",
    "audio_data": "audio inputs are not supported",
    "session_params": "sessions are not supported",
}
REJECTED_IF_TRUE = {
    "return_hidden_states": "return_hidden_states is not supported",
}


@dataclass
class GenerateItem:
    text: str | None
    input_ids: list[int] | None
    sampling_params: dict
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    priority: int
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this token on (-1: none)


@dataclass
class GenerateRequest:
    items: list[GenerateItem]
    is_batch: bool
    stream: bool
    return_text_in_logprobs: bool


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _prompts(body: dict) -> tuple[list, bool, str]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and ids is not None:
        raise bad("give either text or input_ids, not both", "text")
    if text is None and ids is None:
        raise bad("Either text or input_ids should be provided.", "text")
    if text is not None:
        if isinstance(text, str):
            if not text:
                raise bad("text: the prompt must not be empty", "text")
            return [text], False, "text"
        if isinstance(text, list) and text:
            for t in text:
                if not isinstance(t, str) or not t:
                    raise bad("text: a batch must be a list of non-empty strings", "text")
            return list(text), True, "text"
        raise bad("text: must be a non-empty string or a non-empty list of strings", "text")
    if isinstance(ids, list) and ids:
        if all(_is_int(t) for t in ids):
            return [list(ids)], False, "input_ids"
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in ids):
            return [list(p) for p in ids], True, "input_ids"
    raise bad("input_ids: must be a non-empty list of integers or a non-empty list of such lists", "input_ids")


def _per_prompt(body: dict, key: str, n: int, default: Any, is_batch: bool) -> list:
    """One value per prompt: a scalar applies to all; a batch may give a list of n."""
    v = body.get(key)
    if v is None:
        return [default] * n
    if isinstance(v, list) and (is_batch or key == "sampling_params"):
        if len(v) != n:
            raise bad(f"{key}: a list must have one entry per prompt ({n}), got {len(v)}", key)
        return [default if x is None else x for x in v]
    return [v] * n


def parse_generate_request(body: Any) -> GenerateRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, why in REJECTED_IF_SET.items():
        if body.get(key) not in (None, [], {}):
            raise bad(f"{key}: {why}", key)
    for key, why in REJECTED_IF_TRUE.items():
        if body.get(key) not in (None, False):
            raise bad(f"{key}: {why}", key)
    lora = body.get("lora_path")
    if lora is not None and not (isinstance(lora, list) and all(x is None for x in lora)):
        raise bad("lora_path: LoRA adapters are not supported", "lora_path")

    prompts, is_batch, kind = _prompts(body)
    n = len(prompts)
    sampling = _per_prompt(body, "sampling_params", n, {}, is_batch)
    rids = _per_prompt(body, "rid", n, None, is_batch)
    if not is_batch and isinstance(body.get("rid"), list):
        raise bad("rid: must be a string for a single prompt", "rid")
    if is_batch and isinstance(body.get("rid"), str):
        raise bad("rid: a batch needs a list of rids, one per prompt", "rid")
    logprob = _per_prompt(body, "return_logprob", n, False, is_batch)
    top_num = _per_prompt(body, "top_logprobs_num", n, 0, is_batch)
    start_len = _per_prompt(body, "logprob_start_len", n, -1, is_batch)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream: must be a boolean, got {stream!r}", "stream")
    text_in_lp = body.get("return_text_in_logprobs", False)
    if not isinstance(text_in_lp, (bool, type(None))):
        raise bad(f"return_text_in_logprobs: must be a boolean, got {text_in_lp!r}", "return_text_in_logprobs")
    priority = body.get("priority")
    priority = 0 if priority is None else priority
    if not _is_int(priority):
        raise bad(f"priority: must be an integer, got {priority!r}", "priority")

    items = []
    for i in range(n):
        if not isinstance(sampling[i], dict):
            raise bad(f"sampling_params: must be an object, got {sampling[i]!r}", "sampling_params")
        if rids[i] is not None and (not isinstance(rids[i], str) or not rids[i]):
            raise bad(f"rid: must be a non-empty string, got {rids[i]!r}", "rid")
        if not isinstance(logprob[i], bool):
            raise bad(f"return_logprob: must be a boolean, got {logprob[i]!r}", "return_logprob")
        if not _is_int(top_num[i]) or top_num[i] < 0:
            raise bad(f"top_logprobs_num: must be a non-negative integer, got {top_num[i]!r}", "top_logprobs_num")
        if start_len[i] is None:
            start_len[i] = -1
        if not _is_int(start_len[i]) or start_len[i] < -1:
            raise bad(f"logprob_start_len: must be an integer >= -1, got {start_len[i]!r}", "logprob_start_len")
        items.append(GenerateItem(
            text=prompts[i] if kind == "text" else None, input_ids=prompts[i] if kind == "input_ids" else None,
            sampling_params=sampling[i], rid=rids[i], return_logprob=logprob[i], top_logprobs_num=top_num[i],
            priority=priority, logprob_start_len=start_len[i]))
    if len({it.rid for it in items if it.rid is not None}) < sum(it.rid is not None for it in items):
        raise bad("rid: the rids of a batch must be distinct", "rid")
    return GenerateRequest(items=items, is_batch=is_batch, stream=stream, return_text_in_logprobs=bool(text_in_lp))
