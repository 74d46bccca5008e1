"""Train the project's base byte-level BPE on the Python standard library's sources.

    python -m tools.train_tokenizer [--out salaserve/assets/bpe_base.json]

The result is the id range 0..8183 of every tokenizer that `salaserve.model.tokenizer` writes:
`<unk>`=0, `<s>`=1, `</s>`=2, then the 256 byte symbols and the learned merges. Byte-level BPE
covers every UTF-8 string (Chinese included) with no unknown token and decodes it back exactly:
there is no normalizer, and the ByteLevel pre-tokenizer adds no prefix space.

Only the training split of `salaserve.model.corpus` is used, so the held-out files stay unseen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BASE_VOCAB_SIZE = 8184
BASE_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
MIN_FREQUENCY = 2


def build_untrained():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    return tok


def train(files: list[str], vocab_size: int = BASE_VOCAB_SIZE):
    """Train on `files`; returns a `tokenizers.Tokenizer` of exactly `vocab_size` entries."""
    from tokenizers import pre_tokenizers, trainers

    from salaserve.model.corpus import read_corpus_file

    tok = build_untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=list(BASE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_corpus_file(p) for p in files), trainer=trainer, length=len(files))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"BPE training produced {got} entries, expected exactly {vocab_size}")
    for i, t in enumerate(BASE_SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"{t} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def main(argv: list[str] | None = None) -> int:
    from salaserve.model.corpus import stdlib_corpus_files
    from salaserve.model.tokenizer import ASSET_PATH, dump_tokenizer_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=ASSET_PATH)
    ap.add_argument("--vocab-size", type=int, default=BASE_VOCAB_SIZE)
    args = ap.parse_args(argv)

    files = stdlib_corpus_files("train")
    n_bytes = sum(os.path.getsize(p) for p in files)
    print(f"corpus: {len(files)} files, {n_bytes / 1e6:.1f} MB (train split)", file=sys.stderr)
    t0 = time.perf_counter()
    tok = train(files, args.vocab_size)
    dt = time.perf_counter() - t0
    text = dump_tokenizer_json(json.loads(tok.to_str()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    print(f"trained {tok.get_vocab_size()} entries in {dt:.1f} s -> {args.out} "
          f"({len(text.encode('utf-8')) / 1e3:.0f} KB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
