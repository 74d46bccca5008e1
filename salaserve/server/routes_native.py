"""SGLang-native routes: /generate, /flush_cache, /health, /health_generate, /get_model_info,
/get_server_info, /abort_request (with SGLang's aliases)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from salaserve._version import __version__
from salaserve.core.sampling_params import SamplingParams
from salaserve.server.auth import is_admin, request_owner
from salaserve.server.engine_client import EngineUnavailable
from salaserve.server.generate_request import parse_generate_request
from salaserve.server.generation import RequestGroup, run_unless_disconnected
from salaserve.server.protocol import ApiError, read_json
from salaserve.server.responses import native_output
from salaserve.server.sse import DONE, EventStreamResponse, event
from salaserve.server.state import ServerState

log = logging.getLogger("salaserve.server")
router = APIRouter()

FLUSH_NOTE = ("Please check backend logs for more details. (When there are running or waiting requests, "
              "the operation will not be performed.)\n")
HEALTH_GENERATE_TIMEOUT_S = 20.0
GIB = 2**30


def server_state(request: Request) -> ServerState:
    return request.app.state.server


# ---- /generate ---------------------------------------------------------------------------------------
@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    state = server_state(request)
    state.require_ready()
    req = parse_generate_request(await read_json(request, openai=False))
    # the cheap checks first: a request that asks for too much is refused before any tokenizing
    item_params = [item_sampling_params(state, item) for item in req.items]
    state.check_request_size(len(req.items), sum(p.n for p in item_params), "text")
    texts = [item.text for item in req.items if item.text is not None]
    for text in texts:
        state.check_text(text, "text")
    encoded = iter(await state.tokenization.encode_many(texts) if texts else [])
    group = state.new_group(request_owner(request.scope))
    opts = []  # per sequence: (return_logprob, top_logprobs_num)
    aliases = {}
    multi = req.is_batch
    for item, params in zip(req.items, item_params):
        ids = item.input_ids if item.input_ids is not None else next(encoded)
        ids = state.fit_to_context(ids, params)
        siblings = state.siblings(params)
        multi = multi or len(siblings) > 1
        for p in siblings:
            seq = group.add(ids, p, item.priority, rid=item.rid if len(siblings) == 1 else None)
            opts.append((item.return_logprob, item.top_logprobs_num))
            if item.rid and len(siblings) > 1:
                aliases.setdefault(item.rid, []).append(seq.rid)
    state.rid_aliases.update(aliases)
    try:
        await state.start(group)
    except BaseException:
        _drop_aliases(state, aliases)
        raise
    token_text = state.tokenization.token_text if req.return_text_in_logprobs else None

    def body(seq):
        return native_output(seq, *opts[seq.index], token_text=token_text)

    if req.stream:
        return EventStreamResponse(_stream(state, group, body, multi, aliases))
    try:
        seqs = await run_unless_disconnected(request, group.wait())
    finally:
        group.cancel()
        _drop_aliases(state, aliases)
    if seqs is None:  # the client left; nobody reads this
        return Response(status_code=499)
    errors = [s.error for s in seqs if s.error]
    if errors:
        raise ApiError(500, errors[0])
    outs = [body(s) for s in seqs]
    return JSONResponse(outs if multi else outs[0])


def item_sampling_params(state: ServerState, item) -> SamplingParams:
    params = state.sampling_params(item.sampling_params)
    if item.return_logprob:
        params.logprobs, params.top_logprobs = True, item.top_logprobs_num
        params.logprob_start_len = item.logprob_start_len
        try:
            params.validate()
        except ValueError as e:
            raise ApiError(400, f"top_logprobs_num: {e}") from None
    return params


async def _stream(state: ServerState, group: RequestGroup, body, multi: bool, aliases: dict):
    """Cumulative `text` / `output_ids` per event, SGLang-style; an event only once there is text
    (the benchmark client counts only those), and always the final one."""
    try:
        async for updates in group.updates(state.args.stream_interval):
            for u in updates:
                seq = group.seqs[u.index]
                if seq.error:
                    yield event({"error": {"message": seq.error}})
                    continue
                if not seq.text and not u.finished:
                    continue
                out = body(seq)
                if multi:
                    out["index"] = u.index
                yield event(out)
        yield DONE
    except Exception as e:
        log.exception("/generate stream failed")
        yield event({"error": {"message": f"internal error: {e}"}})
        yield DONE
    finally:
        group.cancel()
        _drop_aliases(state, aliases)


def _drop_aliases(state: ServerState, aliases: dict) -> None:
    for rid in aliases:
        state.rid_aliases.pop(rid, None)


# ---- cache, abort ---------------------------------------------------------------------------------------
@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    state = server_state(request)
    state.require_ready()
    try:
        flushed = await state.client.flush_cache()  # every replica's
    except EngineUnavailable as e:
        raise ApiError(503, str(e)) from None
    if flushed:
        return PlainTextResponse("Cache flushed.\n" + FLUSH_NOTE)
    return PlainTextResponse("Cache not flushed. " + FLUSH_NOTE, status_code=400)


@router.post("/abort_request")
async def abort_request(request: Request):
    """Ends the caller's own request `rid` (all its `n` samples); the admin key may end anyone's,
    and alone may use abort_all. A rid that is not the caller's is treated as unknown: 200, no
    effect, as SGLang answers for a request that already finished."""
    state = server_state(request)
    body = await read_json(request, openai=False)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    rid, abort_all = body.get("rid") or "", body.get("abort_all", False)
    if not isinstance(rid, str):
        raise ApiError(400, f"rid: must be a string, got {rid!r}", "rid")
    if not isinstance(abort_all, bool):
        raise ApiError(400, f"abort_all: must be a boolean, got {abort_all!r}", "abort_all")
    admin = is_admin(request.scope, state.args.admin_api_key)
    if abort_all:
        if not admin:
            raise ApiError(403, "abort_all: needs the admin API key (the server's --admin-api-key)", "abort_all")
        state.client.abort_all()
    elif rid:
        owner = None if admin else request_owner(request.scope)
        for r in state.rid_aliases.get(rid, [rid]):
            state.client.abort(r, owner)
    return Response(status_code=200)


# ---- health ----------------------------------------------------------------------------------------------
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    state = server_state(request)
    return Response(status_code=200 if state.ready and not state.client.dead else 503)


@router.api_route("/health_generate", methods=["GET", "HEAD"])
async def health_generate(request: Request):
    """Healthy only if the engine really produces a token."""
    state = server_state(request)
    if not state.ready or state.client.dead:
        return Response(status_code=503)
    group = RequestGroup(state.client, state.tokenization.tokenizer)  # kept out of the metrics
    group.add([state.client.info["bos_token_id"]], SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    try:
        await group.start()
        seq = (await asyncio.wait_for(group.wait(), HEALTH_GENERATE_TIMEOUT_S))[0]
        ok = seq.completion_tokens == 1 and not seq.error
    except Exception:
        ok = False
    finally:
        group.cancel()
    return Response(status_code=200 if ok else 503)


@router.get("/ping")
async def ping():
    return PlainTextResponse("pong")


# ---- info ------------------------------------------------------------------------------------------------
@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request):
    state = server_state(request)
    info = state.client.info
    return {
        "model_path": state.args.model_path, "tokenizer_path": state.args.model_path, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": info.get("model_type"),
        "architectures": info.get("architectures"),
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request):
    """Fast and never fails: SGLang's benchmark calls it inside its timed window and reads
    `internal_states[0]` (avg_spec_accept_length with speculation). With --dp-size N,
    internal_states[0] adds up every serving replica's counters and `dp_replicas` has each one's."""
    state = server_state(request)
    try:
        body = json.dumps(server_info(state), default=str)
    except Exception as e:  # must not fail; report what we can
        log.exception("get_server_info")
        body = json.dumps({"status": "ready" if state.ready else "starting", "internal_states": [{}],
                           "version": __version__, "error": str(e)})
    return Response(body, media_type="application/json")


def server_info(state: ServerState) -> dict:
    pool, args = state.client, state.args
    info, stats, capacity = pool.info, dict(pool.stats), pool.capacity()
    internal = {
        "last_gen_throughput": pool.gen_throughput(),
        "memory_usage": {
            "weight": capacity["weight_bytes"] / GIB,
            "kvcache": (capacity["kv_cache_bytes"] + capacity["state_bytes"]) / GIB,
            "token_capacity": capacity["max_total_num_tokens"],
            "graph": 0,
        },
        "effective_max_running_requests_per_dp": info.get("max_running_requests", state.engine_args.max_running_requests),
        **stats,  # running/queued requests, pages, compressed-key entries, state slots, engine counters
    }
    return {
        **vars(state.engine_args),
        **args.to_dict(),
        "status": "ready" if state.ready else "starting",
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "max_req_input_len": info["context_length"] - 1 if info else None,
        "context_length": info.get("context_length"),
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "backend": info.get("backend"),
        "initial_counters": info.get("initial_counters"),
        "internal_states": [internal],
        "dp_replicas": pool.report(),
        "dp_affinity_hits": pool.router.affinity_hits,
        "version": __version__,
    }
