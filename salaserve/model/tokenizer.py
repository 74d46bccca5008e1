"""The tokenizer and chat template that every salaserve-written checkpoint carries.

`write_tokenizer(out_dir, vocab_size)` writes a complete Hugging Face tokenizer (loadable by
`transformers.AutoTokenizer.from_pretrained(out_dir)` without remote code, and by
`tokenizers.Tokenizer.from_file(out_dir/"tokenizer.json")`):

    tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja

Token-id layout (the model config depends on it; `V` = vocab_size >= 8192):

    0 .. 8183        base byte-level BPE (salaserve/assets/bpe_base.json):
                     <unk>=0, <s>=1 (BOS), </s>=2 (EOS of plain text / pad)
    8184 .. V-9      <|reserved_0|>, <|reserved_1|>, ... (special fillers; none when V == 8192)
    V-8 .. V-1       config.TAIL_SPECIAL_TOKENS: <|im_end|> (V-8; 73440 for the real 73448),
                     <|im_start|> (V-7), <think>, </think>, <|reserved_tail_0..3|>

All added tokens are matched in raw text as single tokens. `<think>` and `</think>` are *not*
special (they survive `decode(skip_special_tokens=True)`); everything else added is special.

Special-token roles (tokenizer_config.json):
  * bos_token `<s>`, prepended to every encoding by default (`add_bos_token`, as MiniCPM does;
    the post-processor in tokenizer.json does the same for the raw `tokenizers` API). No EOS is
    appended.
  * eos_token `<|im_end|>`: chat generation stops on it. The model config's eos_token_id lists
    both 2 (`</s>`) and V-8 (`<|im_end|>`); tokenizers have a single eos_token, and the chat
    one is what `generate`-style callers need.
  * pad_token `</s>` (= config.pad_token_id 2), unk_token `<unk>` (never produced: byte-level).

The chat template is ChatML (see `CHAT_TEMPLATE`): `{{ bos_token }}`, then per message
`<|im_start|>{role}\\n{content}<|im_end|>\\n`; with `add_generation_prompt`, a trailing
`<|im_start|>assistant\\n`, followed by `<think>\\n\\n</think>\\n\\n` when `enable_thinking` is
passed and false (the Qwen3 / MiniCPM4.1 convention; thinking is on by default). Because the
template emits BOS itself, tokenize its output with `add_special_tokens=False` (transformers'
`apply_chat_template(tokenize=True)` does).
"""

from __future__ import annotations

import copy
import json
import os
from functools import lru_cache

from salaserve.config import TAIL_SPECIAL_TOKENS

BASE_VOCAB_SIZE = 8184
MIN_VOCAB_SIZE = BASE_VOCAB_SIZE + len(TAIL_SPECIAL_TOKENS)  # 8192
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN_TEXT = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_TEXT_ID = 0, 1, 2
IM_END, IM_START, THINK_START, THINK_END = TAIL_SPECIAL_TOKENS[:4]
NON_SPECIAL_ADDED = frozenset({THINK_START, THINK_END})
CHAT_EOS_TOKEN = IM_END
PAD_TOKEN = EOS_TOKEN_TEXT
MODEL_MAX_LENGTH = 1048576

ASSET_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "assets", "bpe_base.json")

# ChatML. Whitespace-controlled so that only the {{ }} expressions produce output, whatever the
# renderer's trim_blocks / lstrip_blocks settings. `raise_exception` is provided by transformers;
# other renderers must provide it too (salaserve's does).
CHAT_TEMPLATE = """\
{#- ChatML for MiniCPM-SALA (salaserve). Every tag trims the whitespace around it, so only the
    {{ }} expressions produce output. #}
{%- if messages is string or messages is mapping -%}
    {{- raise_exception('messages must be a list of {role, content} objects') -}}
{%- endif -%}
{{- bos_token -}}
{%- for message in messages -%}
    {%- if message is not mapping or message['role'] is not defined -%}
        {{- raise_exception('every message must be an object with a role') -}}
    {%- endif -%}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
        {{- raise_exception('unsupported message role: ' ~ message['role'] ~ ' (expected system, user, assistant or tool)') -}}
    {%- endif -%}
    {%- set content = message['content'] -%}
    {%- if content is not defined or content is none -%}
        {%- set text = '' -%}
    {%- elif content is string -%}
        {%- set text = content -%}
    {%- elif content is sequence and content is not mapping -%}
        {%- set ns = namespace(text='') -%}
        {%- for part in content -%}
            {%- if part is mapping and part['type'] == 'text' and part['text'] is string -%}
                {%- set ns.text = ns.text ~ part['text'] -%}
            {%- else -%}
                {{- raise_exception('unsupported content part in a ' ~ message['role'] ~ ' message: only {"type": "text", "text": ...} parts are supported') -}}
            {%- endif -%}
        {%- endfor -%}
        {%- set text = ns.text -%}
    {%- else -%}
        {{- raise_exception('unsupported content type in a ' ~ message['role'] ~ ' message: content must be a string or a list of text parts') -}}
    {%- endif -%}
    {{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ text ~ '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def added_token_contents(vocab_size: int) -> list[str]:
    """The added tokens for ids 8184 .. vocab_size-1, in id order."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} ({BASE_VOCAB_SIZE} BPE entries + "
            f"{len(TAIL_SPECIAL_TOKENS)} tail special tokens), got {vocab_size}"
        )
    n_reserved = vocab_size - MIN_VOCAB_SIZE
    return [f"<|reserved_{i}|>" for i in range(n_reserved)] + list(TAIL_SPECIAL_TOKENS)


