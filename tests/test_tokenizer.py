"""The base BPE asset, the tokenizer/chat template written into model directories, and the
stdlib corpus split."""

from __future__ import annotations

import json
import os

import pytest

from salaserve.config import TAIL_SPECIAL_TOKENS, preset_config
from salaserve.model import tokenizer as T
from salaserve.model import corpus
from tools.train_tokenizer import BASE_SPECIAL_TOKENS, train

SIZES = (8192, 73448)
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

ENGLISH = "The quick brown fox jumps over the lazy dog.  Twice!\nSecond line, trailing space "
PYTHON = (
    "class Foo(Base):\n"
    "    \"\"\"Docstring with 'quotes'.\"\"\"\n\n"
    "    def bar(self, x: int = 3, *args, **kw) -> dict[str, int]:\n"
    "\tif x >= 0x1F and not kw:  # tab-indented comment\r\n"
    "            return {f\"k{i}\": i ** 2 for i in range(x)}\n"
    "        raise ValueError(r'\\d+\\s*')\n"
)
CHINESE = "你好，世界！今天天气很好。我们来测试一下中文分词：模型、推理、稀疏注意力。"
MIXED = "  leading spaces, emoji 🤖🚀, accents café naïve, CJK 中文 and ｆｕｌｌｗｉｄｔｈ\x00\x7f\n"


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    out = {}
    for v in SIZES:
        d = base / str(v)
        T.write_tokenizer(d, v)
        out[v] = d
    return out


@pytest.fixture(scope="module")
def hf_toks(tok_dirs):
    from transformers import AutoTokenizer

    return {v: AutoTokenizer.from_pretrained(str(d)) for v, d in tok_dirs.items()}


@pytest.fixture(scope="module")
def raw_toks(tok_dirs):
    from tokenizers import Tokenizer

    return {v: Tokenizer.from_file(str(d / "tokenizer.json")) for v, d in tok_dirs.items()}


# ---- base asset -----------------------------------------------------------------------------
def test_base_asset():
    from tokenizers import Tokenizer

    assert os.path.getsize(T.ASSET_PATH) < 1.5 * 1024 * 1024
    tok = Tokenizer.from_file(T.ASSET_PATH)
    assert tok.get_vocab_size(with_added_tokens=True) == T.BASE_VOCAB_SIZE == 8184
    assert [tok.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(8184))
    # All 256 byte symbols are present, so nothing is ever unknown.
    from tokenizers.pre_tokenizers import ByteLevel

    assert all(ch in vocab for ch in ByteLevel.alphabet())
    # It learned code: common Python words are single tokens.
    for word in ("Ġself", "Ġreturn", "Ġdef", "Ġimport"):
        assert word in vocab, word


def test_training_is_deterministic_and_lays_out_specials():
    files = corpus.stdlib_corpus_files("train")[:30]
    a, b = train(files, 1000), train(files, 1000)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 1000
    assert [a.token_to_id(t) for t in BASE_SPECIAL_TOKENS] == [0, 1, 2]


# ---- id layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("v", SIZES)
def test_special_token_ids(hf_toks, raw_toks, v):
    hf, raw = hf_toks[v], raw_toks[v]
    assert len(hf) == v
    assert raw.get_vocab_size(with_added_tokens=True) == v
    expected = {0: "<unk>", 1: "<s>", 2: "</s>", v - 8: "<|im_end|>", v - 7: "<|im_start|>",
                v - 6: "<think>", v - 5: "</think>", v - 1: "<|reserved_tail_3|>"}
    for i, t in expected.items():
        assert hf.convert_ids_to_tokens(i) == t
        assert hf.convert_tokens_to_ids(t) == i
        assert raw.id_to_token(i) == t
        assert raw.token_to_id(t) == i
    for k, t in enumerate(TAIL_SPECIAL_TOKENS):
        assert hf.convert_tokens_to_ids(t) == v - 8 + k
    assert (hf.bos_token, hf.bos_token_id) == ("<s>", 1)
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", v - 8)
    assert (hf.pad_token, hf.pad_token_id) == ("</s>", 2)
    assert (hf.unk_token, hf.unk_token_id) == ("<unk>", 0)
    if v == 73448:
        assert v - 8 == 73440
        assert hf.convert_tokens_to_ids("<|reserved_0|>") == 8184
        assert hf.convert_tokens_to_ids(f"<|reserved_{v - 8192 - 1}|>") == v - 9
    else:
        assert hf.convert_ids_to_tokens(8183) not in T.added_token_contents(v)
    # The ids the model config relies on.
    cfg = preset_config("full" if v == 73448 else "tiny", vocab_size=v)
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.pad_token_id == hf.pad_token_id
    assert set(cfg.eos_token_ids) == {2, hf.eos_token_id}


