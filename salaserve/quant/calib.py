"""Calibration (and held-out) token sequences for GPTQ and the quality tool.

Text comes from a JSONL file (`{"text": ...}` rows, or SOAR toolkit rows whose prompt is
`question` / `input` / `prompt`, with `model_response` appended when present, so answers are
calibrated on too) or, by default, from the project corpus (the standard library's sources,
salaserve/model/corpus.py; its "train" split calibrates, "heldout" evaluates). Documents are
tokenized with the model's tokenizer, each prefixed with BOS, packed into one stream and cut into
sequences of `seq_len` tokens. Deterministic for a given file / Python install.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator

from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files


def jsonl_texts(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            text = row.get("text") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict):
                prompt = row.get("question") or row.get("input") or row.get("prompt")
                if prompt is not None:
                    answer = row.get("model_response")
                    text = prompt if answer in (None, "", "placeholder") else f"{prompt}\n{answer}"
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected a 'text' or 'question' string field")
            yield text


def corpus_texts(split: str = "train", stride: int = 7) -> Iterator[str]:
    """Corpus files of `split`, every `stride`-th first (spread over the whole library rather
    than the first packages alphabetically), then the rest."""
    files = stdlib_corpus_files(split)
    order = files[::stride] + [f for i, f in enumerate(files) if i % stride]
    for path in order:
        yield read_corpus_file(path)


def token_sequences(texts: Iterable[str], tokenizer, num_tokens: int, seq_len: int) -> list[list[int]]:
    """Pack tokenized texts into `num_tokens // seq_len` sequences of exactly `seq_len` tokens."""
    if seq_len < 2 or num_tokens < seq_len:
        raise ValueError(f"need seq_len >= 2 and num_tokens >= seq_len, got {seq_len} and {num_tokens}")
    want = num_tokens // seq_len * seq_len
    bos = tokenizer.bos_token_id
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        stream.extend(([bos] if bos is not None else []) + list(ids))
        if len(stream) >= want:
            break
    if len(stream) < seq_len:
        raise ValueError(f"calibration text gave only {len(stream)} tokens; need at least {seq_len}")
    stream = stream[:want]
    return [stream[i:i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def calibration_sequences(tokenizer, num_tokens: int, seq_len: int, path: str | None = None,
                          split: str = "train") -> list[list[int]]:
    texts = jsonl_texts(path) if path else corpus_texts(split)
    return token_sequences(texts, tokenizer, num_tokens, seq_len)
