"""The small models' data: the corpus' training split divided into train and validation files,
and each file as one token document. Shared by the trainer and its evaluation."""

from __future__ import annotations

import os

from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files

VAL_EVERY, VAL_OFFSET = 20, 10  # validation files: train-split index % 20 == 10


def train_val_files(max_files: int | None = None) -> tuple[list[str], list[str]]:
    """The training split of the corpus, divided into (train, validation) files."""
    files = stdlib_corpus_files("train")
    train = [p for i, p in enumerate(files) if i % VAL_EVERY != VAL_OFFSET]
    val = [p for i, p in enumerate(files) if i % VAL_EVERY == VAL_OFFSET]
    if max_files is not None:  # small runs (tests): a prefix of each list
        train, val = train[:max_files], val[:max(1, max_files // 4)]
    return train, val


def load_tokenizer(model_dir: str):
    """The raw `tokenizers` tokenizer of a model directory (no transformers)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def encode_documents(tok, files: list[str]) -> list[list[int]]:
    """Each file as <s> + text + </s> (ids 1 and 2), without the tokenizer's own BOS."""
    return encode_texts(tok, [read_corpus_file(p) for p in files])


def encode_texts(tok, texts: list[str]) -> list[list[int]]:
    """Each text as <s> + text + </s> (ids 1 and 2), without the tokenizer's own BOS."""
    from salaserve.model.tokenizer import BOS_ID, EOS_TEXT_ID

    return [[BOS_ID] + e.ids + [EOS_TEXT_ID] for e in tok.encode_batch(texts, add_special_tokens=False)]