@lru_cache(maxsize=1)
def _base_tokenizer_json() -> dict:
    with open(ASSET_PATH, encoding="utf-8") as f:
        obj = json.load(f)
    vocab = obj["model"]["vocab"]
    if len(vocab) != BASE_VOCAB_SIZE:
        raise RuntimeError(f"{ASSET_PATH}: {len(vocab)} vocabulary entries, expected {BASE_VOCAB_SIZE}")
    for tok, i in ((UNK_TOKEN, UNK_ID), (BOS_TOKEN, BOS_ID), (EOS_TOKEN_TEXT, EOS_TEXT_ID)):
        if vocab.get(tok) != i:
            raise RuntimeError(f"{ASSET_PATH}: {tok} has id {vocab.get(tok)}, expected {i}")
    return obj


def _added(i: int, content: str, special: bool) -> dict:
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def tokenizer_json(vocab_size: int) -> dict:
    """The tokenizer.json object for `vocab_size` (see the module docstring for the layout)."""
    contents = added_token_contents(vocab_size)
    base = _base_tokenizer_json()
    obj = copy.deepcopy({k: v for k, v in base.items() if k != "added_tokens"})
    added = [_added(t["id"], t["content"], True) for t in base["added_tokens"]]
    added += [_added(BASE_VOCAB_SIZE + k, c, c not in NON_SPECIAL_ADDED) for k, c in enumerate(contents)]
    single = [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    pair = single + [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}]
    obj["post_processor"] = {
        "type": "TemplateProcessing", "single": single, "pair": pair,
        "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [BOS_ID], "tokens": [BOS_TOKEN]}},
    }
    ordered = {}
    for key in ("version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer",
                "post_processor", "decoder", "model"):
        ordered[key] = added if key == "added_tokens" else obj.get(key)
    return ordered


def tokenizer_config(vocab_size: int) -> dict:
    added_token_contents(vocab_size)  # validates
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": CHAT_EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": CHAT_EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "additional_special_tokens": [IM_END, IM_START],
    }


def dump_tokenizer_json(obj: dict) -> str:
    """Deterministic, reasonably diff-friendly serialization of a tokenizer.json object: one
    top-level key per line, and one vocabulary entry / merge / added token per line."""

    def enc(v) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    lines = ["{"]
    keys = list(obj)
    for k_i, key in enumerate(keys):
        val = obj[key]
        comma = "," if k_i < len(keys) - 1 else ""
        if key == "added_tokens" and isinstance(val, list) and val:
            lines.append(f"{enc(key)}:[")
            lines.append(",\n".join(enc(t) for t in val))
            lines.append("]" + comma)
        elif key == "model" and isinstance(val, dict):
            lines.append(f"{enc(key)}:{{")
            mkeys = list(val)
            for m_i, mk in enumerate(mkeys):
                mv = val[mk]
                mcomma = "," if m_i < len(mkeys) - 1 else ""
                if mk == "vocab" and isinstance(mv, dict) and mv:
                    lines.append(f"{enc(mk)}:{{")
                    lines.append(",\n".join(f"{enc(t)}:{i}" for t, i in mv.items()))
                    lines.append("}" + mcomma)
                elif mk == "merges" and isinstance(mv, list) and mv:
                    lines.append(f"{enc(mk)}:[")
                    lines.append(",\n".join(enc(m) for m in mv))
                    lines.append("]" + mcomma)
                else:
                    lines.append(f"{enc(mk)}:{enc(mv)}{mcomma}")
            lines.append("}" + comma)
        else:
            lines.append(f"{enc(key)}:{enc(val)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    chat_template.jinja for a model of `vocab_size` into `out_dir` (created if needed).
    Deterministic: the same vocab_size always gives byte-identical files."""
    tj = tokenizer_json(vocab_size)  # validates vocab_size before anything is written
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _write(os.path.join(out_dir, "tokenizer.json"), dump_tokenizer_json(tj))
    _write(os.path.join(out_dir, "tokenizer_config.json"),
           json.dumps(tokenizer_config(vocab_size), indent=2, ensure_ascii=False) + "\n")
    _write(os.path.join(out_dir, "special_tokens_map.json"),
           json.dumps(special_tokens_map(), indent=2, ensure_ascii=False) + "\n")
    _write(os.path.join(out_dir, "chat_template.jinja"), CHAT_TEMPLATE)
