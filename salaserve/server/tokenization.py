"""Text <-> token ids in the server process (the engine only sees ids).

Encoding runs on one worker thread: a 200K-character prompt takes long enough to tokenize that
doing it on the event loop would stall every other stream; one thread, because a fast tokenizer
object must not be mutated from two threads at once. Decoding (small, per token) stays inline.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from salaserve.model.hf_tokenizer import load_tokenizer as load

    return load(model_dir, trust_remote_code)


class Tokenization:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`tokenizer(text)` as SGLang does for `text` prompts: BOS + text by default."""
        return await self._run(lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids))

    async def encode_chat(self, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None,
                          continue_final_message: bool = False) -> list[int]:
        """Render with the model's chat template, then tokenize without special tokens (the
        template already emits BOS). Template failures are the request's fault: ValueError."""

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=not continue_final_message,
                continue_final_message=continue_final_message, tools=tools, **(template_kwargs or {}))
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)

        try:
            return await self._run(render)
        except Exception as e:  # jinja2 errors, raise_exception() in the template, bad kwargs
            raise ValueError(f"messages: the chat template could not render them: {e}") from e

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprob listings show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
