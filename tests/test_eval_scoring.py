"""SOAR correctness scoring on hand-made predictions."""

import pytest

from salaserve.bench.score import correctness_coefficient
from salaserve.evaluation.scoring import answer_text, extract_choice, overall_accuracy, score_one, score_rows


def test_answer_text_after_last_think():
    assert answer_text("<think>a</think>b</think>c") == "c"
    assert answer_text("no think block") == "no think block"
    assert answer_text(None) == ""
    assert answer_text("<think>still thinking, ANSWER: B") == "<think>still thinking, ANSWER: B"


@pytest.mark.parametrize("pred, letter", [
    ("ANSWER: B", "B"),
    ("answer: (c)", None),  # the letter must be upper case
    ("Answer: (C)", "C"),
    ("Final Answer：**D**", "D"),
    ("ANSWER:A.", "A"),
    (r"so \boxed{B}", "B"),
    (r"\boxed{\text{(C)}}", "C"),
    (r"\boxed{ D. 42 }", "D"),
    (r"\boxed{42}", None),
    ("Answers: B", None),
    ("ANSWER: Both", None),  # a word, not a letter
    ("The answer is B", None),
    ("", None),
])
def test_extract_choice_forms(pred, letter):
    assert extract_choice(pred) == letter


def test_mcq_last_candidate_wins_across_forms():
    assert extract_choice("ANSWER: A ... on reflection \\boxed{C}") == "C"
    assert extract_choice("\\boxed{C} hmm, no. ANSWER: D") == "D"
    assert extract_choice("ANSWER: A\nANSWER: B") == "B"


def test_mcq_only_after_last_think():
    pred = "<think>I think ANSWER: A</think>The result is \\boxed{B}"
    assert score_one("mcq", pred, "B") == 1.0
    assert score_one("mcq", pred, "A") == 0.0
    assert score_one("mcq", "<think>ANSWER: A</think>no letter here", "A") == 0.0


def test_mcq_without_think_uses_whole_text():
    assert score_one("mcq", "<think>long reasoning ... ANSWER: C", "C") == 1.0


def test_mcq_gold_normalisation():
    assert score_one("mcq", "ANSWER: B", " b ") == 1.0
    assert score_one("mcq", "ANSWER: B", "(B)") == 1.0
    assert score_one("mcq", "ANSWER: B", ["A", "B"]) == 1.0
    assert score_one("mcq", "ANSWER: B", "C") == 0.0


@pytest.mark.parametrize("task", ["niah", "qa", "lcx"])
def test_contains_any_gold_case_insensitive(task):
    assert score_one(task, "The number is 4821093.", ["4821093"]) == 1.0
    assert score_one(task, "It was founded in STONEFORD.", ["Stoneford"]) == 1.0
    assert score_one(task, "Paris", ["London", "paris"]) == 1.0
    assert score_one(task, "Paris", "paris") == 1.0  # a plain string gold
    assert score_one(task, "Rome", ["London", "Paris"]) == 0.0
    assert score_one(task, "<think>4821093</think>I don't know", ["4821093"]) == 0.0
    assert score_one(task, "anything", ["", "  "]) == 0.0  # empty golds never match


def test_words_partial_credit():
    gold = ["alpha", "beta", "gamma", "delta"]
    assert score_one("cwe", "alpha, Beta and delta", gold) == 0.75
    assert score_one("fwe", "<think>alpha beta gamma delta</think>gamma", gold) == 0.25
    assert score_one("cwe", "", gold) == 0.0
    assert score_one("cwe", "alpha", []) == 0.0
    assert score_one("fwe", "all: ALPHA BETA GAMMA DELTA", gold) == 1.0


def test_unknown_task_scores_zero():
    assert score_one("essay", "anything", ["anything"]) == 0.0


@pytest.mark.parametrize("ori, overall", [
    (80.0, 100.0), (90.0, 100.0), (79.2, 99.0), (0.0, 0.0), (77.6, 97.0), (79.21, 99.01),
    (50.0, 62.5), (1 / 3 * 100, 41.67)])
def test_overall_accuracy(ori, overall):
    assert overall_accuracy(ori) == overall


@pytest.mark.parametrize("overall, c", [
    (0.0, 0.0), (96.99, 0.0), (97.0, 0.0), (97.01, 0.92), (98.0, 0.92), (98.01, 0.96),
    (99.0, 0.96), (99.01, 1.0), (100.0, 1.0)])
def test_coefficient_tiers_at_boundaries(overall, c):
    assert correctness_coefficient(overall) == c


def test_coefficient_from_ori_boundaries():
    # C = 1 needs ori > 79.2 (serving_protocol.md 5.4).
    assert correctness_coefficient(overall_accuracy(79.2)) == 0.96
    assert correctness_coefficient(overall_accuracy(79.21)) == 1.0
    assert correctness_coefficient(overall_accuracy(77.6)) == 0.0
    assert correctness_coefficient(overall_accuracy(77.61)) == 0.92


def test_score_rows_aggregates_per_task():
    rows = [
        {"task": "mcq", "gold": "A"}, {"task": "mcq", "gold": "B"},
        {"task": "niah", "gold": ["123"]}, {"task": "niah", "gold": ["456"]},
        {"task": "cwe", "gold": ["x1", "x2", "x3", "x4"]},
    ]
    preds = ["<think>..</think>ANSWER: A", "I am not sure", "123", "", "x1 x3"]
    rep = score_rows(rows, preds)
    assert rep.scores == [1.0, 0.0, 1.0, 0.0, 0.5]
    assert rep.ori_accuracy == pytest.approx(100 * 2.5 / 5)
    assert rep.overall_accuracy == 62.5
    assert rep.coefficient == 0.0
    assert rep.tasks["mcq"].accuracy == 50.0 and rep.tasks["mcq"].unanswered == 1
    assert rep.tasks["niah"].failed == 1
    assert rep.tasks["cwe"].accuracy == 50.0
    d = rep.to_dict()
    assert d["tasks"]["niah"] == {"n": 2, "accuracy": 50.0, "failed": 1, "unanswered": 0}
    table = rep.table()
    assert "| mcq | 2 | 50.00 | 0 | 1 |" in table and "overall_accuracy 62.50" in table


def test_score_rows_length_mismatch():
    with pytest.raises(ValueError):
        score_rows([{"task": "qa", "gold": ["a"]}], [])
