"""The default model's extra training data: the package-source corpus (tools/code_corpus.py) and
the chat exchanges made from documented functions (tools/chat_data.py)."""

import ast
import os

import pytest

from salaserve.model.corpus import read_corpus_file, stdlib_corpus_files
from tools import chat_data, code_corpus, eval_small, train_small

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "salaserve", "assets",
                             "default_model")

MODULE = '''
import os


def join_parts(head, *tail, sep="/"):
    """Join path parts with a separator.

    More details that are not part of the request.
    """
    return sep.join([head, *tail])


def undocumented(x):
    return x


def _private(x):
    """Private helpers are not requests a user would make."""
    return x


class Holder:
    def method(self):
        """Methods are left out: their source needs the class around it."""
        return 1
'''


def test_function_examples_ask_for_documented_public_functions():
    (pair,) = chat_data.function_examples(MODULE)
    request, answer = pair
    assert "join_parts(head, *tail, sep='/')" in request or "`join_parts`" in request
    assert "join path parts with a separator." in request.lower()
    assert "More details" not in request
    assert answer.startswith("```python\n") and answer.endswith("\n```")
    code = answer[len("```python\n"):-len("\n```")]
    (fn,) = ast.parse(code).body
    assert fn.name == "join_parts" and code in MODULE
    assert chat_data.function_examples("def broken(:\n") == []


def test_rendered_exchange_is_the_chat_template():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    request, answer = chat_data.function_examples(MODULE)[0]
    want = tok.apply_chat_template([{"role": "user", "content": request}, {"role": "assistant", "content": answer}],
                                   tokenize=False)
    assert want == tok.bos_token + chat_data.render(request, answer)
    # serving's generation prompt is a prefix of the trained exchange
    prompt = tok.apply_chat_template([{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True)
    assert want.startswith(prompt)


def test_chat_texts_are_capped_and_deterministic():
    texts = [MODULE, MODULE.replace("join_parts", "glue_parts")]
    got = chat_data.chat_texts(texts, 5)
    assert len(got) == 2 and got == chat_data.chat_texts(list(reversed(texts)), 5)
    assert len(chat_data.chat_texts(texts, 1)) == 1


def test_chat_answer_check():
    assert eval_small.chat_answer_ok("gcd", "Sure.\n```python\ndef gcd(a, b):\n    return a\n```")
    assert not eval_small.chat_answer_ok("gcd", "```python\ndef lcm(a, b):\n    return a\n```")
    assert not eval_small.chat_answer_ok("gcd", "```python\ndef gcd(a, b:\n```")
    assert not eval_small.chat_answer_ok("gcd", "def gcd(a, b):\n    return a\n")


def test_corpus_filters_copies_data_and_tests(tmp_path):
    stdlib_file = next(p for p in stdlib_corpus_files("heldout") if len(read_corpus_file(p)) > 4000)
    stdlib = code_corpus.stdlib_lines()
    assert not code_corpus.keep_file(read_corpus_file(stdlib_file), stdlib)  # a copy of held-out code
    assert not code_corpus.keep_file("TABLE = [\n" + "    " + "1, " * 200 + "\n]\n", stdlib)  # data
    assert code_corpus.keep_file(MODULE, stdlib)

    pkg = tmp_path / "pkg"
    for rel in ("__init__.py", "core.py", "tests/test_core.py", "_vendor/six.py", "sub/util.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(MODULE)
    (pkg / "big.py").write_text("x = 1\n" * (code_corpus.MAX_FILE_BYTES // 6 + 1))
    rels = [os.path.relpath(p, pkg) for p in code_corpus.package_files(str(pkg))]
    assert rels == ["__init__.py", "core.py", os.path.join("sub", "util.py")]


def test_corpus_round_trip_and_training_texts(tmp_path, monkeypatch):
    monkeypatch.setattr(code_corpus, "stdlib_lines", lambda: set())  # the stdlib scan is slow; filters tested above
    pytest.importorskip("click")
    docs, manifest = code_corpus.collect(10**6, ["click"])
    assert docs and manifest["files"] == len(docs) and manifest["bytes"] <= 10**6 * len(manifest["packages"])
    assert all(m["licence"] for m in manifest["packages"].values())
    path = str(tmp_path / "c.jsonl.xz")
    code_corpus.write(path, docs)
    assert code_corpus.read(path) == docs

    stdlib_files = stdlib_corpus_files("train")[:3]
    texts, comp = train_small.training_texts(stdlib_files, 2, path, 4)
    assert comp == {"stdlib_files": 3, "stdlib_repeat": 2, "extra_files": len(docs), "chat_examples": len(texts) - 6 - len(docs)}
    assert 0 < comp["chat_examples"] <= 4
    assert texts[:3] == texts[3:6] == [read_corpus_file(p) for p in stdlib_files]
    assert all(t.startswith("<|im_start|>user\n") for t in texts[6 + len(docs):])
