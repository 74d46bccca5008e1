"""Text <-> token ids in the server process (the engine only sees ids).

Encoding never runs on the event loop, and one client's long prompt never holds up another's
short one:
- texts go to the `tokenizers` backend's batch encoder, which releases the GIL while it works
  (its single-text `encode` does not: a 3M-character prompt froze the whole server for ~2 s);
- short texts (up to LONG_TEXT_CHARS in one call) and long ones have separate worker threads, so a
  short prompt waits at most for other short prompts.
The backend is used directly only when it gives the same ids as the transformers tokenizer on a
few probe texts; otherwise (a slow or custom tokenizer) every call goes through the transformers
tokenizer on one thread, as a tokenizer object that is called and mutated (transformers sets its
truncation state per call) must not be used from two threads at once.

Decoding of generated tokens (small, per token) stays inline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("salaserve.server")

LONG_TEXT_CHARS = 50_000  # ~10 ms of tokenizer time: more goes to the long-text thread
PROBE_TEXTS = ("Hello, world!", "  leading spaces\tand\ttabs\n\nnew lines  ", "数字 12345 和 émoji 🙂",
               "<|im_start|>user\nhi<|im_end|>", "</s><s> special looking text")

# Normalizers and pre-tokenizers that never drop input characters (they map, insert or split):
# the prompt-length bound of max_chars_per_token holds only for tokenizers made of these.
KEEPING_NORMALIZERS = {"Prepend", "Replace", "Lowercase", "NFD", "NFKD", "ByteLevel"}
KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from salaserve.model.hf_tokenizer import load_tokenizer as load

    return load(model_dir, trust_remote_code)


def _keeps_characters(component: dict | None, keeping: set[str]) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return all(_keeps_characters(p, keeping) for p in parts)
    if kind == "Replace":  # keeps characters only when it swaps a fixed string for one as long or longer
        pattern = (component.get("pattern") or {}).get("String")
        return pattern is not None and len(pattern) <= len(component.get("content") or "")
    if kind == "Split" and component.get("behavior") == "Removed":
        return False
    return kind in keeping


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text one token can stand for, or None when that cannot be bounded
    from the vocabulary.

    Why this bounds prompt lengths: a BPE tokenizer whose normalizer and pre-tokenizer only map,
    insert or split characters (never drop them) covers every character of the text by some
    token, and a token covers at most as many characters as its vocabulary entry has (byte-level
    entries spell one byte per character, byte-fallback entries like <0xE4> six characters for
    one byte: both over-count, which only loosens the bound). So a text of more than
    context_length * max_chars_per_token characters has more tokens than the context holds, and
    can be refused without tokenizing it. Anything else (a normalizer that strips or composes,
    WordPiece's [UNK] for a whole word, BPE fusing unknown characters) gets no bound: None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # a run of unknown characters may become one token
    if not _keeps_characters(spec.get("normalizer"), KEEPING_NORMALIZERS):
        return None
    if not _keeps_characters(spec.get("pre_tokenizer"), KEEPING_PRE_TOKENIZERS):
        return None
    pieces = list(model.get("vocab") or {}) + [t.get("content", "") for t in spec.get("added_tokens") or []]
    return max((len(p) for p in pieces), default=0) or None


def _backend_if_consistent(tokenizer):
    """The `tokenizers` backend, if encoding with it gives what the transformers tokenizer gives."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return None
    try:
        for special in (True, False):
            want = [list(tokenizer(t, add_special_tokens=special).input_ids) for t in PROBE_TEXTS]
            got = [list(e.ids) for e in backend.encode_batch(list(PROBE_TEXTS), add_special_tokens=special)]
            if got != want:
                log.warning("the tokenizer backend's ids differ from the tokenizer's: tokenizing on one thread")
                return None
    except Exception as e:  # an unusual tokenizer: take the plain path
        log.warning("tokenizer backend unusable (%s): tokenizing on one thread", e)
        return None
    return backend


class Tokenization:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = _backend_if_consistent(tokenizer)
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # (without the backend, one thread for all: see the module docstring)
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-long") if self._backend \
            else self._short

    async def _run(self, num_chars: int, fn, *args):
        pool = self._long if num_chars > LONG_TEXT_CHARS else self._short
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _encode_now(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if self._backend is not None:
            fast = getattr(self._backend, "encode_batch_fast", None)  # no offsets: less time and memory
            encodings = (fast or self._backend.encode_batch)(texts, add_special_tokens=add_special_tokens)
            return [list(e.ids) for e in encodings]
        return [list(self.tokenizer(t, add_special_tokens=add_special_tokens).input_ids) for t in texts]

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`tokenizer(text)` as SGLang does for `text` prompts: BOS + text by default."""
        return (await self.encode_many([text], add_special_tokens))[0]

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return await self._run(sum(map(len, texts)), self._encode_now, texts, add_special_tokens)

    async def encode_chat(self, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None,
                          continue_final_message: bool = False, check_text=None) -> list[int]:
        """Render with the model's chat template, then tokenize without special tokens (the
        template already emits BOS). Template failures are the request's fault: ValueError.
        `check_text(rendered)` runs before tokenizing and may raise (e.g. too long)."""

        def render_and_encode() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=not continue_final_message,
                    continue_final_message=continue_final_message, tools=tools, **(template_kwargs or {}))
            except Exception as e:  # jinja2 errors, raise_exception() in the template, bad kwargs
                raise ValueError(f"messages: the chat template could not render them: {e}") from e
            if not isinstance(text, str):
                raise ValueError("messages: the chat template did not render to text")
            if check_text is not None:
                check_text(text)
            return self._encode_now([text], False)[0]

        size = sum(len(m.get("content") or "") for m in messages if isinstance(m.get("content"), str))
        return await self._run(size, render_and_encode)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def decode_many(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Decoding off the event loop, for requests (/detokenize) that may carry many ids."""
        return await self._run(sum(map(len, seqs)), lambda: [self.decode(ids, skip_special_tokens) for ids in seqs])

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprob listings show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def close(self) -> None:
        self._short.shutdown(wait=False, cancel_futures=True)
        self._long.shutdown(wait=False, cancel_futures=True)
