"""`salaserve bench`: speed benchmarks against a server, reports, comparisons."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

from salaserve.argparsing import ArgumentParser, Command, run_subcommand
from salaserve.bench.workload import TIERS, WORKLOADS

DESCRIPTION = """Speed benchmarks run as the SOAR platform runs them, for example:

  salaserve bench run --workload soar-quick --model /models/MiniCPM-SALA --out bench-results/quick
  salaserve bench compare bench-results/a/result.json bench-results/b/result.json"""


def _tiers(s: str) -> tuple[str, ...]:
    tiers = tuple(t for t in s.split(",") if t)
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise argparse.ArgumentTypeError(f"tiers must be among {','.join(TIERS)}; got {s!r}")
    return tiers


def _counts(s: str) -> dict[str, int]:
    """`S1=2,S8=8,Smax=16`; tiers left out keep the workload's count."""
    try:
        out = {k: int(v) for k, v in (kv.split("=") for kv in s.split(",") if kv)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"counts look like S1=2,S8=8,Smax=16; got {s!r}") from None
    if set(out) - set(TIERS):
        raise argparse.ArgumentTypeError(f"unknown tier in {s!r}")
    return out


def _run_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="salaserve bench run",
                        description="Run the S1/S8/Smax speed tiers as sglang.bench_serving does")
    ap.add_argument("--workload", choices=WORKLOADS, help="generate this workload (needs the model's tokenizer)")
    ap.add_argument("--workload-dir", help="read {tier}.jsonl (or speed_bench_c1/c8/cunlimited.jsonl) from here")
    ap.add_argument("--tiers", type=_tiers, default=",".join(TIERS), help="comma-separated")
    ap.add_argument("--counts", type=_counts, help="requests per tier when generating, e.g. S1=2,S8=8,Smax=16")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (the request order is always seed 1)")
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    target.add_argument("--model", help="model directory: start `salaserve serve --model-path MODEL`")
    ap.add_argument("--server-args", default="", help="extra `salaserve serve` flags, one string")
    ap.add_argument("--out", help="output directory (default bench-results/<workload>-<time>)")
    ap.add_argument("--client", choices=("ours", "sglang"), default="ours",
                    help="ours (built in) or sglang (python -m sglang.bench_serving, the official client)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: the /v1/models id, as the official client)")
    ap.add_argument("--trust-remote-code", action="store_true", help="let the model directory's own Python code load its tokenizer (off: built-in tokenizer classes only)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for a started server")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars or client output")
    ap.add_argument("--no-plots", action="store_true", help="no latency PNGs (no matplotlib needed)")
    return ap


def run_main(argv: list[str]) -> int:
    a = _run_parser().parse_args(argv)
    if (a.workload is None) == (a.workload_dir is None):
        print("salaserve bench run: give exactly one of --workload and --workload-dir", file=sys.stderr)
        return 2
    if a.client == "sglang":
        from salaserve.bench.official import available

        if why := available():
            print(f"salaserve bench run: --client sglang: {why}", file=sys.stderr)
            return 2
    from salaserve.bench.report import write_report
    from salaserve.bench.runner import RunConfig, run_bench

    name = a.workload or Path(a.workload_dir).name
    out = Path(a.out or f"bench-results/{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    cfg = RunConfig(out=out, tiers=a.tiers, workload=a.workload, workload_dir=a.workload_dir,
                    counts=a.counts, seed=a.seed, url=a.url, model=a.model, server_args=a.server_args,
                    client=a.client, tokenizer=a.tokenizer, trust_remote_code=a.trust_remote_code,
                    progress=not a.no_progress,
                    start_timeout_s=a.start_timeout)
    try:
        result = run_bench(cfg, ["run", *argv])
    except (OSError, RuntimeError, TimeoutError, ValueError) as e:
        print(f"salaserve bench run: error: {e}", file=sys.stderr)
        return 1
    files = write_report(result, out, plots=not a.no_plots)
    print()
    print(files["markdown"].read_text())
    print("written: " + ", ".join(str(p) for p in files.values()))
    ok = all(t["length_check"]["ok"] for t in result["tiers"].values())
    return 0 if ok else 3


def compare_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="salaserve bench compare",
                        description="Speedups and the SOAR score of B with A as the reference")
    ap.add_argument("a", help="reference result JSON (from bench run)")
    ap.add_argument("b", help="result JSON to score")
    c = ap.add_mutually_exclusive_group()
    c.add_argument("--coefficient", type=float, default=None, help="correctness coefficient C (default 1.0)")
    c.add_argument("--eval", help="an eval result JSON (salaserve eval --out) to take C from")
    a = ap.parse_args(argv)
    from salaserve.bench.score import coefficient_from_eval, compare_text

    coef = coefficient_from_eval(a.eval) if a.eval else (1.0 if a.coefficient is None else a.coefficient)
    ra, rb = (json.loads(Path(p).read_text()) for p in (a.a, a.b))
    print(compare_text(ra, rb, coef))
    return 0


