"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/tokenize,
/v1/detokenize (also as /tokenize and /detokenize).

Chat prompts are rendered with the model's chat template and tokenized without special tokens
(the template emits BOS); completion prompts are tokenized with BOS, as SGLang does. Reasoning
(`<think>...`) stays inside `content`: like SGLang without --reasoning-parser.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from salaserve.core.sampling_params import GRAMMAR_KEYS
from salaserve.server.auth import request_owner
from salaserve.server.generation import RequestGroup, run_unless_disconnected
from salaserve.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest, openai_error_body, parse_model, read_json)
from salaserve.server.responses import (chat_logprobs, completion_logprobs, group_usage, joined_logprobs,
                                        matched_stop, openai_finish_reason, prompt_completion_logprobs)
from salaserve.server.routes_native import server_state
from salaserve.server.sse import DONE, EventStreamResponse, event
from salaserve.server.state import ServerState

log = logging.getLogger("salaserve.server")
router = APIRouter()

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")


# ---- models ----------------------------------------------------------------------------------------------
def model_card(state: ServerState) -> dict:
    name = state.args.model_name
    return {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": state.client.info.get("context_length")}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(server_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state = server_state(request)
    if model_id != state.args.model_name:
        raise ApiError(404, f"The model '{model_id}' does not exist", "model")
    return model_card(state)


# ---- shared request handling ------------------------------------------------------------------------------
def sampling_dict(req, max_new_tokens: int | None) -> dict:
    d = {"max_new_tokens": max_new_tokens, "n": req.n, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
         "ignore_eos": req.ignore_eos, "min_new_tokens": req.min_tokens,
         "skip_special_tokens": req.skip_special_tokens, "no_stop_trim": req.no_stop_trim, "seed": req.seed,
         "logit_bias": req.logit_bias or None}
    d.update({k: getattr(req, k) for k in SAMPLING_FIELDS if getattr(req, k) is not None})
    # structured output: OpenAI's response_format, or SGLang's own json_schema / regex / ebnf /
    # structural_tag fields (and its stop_regex), taken from the request's extra fields as SGLang's
    # OpenAI routes do
    extra = req.model_extra or {}
    d.update({k: extra[k] for k in GRAMMAR_KEYS + ("stop_regex",) if extra.get(k) is not None})
    schema = response_format_schema(getattr(req, "response_format", None) or extra.get("response_format"))
    if schema is not None:
        if any(k in d for k in GRAMMAR_KEYS):
            raise ApiError(400, f"response_format: give it or {' / '.join(GRAMMAR_KEYS)}, not both", "response_format")
        d["json_schema"] = schema
    return d


def response_format_schema(fmt) -> str | None:
    """The JSON schema (as a string) that OpenAI's response_format asks for, or None for text."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema: must be a JSON schema object", "response_format")
        return json.dumps(schema)
    raise ApiError(400, f"response_format {kind!r} is not supported (text, json_object, json_schema)",
                   "response_format")


def checked_max_tokens(value: int | None, name: str, context_length: int, auto_truncate: bool = False) -> int | None:
    """A positive count within the context; with --allow-auto-truncate a larger one passes, to be
    lowered once the prompt's length is known (as SGLang does)."""
    if value is None:
        return None
    if value <= 0:
        raise ApiError(400, f"{name} must be positive, got {value}", name)
    if value > context_length and not auto_truncate:
        raise ApiError(400, f"{name} ({value}) is larger than the model's context length ({context_length})", name)
    return value


def with_logprobs(state: ServerState, params, top: int, name: str):
    params.logprobs, params.top_logprobs = True, top
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(400, f"{name}: {e}", name) from None
    return params


def add_samples(state: ServerState, group: RequestGroup, ids: list[int], base, rid: str | None = None) -> list:
    params = dataclasses.replace(base)
    ids = state.fit_to_context(ids, params)
    siblings = state.siblings(params)
    return [group.add(ids, p, 0, rid=rid if len(siblings) == 1 else None) for p in siblings]


async def finish_non_stream(request: Request, group: RequestGroup):
    try:
        seqs = await run_unless_disconnected(request, group.wait())
    finally:
        group.cancel()
    if seqs is not None:
        errors = [s.error for s in seqs if s.error]
        if errors:
            raise ApiError(500, errors[0])
    return seqs


def response_head(kind: str, model: str | None, state: ServerState) -> dict:
    return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model or state.args.model_name}


