"""Streaming text out of token ids: incremental detokenization and stop-string matching.

IncrementalDetokenizer keeps two offsets into the token list (the prefix-offset / read-offset
technique): `prefix_offset..read_offset` is the last emitted window, decoded again as context, and
`read_offset..` are the tokens not yet emitted. The delta is decode(prefix..end) minus
decode(prefix..read). Decoding a window, not the whole text, keeps each call O(window); decoding
the context too keeps decoders that look at neighbours (leading-space rules) exact.

A byte-level BPE token may hold part of a UTF-8 character; the decoder then ends its text with
U+FFFD. Such tokens are held back until the character completes (or `flush` at the end).

Text is decoded with clean_up_tokenization_spaces=False: the clean-up rewrites patterns that can
straddle a window boundary, so it cannot be applied incrementally.
"""

from __future__ import annotations

import re
from typing import Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses the same number).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ):
        """`context_ids`: the prompt's ids (only the last few are used) so that the first
        output token decodes as it would in the middle of the text."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._n_context = len(self._ids)
        self.prefix_offset = 0
        self.read_offset = self._n_context
        # A context ending mid-character would make the prefix text unstable: start clean.
        if self._ids and self._decode(self._ids).endswith(REPLACEMENT_CHAR):
            self._ids, self._n_context, self.read_offset = [], 0, 0
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Output ids so far (without the context)."""
        return self._ids[self._n_context :]

    @property
    def text(self) -> str:
        """Text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly "")."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of request: release held-back text, U+FFFD for an incomplete final character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full = self._decode(self._ids[self.prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a character still incomplete
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


class StopStringMatcher:
    """Finds stop strings in streamed text, across delta boundaries.

    `feed` returns the text that is safe to stream now: it holds back the longest tail that could
    still grow into a stop string. After a match, `matched` names the stop string, `stopped` is
    True and `text` is the final text, cut before the stop string (or after it with
    `no_stop_trim`). When the request ends for another reason, `flush` releases the held tail.

    Matching is eager, as generation must stop as soon as a stop string is complete: within the
    text seen so far the earliest-starting stop string wins (ties: the first in `stops`), and a
    longer stop string that would have started earlier but is not complete yet does not wait.
    """

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(stops)
        self.no_stop_trim = no_stop_trim
        self.matched: str | None = None
        self._pending = ""  # held back: a possible start of a stop string
        self._chunks: list[str] = []

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    @property
    def text(self) -> str:
        """Text released so far (the final text once stopped or flushed)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def feed(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        # Earlier text was released only because no stop string can start there, so searching
        # pending + delta (shorter than the longest stop plus the delta) is enough.
        buf = self._pending + delta
        hit = self._first_match(buf)
        if hit is not None:
            pos, stop = hit
            self.matched = stop
            self._pending = ""
            return self._release(buf[: pos + len(stop)] if self.no_stop_trim else buf[:pos])
        hold = self._partial_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return self._release(buf[: len(buf) - hold])

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return self._release(out)

    def _release(self, s: str) -> str:
        if s:
            self._chunks.append(s)
        return s

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string; on a tie, the first in `stops`."""
        best = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best


class StopRegexMatcher:
    """SGLang's stop_regex: generation ends at the token whose text completes a match of any
    pattern. `feed` takes the new text and returns whether a pattern matched; `matched` then names
    the pattern (SGLang reports the pattern, and keeps the text whole). Each search covers the
    new text and the WINDOW characters before it, so a step costs the same late in a long output
    as early (SGLang searches a tail of the output too); a match longer than that is not seen."""

    WINDOW = 4096

    def __init__(self, patterns: Sequence[str]):
        self.patterns = [(p, re.compile(p)) for p in patterns]
        self.matched: str | None = None
        self._tail = ""

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str) -> bool:
        if self.stopped or not delta:
            return self.stopped
        buf = self._tail + delta
        for source, pattern in self.patterns:
            if pattern.search(buf):
                self.matched = source
                return True
        self._tail = buf[-self.WINDOW:]
        return False
