"""The official client, `python -m sglang.bench_serving`, run as the SOAR toolkit's
bench_serving.sh runs it (serving_protocol.md section 1.1), one process per tier.

Only `--output-file` and `--output-details` are added: they are written after the timed window
and give per-request TTFTs, ITLs, lengths and errors. The tier's duration is what the toolkit
greps from stdout, `Benchmark duration (s):`; the result file's unrounded `duration` is kept
beside it. The other printed numbers are parsed into a label -> value dict.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

from salaserve.bench.dataset import BenchRequest, write_conversations

_LINE_RE = re.compile(r"^([A-Za-z][^:\n]*?):\s+(-?[0-9]+(?:\.[0-9]+)?)\s*$", re.M)
_DURATION_RE = re.compile(r"Benchmark duration \(s\):\s+([0-9.]+)")


def available() -> str | None:
    """None when `sglang.bench_serving` can be run, else why not."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install sglang==0.5.9 --no-deps, plus its client deps)"
    if importlib.util.find_spec("sglang.bench_serving") is None:
        return "this sglang has no bench_serving module"
    return None


def parse_report(stdout: str) -> dict[str, float]:
    """`Label: number` lines of the printed report (the last report wins)."""
    return {k.strip(): float(v) for k, v in _LINE_RE.findall(stdout)}


def bench_command(base_url: str, dataset: Path, num_prompts: int, max_concurrency: int | None,
                  result_file: Path, python: str = sys.executable) -> list[str]:
    """bench_serving.sh's command line (plus the result file) for one tier."""
    u = urlparse(base_url)
    if u.scheme == "http" and u.hostname and u.path in ("", "/"):
        target = ["--host", u.hostname, "--port", str(u.port or 80)]
    else:
        target = ["--base-url", base_url.rstrip("/")]
    cmd = [python, "-m", "sglang.bench_serving", "--backend", "sglang", *target,
           "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
           "--flush-cache"]
    if max_concurrency is not None:
        cmd += ["--max-concurrency", str(max_concurrency)]
    return cmd + ["--output-file", str(result_file), "--output-details"]


def run_official_tier(base_url: str, pairs: list[tuple[str, str]], requests: list[BenchRequest],
                      tier: str, max_concurrency: int | None, workdir: str | Path,
                      echo: bool = True, timeout_s: float | None = None) -> dict:
    """Run one tier; returns `duration_s` (0.0 when stdout has none, as the toolkit records),
    `result_duration_s`, `printed` (parsed stdout), `records` (see metrics.py), `returncode`,
    `stdout_tail` and `order_matches` (our replica of the client's shuffle agrees with it).

    `requests` are ours for the same file: they give each request's requested length.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / f"bench_eval_data_{tier}.jsonl"
    write_conversations(pairs, dataset)
    result_file = work / f"official_{tier}.jsonl"
    result_file.unlink(missing_ok=True)
    cmd = bench_command(base_url, dataset, len(pairs), max_concurrency, result_file)
    # stderr (its progress bar) goes straight through; stdout is the report we parse
    proc = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=None if echo else subprocess.DEVNULL,
                          text=True, timeout=timeout_s)
    if echo:
        sys.stdout.write(proc.stdout)
    m = _DURATION_RE.search(proc.stdout)
    out = {"command": cmd, "returncode": proc.returncode, "duration_s": float(m.group(1)) if m else 0.0,
           "printed": parse_report(proc.stdout), "stdout_tail": proc.stdout[-4000:],
           "result_duration_s": None, "records": [], "order_matches": None}
    if result_file.is_file() and result_file.read_text().strip():
        res = json.loads(result_file.read_text().splitlines()[-1])
        out["result_duration_s"] = res.get("duration")
        out["records"] = [
            {"prompt_len": n_in, "output_len": req.output_len, "success": not err,
             "completion_tokens": n_out, "ttft_s": ttft, "e2e_s": None,
             "itl_s": [round(x, 6) for x in itl], "error": err or ""}
            for req, n_in, n_out, ttft, itl, err in zip(requests, res["input_lens"], res["output_lens"],
                                                         res["ttfts"], res["itls"], res["errors"])]
        out["order_matches"] = (len(requests) == len(res["input_lens"])
                                and [r.prompt_len for r in requests] == list(res["input_lens"]))
    return out


def printed_latency_ms(printed: dict[str, float], name: str) -> dict[str, float | None] | None:
    """E2E or TPOT statistics from the printed report (it has no per-request E2E)."""
    keys = {"mean": f"Mean {name} (ms)", "p50": f"Median {name} (ms)", "p90": f"P90 {name} (ms)",
            "p99": f"P99 {name} (ms)"}
    if keys["mean"] not in printed:
        return None
    return {k: printed.get(label) for k, label in keys.items()}
