"""Benchmark report: the run's provenance (command, commit, GPU, date), a Markdown table, and the
files: `result.json`, `report.md`, `latency_<tier>.png`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from salaserve.bench.server_proc import PACKAGE_ROOT


def git_commit(repo: str = PACKAGE_ROOT) -> dict:
    """HEAD of the checkout the code runs from, and whether it has uncommitted changes."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None,
            "git_tree": working_tree_id(repo) if commit else None}


def working_tree_id(repo: str = PACKAGE_ROOT) -> str | None:
    """The git tree id of the files as they are (tracked and untracked, ignored ones left out),
    written through a scratch index so the checkout's own index is untouched. It names the code
    even where HEAD does not: a copy of a working tree with stale git metadata (the GPU machine's)
    still gives the id of the commit whose files it holds; find that commit with
    `git log --format='%H %T' | grep TREE`."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        try:
            for args in (["add", "-A"], ["write-tree"]):
                p = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=60, env=env)
                if p.returncode != 0:
                    return None
        except (OSError, subprocess.TimeoutExpired):
            return None
    return p.stdout.strip() or None


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a broken CUDA set-up still gets a report
        pass
    return "cpu"


def provenance(argv: list[str]) -> dict:
    return {"command": "salaserve bench " + shlex.join(argv), "argv": list(argv), **git_commit(),
            "gpu": gpu_name(), "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": platform.node(), "python": sys.version.split()[0]}


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _stats(s: dict | None, key: str) -> str:
    return "-" if not s or s.get(key) is None else f"{s[key]:.1f}"


def markdown(result: dict) -> str:
    """Provenance lines, the per-tier table and the latency tables."""
    wl = result.get("workload", {})
    lines = [f"# Benchmark: {wl.get('name') or wl.get('dir', '')} ({result.get('client')} client)", "",
             f"- Command: `{result.get('command')}`",
             f"- Commit: `{result.get('git_commit')}`" + (" (dirty)" if result.get("git_dirty") else "")
             + f"; GPU: {result.get('gpu')}; date: {result.get('date')}",
             f"- Server: {result.get('url')}, model `{result.get('model_id')}`"
             + (f", args `{result['server_args']}`" if result.get("server_args") else ""), "",
             "| tier | concurrency | ok/requests | duration (s) | output tok/s | req/s | "
             "output tokens | lengths exact |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    tiers = result.get("tiers", {})
    for t, r in tiers.items():
        lc = r.get("length_check", {})
        exact = "yes" if lc.get("ok") else f"no ({len(lc.get('mismatches', []))})"
        lines.append(f"| {t} | {r.get('max_concurrency') or 'unlimited'} | {r['successes']}/{r['requests']} | "
                     f"{_f(r['duration_s'])} | {_f(r['output_throughput'], '.1f')} | "
                     f"{_f(r['request_throughput'], '.3f')} | {r['total_output_tokens']} | {exact} |")
    for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("E2E latency", "e2e_ms")):
        lines += ["", f"{name} (ms):", "", "| tier | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
        for t, r in tiers.items():
            s = r.get(key)
            lines.append(f"| {t} | " + " | ".join(_stats(s, k) for k in ("mean", "p50", "p90", "p99")) + " |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write result.json, report.md and (with `plots`) one latency PNG per tier."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "result.json", "markdown": out / "report.md"}
    files["json"].write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    files["markdown"].write_text(markdown(result))
    if plots:
        from salaserve.bench.plots import plot_latencies

        for tier, path in plot_latencies(result, out).items():
            files[f"latency_{tier}"] = path
    return files
