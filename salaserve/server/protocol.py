"""Request models of the OpenAI routes and the two error shapes.

Errors look like SGLang's: on `/v1/*` the OpenAI shape
`{"object": "error", "message", "type", "param", "code"}`, elsewhere `{"error": {"message"}}`.
Unknown request fields are ignored, as SGLang does.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error that becomes an HTTP response in the route's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def openai_error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"object": "error", "message": message, "type": ERROR_TYPES.get(status, "BadRequestError"),
            "param": param, "code": status}


def native_error_body(status: int, message: str) -> dict:
    return {"error": {"message": message}}


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    return openai_error_body(status, message, param) if is_openai_path(path) else native_error_body(status, message)


def error_response(path: str, status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param), status_code=status, headers=headers)


def describe_validation_error(e: ValidationError) -> str:
    """Pydantic's error list as one line: `field.sub: message; ...`."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x not in ("body",))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


# ---- OpenAI request models ------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields the two OpenAI routes share; None means 'the default'."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    rid: str | None = None
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    separate_reasoning: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] | list[list[int]]


# ---- request bodies -------------------------------------------------------------------------------
JSON_MEDIA_TYPES = ("application/json",)
# Native routes also read these as JSON: no content type, and what `curl -d` sends by default.
LENIENT_MEDIA_TYPES = ("", "application/x-www-form-urlencoded")


# A JSON `\uD800`-`\uDFFF` escape. Raw UTF-8 cannot carry a surrogate (decoding the body fails
# first), so only bodies with such an escape can hold one; a valid pair decodes to one character.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def is_valid_unicode(s: str) -> bool:
    """False for a string holding a lone surrogate (no UTF-8 form: no tokenizer or response takes it)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not is_valid_unicode(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def reject_lone_surrogates(raw: bytes, body: Any) -> None:
    """400 if any string of the parsed JSON body holds a lone surrogate; the parsed body is walked
    only when the raw bytes hold a surrogate escape at all."""
    if SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(body):
        raise ApiError(400, "the request contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                            "pair), which is not valid Unicode text")


async def read_json(request, openai: bool) -> Any:
    """The request body as JSON. The OpenAI routes insist on `Content-Type: application/json`
    (as SGLang's do); native routes also take a body sent without one, or as curl's default.
    Strings with a lone surrogate are refused here, for every route."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    json_like = media in JSON_MEDIA_TYPES or media.endswith("+json")
    if not json_like and (openai or media not in LENIENT_MEDIA_TYPES):
        raise ApiError(400, f"Unsupported Media Type: {media or 'none'}; only 'application/json' is allowed")
    raw = await request.body()
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    reject_lone_surrogates(raw, body)
    return body


def parse_model(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ApiError(400, describe_validation_error(e)) from None
