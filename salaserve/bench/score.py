"""SOAR speed score of one result against another (serving_protocol.md section 5.4).

    Final = (0.4 * S1 + 0.3 * S8 + 0.3 * Smax) * C,   S_tier = 100 * Duration_best / Duration_yours

"Best" on the leaderboard is the fastest submission, so here it is the faster of the two runs:
with A as the reference, S_tier = 100 * min(dur_A, dur_B) / dur_B. B slower than A scores
100 * A/B; B faster than A is itself the best and scores 100. A tier with no duration
(0 or missing: the toolkit's value for a failed tier) scores 0. The plain speedup A/B is
reported beside it, uncapped.
"""

from __future__ import annotations

import json
from pathlib import Path

from salaserve.bench.workload import TIERS

WEIGHTS = {"S1": 0.4, "S8": 0.3, "Smax": 0.3}


def durations(result: dict) -> dict[str, float]:
    """Tier -> duration (s) of a `bench run` result JSON (missing tiers -> 0.0)."""
    tiers = result.get("tiers", {})
    return {t: float((tiers.get(t) or {}).get("duration_s") or 0.0) for t in TIERS}


def tier_score(dur_ref: float, dur: float) -> float:
    if dur <= 0:
        return 0.0
    if dur_ref <= 0:  # no reference time: B is the only finisher, hence the best
        return 100.0
    return 100.0 * min(dur_ref, dur) / dur


def soar_score(ref: dict[str, float], yours: dict[str, float], coefficient: float = 1.0) -> dict:
    per = {t: tier_score(ref[t], yours[t]) for t in TIERS}
    speed = sum(WEIGHTS[t] * per[t] for t in TIERS)
    return {"tiers": per, "speed_score": speed, "coefficient": coefficient, "final": speed * coefficient}


def correctness_coefficient(overall: float) -> float:
    """C multiplying the speed score: 0 at or below 97, then 0.92 / 0.96 / 1.0 per point."""
    if overall <= 97:
        return 0.0
    if overall <= 98:
        return 0.92
    if overall <= 99:
        return 0.96
    return 1.0


def coefficient_from_eval(path: str | Path) -> float:
    """C from an `salaserve eval --out` JSON (its summary's coefficient, else from its
    overall_accuracy), or from any JSON with `coefficient` / `overall_accuracy` at the top."""
    data = json.loads(Path(path).read_text())
    summary = data.get("summary", data)
    if summary.get("coefficient") is not None:
        return float(summary["coefficient"])
    if summary.get("overall_accuracy") is not None:
        return correctness_coefficient(float(summary["overall_accuracy"]))
    raise ValueError(f"{path}: no coefficient or overall_accuracy in it")


def compare_text(a: dict, b: dict, coefficient: float = 1.0, names: tuple[str, str] = ("A", "B")) -> str:
    """The table `salaserve bench compare` prints."""
    da, db = durations(a), durations(b)
    sc = soar_score(da, db, coefficient)
    lines = [f"| tier | {names[0]} duration (s) | {names[1]} duration (s) | speedup A/B | S_tier |",
             "|---|---:|---:|---:|---:|"]
    for t in TIERS:
        speedup = f"{da[t] / db[t]:.3f}x" if da[t] > 0 and db[t] > 0 else "-"
        lines.append(f"| {t} | {da[t]:.2f} | {db[t]:.2f} | {speedup} | {sc['tiers'][t]:.2f} |")
    lines.append("")
    lines.append(f"speed score (0.4*S1 + 0.3*S8 + 0.3*Smax) = {sc['speed_score']:.2f}; "
                 f"C = {coefficient:g}; SOAR score of B against A = {sc['final']:.2f}")
    return "\n".join(lines)
