"""Synthetic long-context tasks: golds re-derived from the question text alone, lengths, determinism."""

import re
from collections import Counter

import pytest

from bpe_tokenizer import build_bpe_tokenizer
from salaserve.evaluation.scoring import score_one
from salaserve.evaluation.synthetic import make_synthetic


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def rows(tok):
    return make_synthetic(tok, [1500], per_task=2, seed=7) + \
        make_synthetic(tok, [8000], per_task=1, seed=7, tasks=("cwe", "fwe"))


def _by_task(rows, task):
    out = [r for r in rows if r["task"] == task]
    assert out
    return out


def test_row_format(rows):
    for r in rows:
        assert {"task", "question", "gold"} <= set(r)
        assert isinstance(r["question"], str) and isinstance(r["gold"], list) and r["gold"]
    assert {r["lang"] for r in rows} == {"en", "zh"}


def test_lengths_within_tolerance(tok, rows):
    for r in rows:
        n = len(tok.encode(r["question"], add_special_tokens=False))
        assert n == r["input_tokens"] <= r["target_tokens"]
        assert r["target_tokens"] - n <= max(60, 0.03 * r["target_tokens"]), r["task"]


def test_niah_gold_rederived(rows):
    for r in _by_task(rows, "niah"):
        q = r["question"]
        if r["lang"] == "en":
            needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", q)
            asked = re.search(r"what is the special magic number for (\S+)\? Answer", q).group(1)
        else:
            needles = re.findall(r"(代号[^。，？\s]+?)的特殊魔法数字是：(\d+)。", q)
            asked = re.search(r"问题：根据上文，(\S+?)的特殊魔法数字是多少", q).group(1)
        table = dict(needles)
        assert len(table) == len(needles) >= 1  # keys are unique
        assert r["gold"] == [table[asked]]
        assert q.count(table[asked]) == 1
        assert score_one("niah", f"The number is {table[asked]}.", r["gold"]) == 1.0


def test_qa_gold_rederived(rows):
    for r in _by_task(rows, "qa"):
        q = r["question"]
        if r["lang"] == "en":
            recs = re.findall(r"The ([^.?!]+?) was founded in ([^.?!]+?) in (\d{4}) by ([^.?!]+?)\.", q)
            m = re.search(r"in which town was the (.+?) founded\?|who founded the (.+?)\?", q)
        else:
            recs = re.findall(r"(\d{4})年，([^，。？]+?)在([^，。？]+?)创立了([^，。？]+?)。", q)
            recs = [(org, town, year, person) for year, person, town, org in recs]
            m = re.search(r"问题：根据上文，(.+?)是在哪里创立的|问题：根据上文，(.+?)是由谁创立的", q)
        orgs = {org: (town, person) for org, town, _, person in recs}
        assert len(orgs) == len(recs) >= 4
        town_q = m.group(1) is not None
        town, person = orgs[m.group(1) or m.group(2)]
        assert r["gold"] == [town if town_q else person]
        assert q.count(r["gold"][0]) == 1  # the answer appears only in its record


def _list_and_counts(q, kind):
    body = q.split("\n\n")[1]
    if kind == "cwe":
        lines = body.split("\n")
        nums = [int(line.split(". ", 1)[0]) for line in lines]
        assert nums == list(range(1, len(lines) + 1))
        words = [line.split(". ", 1)[1] for line in lines]
    else:
        words = body.split(" ")
    return Counter(words)


@pytest.mark.parametrize("kind, top", [("cwe", 10), ("fwe", 3)])
def test_frequency_golds_rederived(rows, kind, top):
    for r in _by_task(rows, kind):
        counts = _list_and_counts(r["question"], kind)
        ranked = counts.most_common()
        assert len(ranked) > top
        assert ranked[top - 1][1] > ranked[top][1]  # a strict gap: the top set is unambiguous
        assert {w for w, _ in ranked[:top]} == set(r["gold"])
        # No other listed word contains a gold word, so substring scoring gives no false credit.
        for w in counts:
            if w not in r["gold"]:
                assert not any(g in w for g in r["gold"]), (w, r["gold"])
        assert score_one(kind, ", ".join(r["gold"]), r["gold"]) == 1.0
        assert score_one(kind, ", ".join(w for w, _ in ranked[top:top + 5]), r["gold"]) == 0.0


def test_cwe_uses_ruler_like_frequencies_when_long(rows):
    long_cwe = [r for r in rows if r["task"] == "cwe" and r["target_tokens"] == 8000]
    counts = _list_and_counts(long_cwe[0]["question"], "cwe")
    assert {counts[g] for g in long_cwe[0]["gold"]} == {max(counts.values())}
    assert min(counts.values()) == 3


def test_deterministic(tok):
    a = make_synthetic(tok, [800], per_task=2, seed=3)
    b = make_synthetic(tok, [800], per_task=2, seed=3)
    c = make_synthetic(tok, [800], per_task=2, seed=4)
    assert a == b
    assert [r["question"] for r in a] != [r["question"] for r in c]
