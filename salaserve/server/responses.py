"""Response bodies built from finished (or running) sequences, in SGLang's and OpenAI's shapes."""

from __future__ import annotations

import math

from salaserve.server.generation import Sequence

WEIGHT_VERSION = "default"
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; OpenAI-compatible servers send this instead


def finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


# ---- SGLang-native -------------------------------------------------------------------------------
def meta_info(seq: Sequence, return_logprob: bool = False, top_logprobs_num: int = 0, token_text=None) -> dict:
    """meta_info with SGLang's keys, in its order; `token_text(id)` when logprobs carry text."""
    m = {
        "id": seq.rid,
        "finish_reason": dict(seq.finish_reason) if seq.finished and seq.finish_reason else None,
        "prompt_tokens": seq.prompt_tokens,
        "weight_version": WEIGHT_VERSION,
        "total_retractions": seq.num_preemptions,
        "completion_tokens": seq.completion_tokens,
        "cached_tokens": seq.cached_tokens,
    }
    if return_logprob:
        def entry(lp, tid):  # (the first prompt token's logprob is None, as SGLang's)
            return [None if lp is None else finite(lp), tid, token_text(tid) if token_text else None]

        prompt = seq.prompt_logprobs or []
        m["input_token_logprobs"] = [entry(lp, tid) for lp, tid, _ in prompt]
        m["output_token_logprobs"] = [entry(lp, tid) for (lp, _), tid in zip(seq.logprobs, seq.token_ids)]
        if top_logprobs_num > 0:
            m["input_top_logprobs"] = [None if top is None else [entry(lp, tid) for tid, lp in top]
                                       for _, _, top in prompt]
            m["output_top_logprobs"] = [[entry(lp, tid) for tid, lp in (top or [])] for _, top in seq.logprobs]
    verify_ct = getattr(seq, "spec_verify_ct", 0)
    if verify_ct:  # speculative decoding: verify steps and tokens emitted per verify
        m["spec_verify_ct"] = verify_ct
        m["spec_accept_length"] = (seq.spec_accepted + verify_ct) / verify_ct
    if seq.finished:
        m["e2e_latency"] = seq.e2e_latency
    return m


def native_output(seq: Sequence, return_logprob: bool = False, top_logprobs_num: int = 0, token_text=None) -> dict:
    return {"text": seq.text, "output_ids": list(seq.token_ids),
            "meta_info": meta_info(seq, return_logprob, top_logprobs_num, token_text)}


# ---- OpenAI ----------------------------------------------------------------------------------------
def openai_finish_reason(seq: Sequence) -> str | None:
    if not seq.finished or not seq.finish_reason:
        return None
    kind = seq.finish_reason.get("type")
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(kind, kind)


def matched_stop(seq: Sequence):
    r = seq.finish_reason
    return r.get("matched") if r and r.get("type") == "stop" else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI usage; cached_tokens (with --enable-cache-report, as SGLang) fills prompt_tokens_details."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
            "reasoning_tokens": 0}


def group_usage(seqs: list[Sequence], cache_report: bool = False) -> dict:
    """Each distinct prompt counted once (not once per `n` sample), completions summed; with
    cache_report, the cached prompt tokens of each distinct prompt (its best sample's)."""
    prompts, cached = {}, {}
    for s in seqs:
        prompts.setdefault(id(s.prompt_ids), s.prompt_tokens)
        cached[id(s.prompt_ids)] = max(cached.get(id(s.prompt_ids), 0), s.cached_tokens)
    return usage(sum(prompts.values()), sum(s.completion_tokens for s in seqs),
                 sum(cached.values()) if cache_report else None)


def completion_logprobs(pairs: list, token_ids: list[int], token_text, offset: int = 0) -> dict:
    """The /v1/completions `logprobs` object for some tokens; `offset`: text length before them."""
    tokens, offsets = [], []
    for tid in token_ids:
        offsets.append(offset)
        t = token_text(tid)
        tokens.append(t)
        offset += len(t)
    return {
        "text_offset": offsets,
        "token_logprobs": [finite(lp) for lp, _ in pairs],
        "tokens": tokens,
        "top_logprobs": [{token_text(t): finite(v) for t, v in (top or [])} for _, top in pairs],
    }


def prompt_completion_logprobs(prompt: list, token_text, end: int) -> dict:
    """The /v1/completions `logprobs` object for an echoed prompt (Sequence.prompt_logprobs, from
    its first token) whose text is `end` characters long: the first token has no logprob (null), as
    OpenAI's legacy API. Offsets count back from the end of the echoed text, so that a leading
    special token the text does not show (BOS) sits at 0."""
    tokens = [token_text(tid) for _, tid, _ in prompt]
    offsets, start = [], end
    for t in reversed(tokens):
        start -= len(t)
        offsets.append(max(0, start))
    return {
        "text_offset": offsets[::-1],
        "token_logprobs": [None if lp is None else finite(lp) for lp, _, _ in prompt],
        "tokens": tokens,
        "top_logprobs": [None if lp is None else {token_text(t): finite(v) for t, v in (top or [])}
                         for lp, _, top in prompt],
    }


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two /v1/completions `logprobs` objects, one after the other (echoed prompt, completion)."""
    return {k: first[k] + then[k] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


def chat_logprobs(pairs: list, token_ids: list[int], token_text) -> dict:
    def item(tid, lp):
        t = token_text(tid)
        return {"token": t, "bytes": list(t.encode("utf-8")), "logprob": finite(lp)}

    return {"content": [{**item(tid, lp), "top_logprobs": [item(t, v) for t, v in (top or [])]}
                        for (lp, top), tid in zip(pairs, token_ids)]}
