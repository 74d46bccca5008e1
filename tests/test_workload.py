"""Speed workloads: exact output token counts, prompt lengths, shapes, determinism, files."""

import json
import statistics

import pytest

from bpe_tokenizer import build_bpe_tokenizer
from salaserve.bench.tokfit import count_tokens_batch, exact_length_text, fit_units
from salaserve.bench.workload import TIERS, make_workload, workload_shapes, write_workload

QUICK_COUNTS = {"S1": 3, "S8": 2, "Smax": 5}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def quick(tok):
    return make_workload("soar-quick", tok, seed=5, counts=QUICK_COUNTS)


def _check_rows(tok, rows):
    for r in rows:
        # Exactly how sglang.bench_serving sizes the request: BOS included.
        assert len(tok.encode(r["model_response"])) == r["output_tokens"]
        assert len(tok.encode(r["question"])) == r["input_tokens"]
        assert r["output_tokens"] >= 2 and r["input_tokens"] >= 2  # bench_serving drops shorter


def test_toy_exact_lengths(tok):
    w = make_workload("toy", tok, seed=1)
    assert list(w) == list(TIERS)
    for rows in w.values():
        assert len(rows) == 12
        _check_rows(tok, rows)
        for r in rows:
            assert 20 <= r["input_tokens"] <= 300 and 4 <= r["output_tokens"] <= 40
            assert r["input_tokens"] == r["target_input_tokens"]


def test_soar_quick_lengths(tok, quick):
    for tier, rows in quick.items():
        assert len(rows) == QUICK_COUNTS[tier]
        _check_rows(tok, rows)
        for r in rows:
            target = r["target_input_tokens"]
            assert abs(r["input_tokens"] - target) <= max(8, 0.005 * target)
            assert r["model_response"].startswith("<think>")
    cats = [r["category"] for rows in quick.values() for r in rows]
    assert cats.count("code") == 2 and cats.count("doc") == 8


def test_prompts_are_varied_text(tok, quick):
    doc = max((r for rows in quick.values() for r in rows), key=lambda r: r["input_tokens"])
    ids = tok.encode(doc["question"])
    assert len(set(ids)) > 300  # natural text, not one repeated token
    assert any("\u4e00" <= ch <= "\u9fff" for ch in doc["question"])  # Chinese text
    assert any(ch.isascii() and ch.isalpha() for ch in doc["question"])  # and English text


def test_soar_shapes_follow_official_sets():
    shapes = workload_shapes("soar", seed=0)
    assert {t: len(s) for t, s in shapes.items()} == {"S1": 12, "S8": 36, "Smax": 96}
    for tier, n_code in (("S1", 3), ("S8", 8), ("Smax", 20)):
        code = [s for s in shapes[tier] if s.category == "code"]
        docs = [s for s in shapes[tier] if s.category == "doc"]
        assert len(code) == n_code
        assert all(900 <= s.input_tokens <= 1150 and 8000 <= s.output_tokens <= 12000 for s in code)
        assert all(11_000 <= s.input_tokens <= 175_000 and 200 <= s.output_tokens <= 2500 for s in docs)
    smax_docs = [s.input_tokens for s in shapes["Smax"] if s.category == "doc"]
    assert 100_000 <= statistics.median(smax_docs) <= 130_000
    quick = workload_shapes("soar-quick", seed=0)
    assert [s.input_tokens for s in quick["S1"]] == [s.input_tokens // 8 for s in shapes["S1"]]
    assert [s.output_tokens for s in quick["S1"]] == [s.output_tokens // 8 for s in shapes["S1"]]


def test_micro_shapes_and_text(tok):
    shapes = workload_shapes("micro", seed=0)
    for s in shapes.values():
        assert sorted((x.input_tokens, x.output_tokens) for x in s) == \
            [(1024, 256)] * 4 + [(8192, 256)] * 4 + [(32768, 256)] * 4
    w = make_workload("micro", tok, seed=0, counts={"S1": 1, "S8": 1, "Smax": 1})
    for rows in w.values():
        _check_rows(tok, rows)
        assert rows[0]["output_tokens"] == 256


def test_deterministic_files(tok, tmp_path):
    a = write_workload(tmp_path / "a", "toy", tok, seed=3)
    b = write_workload(tmp_path / "b", "toy", tok, seed=3)
    c = write_workload(tmp_path / "c", "toy", tok, seed=4)
    for tier in TIERS:
        fa, fb, fc = ((tmp_path / d / f"{tier}.jsonl").read_bytes() for d in "abc")
        assert fa == fb and fa != fc
    assert a == b and a != c


def test_write_workload_format(tok, tmp_path, quick):
    m = write_workload(tmp_path, "soar-quick", tok, seed=5, workload=quick)
    assert json.loads((tmp_path / "manifest.json").read_text()) == m
    assert m["name"] == "soar-quick" and m["seed"] == 5
    for tier in TIERS:
        lines = (tmp_path / f"{tier}.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(x) for x in lines]
        assert len(rows) == QUICK_COUNTS[tier] == m["tiers"][tier]["requests"]
        assert all(set(r) == {"question", "model_response"} for r in rows)
        meta = m["tiers"][tier]["rows"]
        assert [len(tok.encode(r["model_response"])) for r in rows] == [x["output_tokens"] for x in meta]
        assert m["tiers"][tier]["output_tokens"] == sum(x["output_tokens"] for x in meta)


def test_exact_length_text_handles_merges(tok):
    # Chinese characters merge into multi-char tokens, so a prefix cut needs fillers to land.
    units = list("研究了新的方法，发现了古老的系统。" * 40)
    for target in (2, 3, 17, 64, 101):
        assert len(tok.encode(exact_length_text(tok, units, target))) == target
    with pytest.raises(ValueError):
        exact_length_text(tok, list("短"), 50)


def test_batch_counts_match_encode(tok, quick):
    texts = [r["question"] for rows in quick.values() for r in rows][:4] + ["", "a b"]
    assert count_tokens_batch(tok, texts) == [len(tok.encode(t)) for t in texts]


def test_fit_units_search():
    calls = []

    def count(s):
        calls.append(s)
        return len(s)

    n, text, c = fit_units(lambda k: "ab" * k, count, 101, n_hint=3)
    assert (n, c) == (50, 100) and text == "ab" * 50
    assert len(calls) < 12
    n, _, c = fit_units(lambda k: "ab" * min(k, 10), len, 101, n_hint=3, n_max=10)
    assert (n, c) == (10, 20)  # out of material: everything there is
    assert fit_units(lambda k: "x" * (k + 5), len, 3)[0] == 0  # even n = 0 is too long


def test_make_workload_command(tok, tmp_path):
    """`salaserve bench make-workload` writes the same files as write_workload, deterministically."""
    from salaserve.cli import main

    model_dir = tok.name_or_path
    for name in ("a", "b"):
        assert main(["bench", "make-workload", "--workload", "toy", "--model", model_dir,
                     "--out", str(tmp_path / name), "--seed", "3"]) == 0
    expected = write_workload(tmp_path / "direct", "toy", tok, seed=3)
    for tier in TIERS:
        fa, fb, fd = ((tmp_path / d / f"{tier}.jsonl").read_bytes() for d in ("a", "b", "direct"))
        assert fa == fb == fd
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == expected
