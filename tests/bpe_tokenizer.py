"""A small byte-level BPE tokenizer with BOS, trained on generated text, for CPU tests.

It stands in for the real MiniCPM-SALA tokenizer: loaded through `transformers.AutoTokenizer`,
`encode` adds `<s>` exactly as the real one does, so token counts follow the same rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from salaserve.bench.textgen import TextGen


def build_bpe_tokenizer(out_dir: str | Path, vocab_size: int = 2000, seed: int = 0):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = TextGen(seed)
    corpus = [gen.paragraph(lang, 6) for _ in range(300) for lang in ("en", "zh")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 1 << 30}))
    return AutoTokenizer.from_pretrained(str(out))
