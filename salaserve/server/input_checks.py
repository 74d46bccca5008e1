"""Checks on prompt text that run before any tokenizer sees it: valid Unicode (no lone UTF-16
surrogate), no NUL character, and no prompt longer in characters than could possibly fit the
context (ServerState.max_prompt_chars).

Every failure is an ApiError 400 naming the field, so a bad prompt never reaches the tokenizer
(where a lone surrogate raised a TypeError, i.e. a 500) nor costs tokenizer time.
"""

from __future__ import annotations

from salaserve.server.protocol import ApiError, is_valid_unicode


def check_prompt_text(text: str, field: str, max_chars: int | None, context_length: int) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise ApiError(400, f"{field}: the prompt is {len(text)} characters long; no text over {max_chars} "
                            f"characters fits the model's context length of {context_length} tokens", field)
    if "\x00" in text:
        raise ApiError(400, f"{field}: the prompt contains a NUL character (\\u0000)", field)
    if not is_valid_unicode(text):
        raise ApiError(400, f"{field}: the prompt contains a lone UTF-16 surrogate, which is not valid Unicode", field)
