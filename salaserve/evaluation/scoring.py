"""SOAR correctness scoring, as the toolkit's `eval_model.py` does it (serving_protocol.md section 2,
"Scoring", and section 5.4).

Rules and where they come from:
- The answer is the text after the last `</think>` (section 2, eval_model.py l.207-210).
- `mcq`: the option letter from `ANSWER: X` or `\\boxed{X}` must equal the gold letter
  (section 2, l.212-233).
- `qa`, `niah`, `lcx`: 1 if any gold string is a case-insensitive substring of the answer
  (section 2, l.235-250).
- `cwe`, `fwe`: the fraction of gold words present in the answer (section 2, l.235-250).
- `ori_accuracy` = mean score x 100; `overall_accuracy` = min(round(ori / 80 x 100, 2), 100)
  (section 2, l.396 and l.433).
- Correctness coefficient C on `overall_accuracy`: <= 97 -> 0, (97, 98] -> 0.92, (98, 99] -> 0.96,
  (99, 100] -> 1.0 (section 5.4, latest wording; `bench/score.py` holds it beside the speed score
  it multiplies).
- A failed request scores 0: the toolkit turns errors into an empty prediction (section 2).

Choices where the note is silent (the toolkit source itself was not available):
- No `</think>` at all: the whole prediction is the answer (what splitting on the last
  `</think>` yields). A prediction that is cut off while still thinking can then still score if
  its reasoning happens to contain the answer.
- `mcq`: the keyword `ANSWER` is matched in any case and may be followed by `:` or the full-width
  `：`, optional `**`, `(`; the letter must be an upper-case A-Z standing alone (`ANSWER: B`,
  `answer: (C)`, `Answer：**D**`). `\\boxed{}` may wrap the letter in `\\text{}`/`\\textbf{}`/`\\mathrm{}`
  or parentheses (`\\boxed{B}`, `\\boxed{\\text{(C)}}`, `\\boxed{D. 42}`). When there are several
  candidates of either form, the last one in the text wins: it is the model's final answer.
  Gold is compared after stripping spaces, parentheses and a trailing dot, upper-cased; a list
  gold is correct if any element matches.
- `cwe`/`fwe` word matching is a case-insensitive substring test, like `qa` (RULER's
  string_match_all). An empty gold list scores 0.
- Gold strings and words are stripped of surrounding whitespace; empty ones are ignored.
- An unknown task scores 0 (the toolkit's if/elif chain scores only the known kinds).
- `ori_accuracy` is kept unrounded; `overall_accuracy` is rounded to 2 decimals as above, and C
  is read from that rounded value, which is what the platform uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from salaserve.bench.score import correctness_coefficient

THINK_END = "</think>"
MCQ_TASKS = ("mcq",)
CONTAINS_TASKS = ("qa", "niah", "lcx")
WORDS_TASKS = ("cwe", "fwe")
BASELINE_ORI = 80.0  # ori_accuracy that maps to overall_accuracy 100

_ANSWER_RE = re.compile(r"\b(?i:answer)\s*[:：]\s*(?:\*\*)?\s*\(?\s*([A-Z])(?![A-Za-z])")
_BOXED_RE = re.compile(
    r"\\boxed\s*\{\s*(?:\\(?:text|textbf|mathrm|mathbf)\s*\{\s*)?\(?\s*([A-Z])(?![A-Za-z])")


def answer_text(prediction: str | None) -> str:
    """The part of a prediction that is scored: after the last `</think>`, else all of it."""
    return (prediction or "").rsplit(THINK_END, 1)[-1]


def extract_choice(prediction: str | None) -> str | None:
    """The last `ANSWER: X` or `\\boxed{X}` option letter in the answer text, or None."""
    text = answer_text(prediction)
    best: tuple[int, str] | None = None
    for rx in (_ANSWER_RE, _BOXED_RE):
        for m in rx.finditer(text):
            if best is None or m.start() > best[0]:
                best = (m.start(), m.group(1))
    return best[1] if best else None


def _golds(gold) -> list[str]:
    items = gold if isinstance(gold, (list, tuple)) else [gold]
    return [s for s in (str(g).strip() for g in items if g is not None) if s]


def _norm_choice(g: str) -> str:
    return g.strip().strip("()").rstrip(".").strip().upper()


def score_mcq(prediction: str | None, gold) -> tuple[float, str | None]:
    """(1.0 or 0.0, the extracted letter)."""
    choice = extract_choice(prediction)
    ok = choice is not None and any(_norm_choice(g) == choice for g in _golds(gold))
    return (1.0 if ok else 0.0), choice


def score_contains(prediction: str | None, gold) -> float:
    """1.0 if any gold string occurs in the answer, ignoring case."""
    text = answer_text(prediction).lower()
    return 1.0 if any(g.lower() in text for g in _golds(gold)) else 0.0


def score_words(prediction: str | None, gold) -> float:
    """Fraction of gold words that occur in the answer, ignoring case."""
    words = _golds(gold)
    if not words:
        return 0.0
    text = answer_text(prediction).lower()
    return sum(w.lower() in text for w in words) / len(words)


def score_one(task: str, prediction: str | None, gold) -> float:
    """The score in [0, 1] of one prediction for a row of the given task."""
    if task in MCQ_TASKS:
        return score_mcq(prediction, gold)[0]
    if task in CONTAINS_TASKS:
        return score_contains(prediction, gold)
    if task in WORDS_TASKS:
        return score_words(prediction, gold)
    return 0.0


def overall_accuracy(ori: float) -> float:
    """Normalized accuracy the platform reports: min(round(ori / 80 x 100, 2), 100)."""
    return min(round(ori / BASELINE_ORI * 100, 2), 100.0)


@dataclass
class TaskStats:
    n: int = 0
    score_sum: float = 0.0
    failed: int = 0  # requests that errored or came back empty
    unanswered: int = 0  # mcq only: no extractable letter

    @property
    def accuracy(self) -> float:
        return 100.0 * self.score_sum / self.n if self.n else 0.0


@dataclass
class Report:
    n: int
    ori_accuracy: float
    overall_accuracy: float
    coefficient: float
    tasks: dict[str, TaskStats] = field(default_factory=dict)
    scores: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"n": self.n, "ori_accuracy": round(self.ori_accuracy, 2),
                "overall_accuracy": self.overall_accuracy, "coefficient": self.coefficient,
                "tasks": {t: {"n": s.n, "accuracy": round(s.accuracy, 2), "failed": s.failed,
                              "unanswered": s.unanswered} for t, s in self.tasks.items()}}

    def table(self) -> str:
        lines = ["| task | n | accuracy | failed | mcq unanswered |", "|---|---:|---:|---:|---:|"]
        for t, s in self.tasks.items():
            una = str(s.unanswered) if t in MCQ_TASKS else "-"
            lines.append(f"| {t} | {s.n} | {s.accuracy:.2f} | {s.failed} | {una} |")
        lines.append(f"| **all** | {self.n} | {self.ori_accuracy:.2f} | "
                     f"{sum(s.failed for s in self.tasks.values())} | - |")
        lines.append("")
        lines.append(f"ori_accuracy {self.ori_accuracy:.2f}  overall_accuracy "
                     f"{self.overall_accuracy:.2f}  C {self.coefficient}")
        return "\n".join(lines)


def score_rows(rows: list[dict], predictions: list[str | None]) -> Report:
    """Score predictions against rows with `task` and `gold`; None or "" marks a failed request."""
    if len(rows) != len(predictions):
        raise ValueError(f"{len(rows)} rows but {len(predictions)} predictions")
    tasks: dict[str, TaskStats] = {}
    scores = []
    for row, pred in zip(rows, predictions):
        task = row.get("task", "")
        st = tasks.setdefault(task, TaskStats())
        s = score_one(task, pred, row.get("gold"))
        st.n += 1
        st.score_sum += s
        st.failed += not pred
        if task in MCQ_TASKS and pred and extract_choice(pred) is None:
            st.unanswered += 1
        scores.append(s)
    ori = 100.0 * sum(scores) / len(scores) if scores else 0.0
    overall = overall_accuracy(ori)
    return Report(len(scores), ori, overall, correctness_coefficient(overall), tasks, scores)
