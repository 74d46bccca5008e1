"""Per-tier numbers from per-request records, with the official client's definitions.

A record is a dict: `prompt_len`, `output_len` (requested), `success`, `completion_tokens`,
`ttft_s`, `e2e_s` (None when the client did not expose it), `itl_s` (list), `error`.
Like `bench_serving.calculate_metrics`: throughputs divide by the benchmark duration; failed
requests count 0 output tokens; latency statistics cover successful requests only; percentiles
are numpy's (linear interpolation).
"""

from __future__ import annotations

import numpy as np

STAT_KEYS = ("mean", "p50", "p90", "p99")


def stats_ms(values_s: list[float]) -> dict[str, float] | None:
    """Mean and percentiles in milliseconds; None when there is nothing to describe."""
    if not values_s:
        return None
    a = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def record_of(res, window_start: float | None = None) -> dict:
    """A record from our client's RequestResult (ITLs kept to the microsecond); with the tier's
    window_start, `sent_s`: when the request was sent, in seconds into the timed window."""
    rec = {"prompt_len": res.prompt_len, "output_len": res.output_len, "success": res.success,
           "completion_tokens": res.completion_tokens if res.success else 0,
           "ttft_s": res.ttft, "e2e_s": res.latency if res.success else None,
           "itl_s": [round(x, 6) for x in res.itl], "error": res.error}
    if window_start is not None:
        rec["sent_s"] = round(res.start_time - window_start, 6)
        rec["text"] = res.text
    return rec


def length_check(records: list[dict]) -> dict:
    """Every request succeeded with exactly the requested number of tokens."""
    bad = [{"index": i, "requested": r["output_len"], "got": r["completion_tokens"],
            "success": r["success"]}
           for i, r in enumerate(records) if not r["success"] or r["completion_tokens"] != r["output_len"]]
    return {"ok": not bad, "mismatches": bad}


def failed_records(requests, error: str) -> list[dict]:
    """Records for requests that never ran (the tier aborted before its timed window)."""
    return [{"prompt_len": r.prompt_len, "output_len": r.output_len, "success": False, "completion_tokens": 0,
             "ttft_s": 0.0, "e2e_s": None, "itl_s": [], "error": error} for r in requests]


def summarize(records: list[dict], duration_s: float, max_concurrency: int | None,
              accept_length: float | None = None) -> dict:
    ok = [r for r in records if r["success"]]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    e2e = [r["e2e_s"] for r in ok if r["e2e_s"] is not None]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1)
            for r in ok if r["e2e_s"] is not None and r["completion_tokens"] > 1]
    def per_s(x: float) -> float | None:  # None for a tier with no duration (it failed)
        return x / duration_s if duration_s > 0 else None

    return {
        "max_concurrency": max_concurrency,
        "requests": len(records), "successes": len(ok), "failures": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "requested_output_tokens": sum(r["output_len"] for r in records),
        "request_throughput": per_s(len(ok)), "input_throughput": per_s(in_tokens),
        "output_throughput": per_s(out_tokens),
        "ttft_ms": stats_ms([r["ttft_s"] for r in ok]),
        "itl_ms": stats_ms([x for r in ok for x in r["itl_s"]]),
        "e2e_ms": stats_ms(e2e),
        "tpot_ms": stats_ms(tpot),
        "accept_length": accept_length,
        "length_check": length_check(records),
    }