def plot_micro_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="salaserve bench plot-micro",
                        description="Plot a `python -m benchmarks.micro --json` result")
    ap.add_argument("micro_json")
    ap.add_argument("--out", help="directory for the PNGs (default: beside the JSON)")
    a = ap.parse_args(argv)
    from salaserve.bench.plots import plot_micro

    src = Path(a.micro_json)
    paths = plot_micro(json.loads(src.read_text()), Path(a.out) if a.out else src.parent)
    print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def report_main(argv: list[str]) -> int:
    ap = ArgumentParser(prog="salaserve bench report", description="Re-render report.md and PNGs")
    ap.add_argument("result_json")
    ap.add_argument("--out", help="directory (default: beside the JSON)")
    a = ap.parse_args(argv)
    from salaserve.bench.report import write_report

    src = Path(a.result_json)
    result = json.loads(src.read_text())
    files = write_report(result, Path(a.out) if a.out else src.parent)
    print(files["markdown"].read_text())
    return 0


def e2e_main(argv: list[str]) -> int:
    ap = ArgumentParser(
        prog="salaserve bench e2e",
        description="soar-quick end to end on the full-size model (dummy weights) for several server "
                    "configurations in one run, each tier beside its floor (needs a GPU)")
    ap.add_argument("--config", action="append", metavar="NAME[@TIERS]=FLAGS",
                    help="a configuration: its name, optionally its own tiers, and extra `salaserve serve` flags, "
                         "e.g. 'w4a16=--quantization w4a16' or 'bf16-lof@Smax=--schedule-policy lof' (repeatable; "
                         "default: bf16, w4a16 and fp8)")
    ap.add_argument("--out", default="benchmarks/e2e/latest.json", help="the summary JSON")
    ap.add_argument("--work-dir", help="keep each configuration's bench run here (default: a temporary dir)")
    ap.add_argument("--tiers", type=_tiers, default=TIERS, help="comma-separated, default S1,S8,Smax")
    ap.add_argument("--workload", choices=WORKLOADS, default="soar-quick")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", action="store_true",
                    help="keep the other configurations already in --out (same workload and seed)")
    a = ap.parse_args(argv)
    from salaserve.bench.e2e import DEFAULT_CONFIGS, run_e2e, table

    configs, config_tiers = dict(DEFAULT_CONFIGS), {}
    if a.config:
        configs = {}
        for item in a.config:
            head, sep, flags = item.partition("=")
            name, at, tiers = head.partition("@")
            if not sep or not name:
                ap.error(f"--config takes NAME[@TIERS]=FLAGS, got {item!r}")
            if at:
                try:
                    config_tiers[name] = _tiers(tiers)
                except argparse.ArgumentTypeError as e:
                    ap.error(f"--config {item!r}: {e}")
            configs[name] = flags
    summary = run_e2e(configs, Path(a.out), Path(a.work_dir) if a.work_dir else None, ["e2e", *argv],
                      seed=a.seed, workload=a.workload, tiers=a.tiers, append=a.append, config_tiers=config_tiers)
    print(table(summary))
    print(f"written: {a.out}")
    ok = all(t["lengths_exact"] for c in summary["configs"].values() for t in c["tiers"].values())
    return 0 if ok else 3


def make_workload_main(argv: list[str]) -> int:
    from salaserve.bench.workload import main as workload_main

    return workload_main(argv)


COMMANDS = {
    "run": Command(run_main, "run the S1/S8/Smax tiers against a server (started for the run, or --url)"),
    "e2e": Command(e2e_main, "soar-quick end to end on the full-size dummy model per configuration, with floors (GPU)"),
    "make-workload": Command(make_workload_main, "write a workload's request files (SOAR toolkit format)"),
    "compare": Command(compare_main, "speedups and the SOAR score of one result against another"),
    "plot-micro": Command(plot_micro_main, "plot a `python -m benchmarks.micro --json` result"),
    "report": Command(report_main, "re-render report.md and the latency plots of a result"),
}


def main(argv: list[str]) -> int:
    """`argv`: the arguments after `salaserve bench`."""
    return run_subcommand("salaserve bench", COMMANDS, argv, DESCRIPTION)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