def test_reserved_fillers_fill_the_gap():
    contents = T.added_token_contents(8200)
    assert contents[:8] == [f"<|reserved_{i}|>" for i in range(8)]
    assert contents[8:] == list(TAIL_SPECIAL_TOKENS)
    assert T.added_token_contents(8192) == list(TAIL_SPECIAL_TOKENS)
    tj = T.tokenizer_json(8200)
    ids = [t["id"] for t in tj["added_tokens"]]
    assert ids == [0, 1, 2] + list(range(8184, 8200))
    special = {t["content"]: t["special"] for t in tj["added_tokens"]}
    assert special["<think>"] is False and special["</think>"] is False
    assert all(s for c, s in special.items() if c not in ("<think>", "</think>"))


@pytest.mark.parametrize("bad", [0, 8183, 8191, -1])
def test_vocab_too_small_raises(tmp_path, bad):
    with pytest.raises(ValueError):
        T.write_tokenizer(tmp_path / "x", bad)
    assert not (tmp_path / "x").exists()


# ---- encoding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("v", SIZES)
def test_bos_prepended_no_eos(hf_toks, raw_toks, v):
    hf, raw = hf_toks[v], raw_toks[v]
    ids = hf("a").input_ids
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids[-1] not in (2, v - 8)
    assert raw.encode("a").ids == ids
    assert hf("a", add_special_tokens=False).input_ids == ids[1:]
    assert raw.encode("a", add_special_tokens=False).ids == ids[1:]


@pytest.mark.parametrize("v", SIZES)
@pytest.mark.parametrize("text", [ENGLISH, PYTHON, CHINESE, MIXED, " x", "\n\n\n", ""])
def test_round_trip(hf_toks, raw_toks, v, text):
    hf, raw = hf_toks[v], raw_toks[v]
    ids = hf(text).input_ids
    assert ids[0] == 1
    assert all(0 < i < T.BASE_VOCAB_SIZE for i in ids[1:])  # plain text never hits added tokens
    assert 0 not in ids  # byte-level: never <unk>
    assert hf.decode(ids, skip_special_tokens=True) == text
    assert hf.decode(ids[1:]) == text
    assert raw.decode(raw.encode(text).ids, skip_special_tokens=True) == text
    assert raw.encode(text).ids == ids


def test_code_compresses(hf_toks):
    hf = hf_toks[8192]
    n = len(hf(PYTHON, add_special_tokens=False).input_ids)
    assert n < len(PYTHON.encode("utf-8")) / 2.5


@pytest.mark.parametrize("v", SIZES)
def test_added_tokens_and_skip_special(hf_toks, raw_toks, v):
    hf, raw = hf_toks[v], raw_toks[v]
    text = "<think>plan</think>answer<|im_end|>"
    ids = hf(text, add_special_tokens=False).input_ids
    assert ids[0] == v - 6 and v - 5 in ids and ids[-1] == v - 8
    assert hf.decode(ids) == text
    assert hf.decode(ids, skip_special_tokens=True) == "<think>plan</think>answer"
    assert raw.decode(ids, skip_special_tokens=True) == "<think>plan</think>answer"
    chat = "<|im_start|>user\nhi<|im_end|>\n"
    cids = hf(chat, add_special_tokens=False).input_ids
    assert cids[0] == v - 7 and cids.count(v - 8) == 1
    assert hf.decode(cids, skip_special_tokens=True) == "user\nhi\n"
    assert hf.decode([1, 2, 0] + cids, skip_special_tokens=True) == "user\nhi\n"
    if v > 8192:
        r = hf("<|reserved_7|>", add_special_tokens=False).input_ids
        assert r == [8191]
        assert hf.decode(r, skip_special_tokens=True) == ""


# ---- chat template --------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]},
]
EXPECTED_PREFIX = (
    "<s><|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nHi 你好<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nPart one, part two.<|im_end|>\n"
)


@pytest.mark.parametrize("v", SIZES)
def test_chat_template(hf_toks, v):
    hf = hf_toks[v]
    render = lambda **kw: hf.apply_chat_template(MESSAGES, tokenize=False, **kw)  # noqa: E731
    assert render() == EXPECTED_PREFIX
    gen = EXPECTED_PREFIX + "<|im_start|>assistant\n"
    assert render(add_generation_prompt=True) == gen
    assert render(add_generation_prompt=True, enable_thinking=True) == gen
    assert render(add_generation_prompt=True, enable_thinking=False) == gen + "<think>\n\n</think>\n\n"
    assert render(add_generation_prompt=False, enable_thinking=False) == EXPECTED_PREFIX

    tool = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None},
            {"role": "tool", "content": "12:00"}]
    assert hf.apply_chat_template(tool, tokenize=False) == (
        "<s><|im_start|>user\ntime?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>tool\n12:00<|im_end|>\n"
    )