# ---- /v1/completions ----------------------------------------------------------------------------------------
def completion_prompts(prompt) -> list:
    """str | [str] | [int] | [[int]] -> a list of prompts (str or id list); empty ones are errors."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ApiError(400, "Prompt cannot be empty", "prompt")
    return prompts


@router.post("/v1/completions")
async def completions(request: Request):
    state = server_state(request)
    state.require_ready()
    req: CompletionRequest = parse_model(CompletionRequest, await read_json(request, openai=True))
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    prompts = completion_prompts(req.prompt)
    base = state.sampling_params(sampling_dict(req, checked_max_tokens(req.max_tokens, "max_tokens",
                                                                       state.context_length,
                                                                       state.args.allow_auto_truncate)))
    state.check_request_size(len(prompts), len(prompts) * base.n, "prompt")
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        state.check_text(text, "prompt")
    encoded = iter(await state.tokenization.encode_many(texts) if texts else [])
    if req.logprobs is not None:
        base = with_logprobs(state, base, req.logprobs, "logprobs")
        if req.echo:  # the echoed prompt's tokens come with their logprobs too
            base.logprob_start_len = 0
    group = state.new_group(request_owner(request.scope))
    echo = []
    for prompt in prompts:
        ids = next(encoded) if isinstance(prompt, str) else list(prompt)
        seqs = add_samples(state, group, ids, base, rid=req.rid if len(prompts) == 1 else None)
        text = (prompt if isinstance(prompt, str) else state.tokenization.decode(ids)) if req.echo else ""
        echo.extend([text] * len(seqs))
    await state.start(group)
    head = response_head("text_completion", req.model, state)
    token_text = state.tokenization.token_text

    def logprobs_of(seq, pairs, ids, offset, with_prompt=False):
        if req.logprobs is None:
            return None
        out = completion_logprobs(pairs, ids, token_text, offset)
        if with_prompt and seq.prompt_logprobs is not None:
            out = joined_logprobs(prompt_completion_logprobs(seq.prompt_logprobs, token_text, offset), out)
        return out

    if req.stream:
        return EventStreamResponse(_completion_stream(state, group, req, head, echo, logprobs_of))
    seqs = await finish_non_stream(request, group)
    if seqs is None:
        return Response(status_code=499)
    choices = [{"index": s.index, "text": echo[s.index] + s.text,
                "logprobs": logprobs_of(s, s.logprobs, s.token_ids, len(echo[s.index]), with_prompt=req.echo),
                "finish_reason": openai_finish_reason(s), "matched_stop": matched_stop(s)} for s in seqs]
    return JSONResponse({**head, "choices": choices, "usage": group_usage(seqs, state.args.enable_cache_report),
                         "metadata": {"weight_version": "default"}})


def _completion_stream(state, group, req, head, echo, logprobs_of):
    sent = [0] * len(group.seqs)  # text characters sent per choice (logprob offsets)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    async def chunks():
        async for updates in group.updates(state.args.stream_interval):
            for u in updates:
                seq = group.seqs[u.index]
                if seq.error:
                    yield event({"error": openai_error_body(500, seq.error)})
                    continue
                text = u.text
                first = echo[u.index] and sent[u.index] == 0
                if first:
                    text = echo[u.index] + text
                if not text and not u.finished and not (req.logprobs is not None and u.token_ids):
                    continue
                # (the echoed prompt's logprobs go with the first chunk, as its text does)
                offset = len(echo[u.index]) if first else sent[u.index]
                choice = {"index": u.index, "text": text,
                          "logprobs": logprobs_of(seq, u.logprobs, u.token_ids, offset, with_prompt=first),
                          "finish_reason": openai_finish_reason(seq), "matched_stop": matched_stop(seq)}
                sent[u.index] += len(text)
                usage = group_usage(group.seqs, state.args.enable_cache_report) if continuous else None
                yield event({**head, "choices": [choice], "usage": usage})

    return _openai_stream("/v1/completions", chunks(), group, req, head, state.args.enable_cache_report)


async def _openai_stream(route, chunks, group, req, head, cache_report: bool):
    """What every OpenAI stream shares around its chunks: the optional usage chunk, `[DONE]`, an
    error event if something breaks, and the engine requests freed however the stream ends."""
    try:
        async for e in chunks:
            yield e
        if req.stream_options and req.stream_options.include_usage:
            yield event({**head, "choices": [], "usage": group_usage(group.seqs, cache_report)})
        yield DONE
    except Exception as e:
        log.exception("%s stream failed", route)
        yield event({"error": openai_error_body(500, f"internal error: {e}")})
        yield DONE
    finally:
        group.cancel()


# ---- /v1/chat/completions ------------------------------------------------------------------------------------
def template_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        content = d.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(part["text"])
            d["content"] = "\n".join(parts)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = server_state(request)
    state.require_ready()
    req: ChatCompletionRequest = parse_model(ChatCompletionRequest, await read_json(request, openai=True))
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    ctx, auto_truncate = state.context_length, state.args.allow_auto_truncate
    if req.max_completion_tokens is not None:
        max_new = checked_max_tokens(req.max_completion_tokens, "max_completion_tokens", ctx, auto_truncate)
    else:
        max_new = checked_max_tokens(req.max_tokens, "max_tokens", ctx, auto_truncate)
    base = state.sampling_params(sampling_dict(req, max_new))
    if req.logprobs:
        base = with_logprobs(state, base, req.top_logprobs or 0, "top_logprobs")
    state.check_request_size(1, base.n, "messages")
    try:
        ids = await state.tokenization.encode_chat(
            template_messages(req), tools=req.tools, template_kwargs=req.chat_template_kwargs,
            continue_final_message=req.continue_final_message,
            check_text=lambda text: state.check_text(text, "messages"))  # the rendered prompt
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    if not ids:
        raise ApiError(400, "messages: the chat template rendered an empty prompt", "messages")
    group = state.new_group(request_owner(request.scope))
    add_samples(state, group, ids, base, rid=req.rid)
    await state.start(group)
    head = response_head("chat.completion", req.model, state)
    token_text = state.tokenization.token_text

    if req.stream:
        head["object"] = "chat.completion.chunk"
        return EventStreamResponse(_chat_stream(state, group, req, head, token_text))
    seqs = await finish_non_stream(request, group)
    if seqs is None:
        return Response(status_code=499)
    choices = [{"index": s.index,
                "message": {"role": "assistant", "content": s.text, "reasoning_content": None, "tool_calls": None},
                "logprobs": chat_logprobs(s.logprobs, s.token_ids, token_text) if req.logprobs else None,
                "finish_reason": openai_finish_reason(s), "matched_stop": matched_stop(s)} for s in seqs]
    return JSONResponse({**head, "choices": choices, "usage": group_usage(seqs, state.args.enable_cache_report),
                         "metadata": {"weight_version": "default"}})


def _chat_stream(state, group, req, head, token_text):
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def chunk(index, delta, finish_reason=None, logprobs=None, **extra):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **extra}
        usage = group_usage(group.seqs, state.args.enable_cache_report) if continuous else None
        return event({**head, "choices": [choice], "usage": usage})

    async def chunks():
        for seq in group.seqs:
            yield chunk(seq.index, {"role": "assistant", "content": ""})
        async for updates in group.updates(state.args.stream_interval):
            for u in updates:
                seq = group.seqs[u.index]
                if seq.error:
                    yield event({"error": openai_error_body(500, seq.error)})
                    continue
                if u.text or (req.logprobs and u.token_ids):
                    lp = chat_logprobs(u.logprobs, u.token_ids, token_text) if req.logprobs else None
                    yield chunk(u.index, {"content": u.text}, logprobs=lp)
                if u.finished:
                    yield chunk(u.index, {}, openai_finish_reason(seq), matched_stop=matched_stop(seq))

    return _openai_stream("/v1/chat/completions", chunks(), group, req, head, state.args.enable_cache_report)


# ---- tokenize / detokenize ----------------------------------------------------------------------------------------
@router.post("/v1/tokenize")
@router.post("/tokenize")
async def tokenize(request: Request):
    state = server_state(request)
    state.require_ready()
    req: TokenizeRequest = parse_model(TokenizeRequest, await read_json(request, openai=request.url.path.startswith("/v1")))
    prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    state.check_request_size(len(prompts), len(prompts), "prompt")
    for text in prompts:
        state.check_text(text, "prompt")
    tokens = await state.tokenization.encode_many(prompts, req.add_special_tokens)
    if isinstance(req.prompt, str):
        return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": state.context_length}
    return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": state.context_length}


@router.post("/v1/detokenize")
@router.post("/detokenize")
async def detokenize(request: Request):
    state = server_state(request)
    state.require_ready()
    req: DetokenizeRequest = parse_model(DetokenizeRequest,
                                         await read_json(request, openai=request.url.path.startswith("/v1")))
    batch = bool(req.tokens) and isinstance(req.tokens[0], list)
    seqs = req.tokens if batch else [req.tokens]
    vocab = state.client.info["vocab_size"]
    state.check_request_size(len(seqs), len(seqs), "tokens")
    for ids in seqs:
        if len(ids) > state.context_length:
            raise ApiError(400, f"tokens: {len(ids)} ids; at most the context length ({state.context_length}) "
                                "per sequence", "tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    texts = await state.tokenization.decode_many(seqs)
    return {"text": texts if batch else texts[0]}