@pytest.mark.parametrize("v", SIZES)
def test_chat_template_tokenized_has_one_bos(hf_toks, v):
    hf = hf_toks[v]
    out = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                 enable_thinking=False)
    ids = out["input_ids"] if not isinstance(out, list) else out
    assert ids[0] == 1 and ids.count(1) == 1
    assert ids[1] == v - 7
    assert ids.count(v - 7) == 5 and ids.count(v - 8) == 4
    nl2 = hf.convert_tokens_to_ids("ĊĊ")
    assert ids[-4:] == [v - 6, nl2, v - 5, nl2]  # <think> \n\n </think> \n\n
    text = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert hf(text, add_special_tokens=False).input_ids == ids
    assert hf.decode(ids) == text


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": {"type": "text", "text": "dict, not list"}}],
    [{"role": "user", "content": 42}],
    [{"role": "robot", "content": "hi"}],
])
def test_chat_template_rejects_unsupported(hf_toks, messages):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError):
        hf_toks[8192].apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("trim", [False, True])
def test_chat_template_plain_jinja(trim):
    """Rendered by plain jinja2 (as the server may), with or without transformers' trim
    settings, the template gives the same string."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=trim, lstrip_blocks=trim)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(T.CHAT_TEMPLATE)
    assert tmpl.render(messages=MESSAGES, bos_token="<s>") == EXPECTED_PREFIX
    assert tmpl.render(messages=MESSAGES, bos_token="<s>", add_generation_prompt=True,
                       enable_thinking=False) == (
        EXPECTED_PREFIX + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="unsupported content"):
        tmpl.render(messages=[{"role": "user", "content": [{"type": "audio"}]}], bos_token="<s>")


# ---- files ------------------------------------------------------------------------------------------
def test_files_and_config(tok_dirs):
    d = tok_dirs[73448]
    for f in FILES:
        assert (d / f).is_file(), f
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] == "<s>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "</s>" and cfg["unk_token"] == "<unk>"
    assert cfg["add_bos_token"] is True and cfg["add_eos_token"] is False
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["clean_up_tokenization_spaces"] is False
    assert cfg["model_max_length"] >= 1 << 20
    assert cfg["chat_template"] == (d / "chat_template.jinja").read_text(encoding="utf-8") == T.CHAT_TEMPLATE
    stm = json.loads((d / "special_tokens_map.json").read_text(encoding="utf-8"))
    assert stm["bos_token"] == "<s>" and stm["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("v", SIZES)
def test_write_is_deterministic(tmp_path, tok_dirs, v):
    T.write_tokenizer(tmp_path / "again", v)
    for f in FILES:
        assert (tmp_path / "again" / f).read_bytes() == (tok_dirs[v] / f).read_bytes(), f
    # Overwriting an existing directory gives the same bytes too.
    T.write_tokenizer(tmp_path / "again", v)
    for f in FILES:
        assert (tmp_path / "again" / f).read_bytes() == (tok_dirs[v] / f).read_bytes(), f
    assert sorted(os.listdir(tmp_path / "again")) == sorted(FILES)


# ---- corpus split ------------------------------------------------------------------------------------
def test_corpus_split_disjoint_and_deterministic():
    train_files = corpus.stdlib_corpus_files("train")
    held = corpus.stdlib_corpus_files("heldout")
    every = corpus.stdlib_corpus_files("all")
    assert len(train_files) > 100 and len(held) > 5
    assert not set(train_files) & set(held)
    assert sorted(train_files + held) == every
    assert every == sorted(every, key=lambda p: os.path.relpath(p, corpus.stdlib_dir()).replace(os.sep, "/"))
    assert held == every[::corpus.HELDOUT_EVERY]
    corpus._all_files.cache_clear()
    assert corpus.stdlib_corpus_files("train") == train_files
    assert corpus.stdlib_corpus_files("heldout") == held
    for p in every:
        rel = os.path.relpath(p, corpus.stdlib_dir()).replace(os.sep, "/").split("/")
        assert p.endswith(".py") and os.path.isabs(p)
        assert not {"site-packages", "test", "tests", "idlelib"} & set(rel[:-1]), p
    assert sum(os.path.getsize(p) for p in every) <= corpus.DEFAULT_MAX_BYTES
    with pytest.raises(ValueError):
        corpus.stdlib_corpus_files("validation")


def test_corpus_cap():
    small = corpus.stdlib_corpus_files("all", max_bytes=200_000)
    assert 0 < sum(os.path.getsize(p) for p in small) <= 200_000
    assert small == corpus.stdlib_corpus_files("all")[: len(small)]
