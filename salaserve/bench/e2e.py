"""`salaserve bench e2e`: the performance metric. soar-quick's S1, S8 and Smax end to end on the
full-size model (dummy weights written on the GPU), one server configuration after another in one
run, each tier beside its floor; one JSON (default benchmarks/e2e/latest.json) to commit with
every performance change.

A tier's floor is what its requests cost at the hardware's measured rates (`floors.Ceilings`,
measured in the same run before any server starts): every prompt's prefill FLOPs at the bf16
matmul rate, plus the decode steps the tier's concurrency allows at the bytes each step must move
(weights once, states, attended K/V) over the copy bandwidth. Prefill and decode are added, as a
server that does not overlap them would spend; it is the bar, not a proof of optimality.

Every server gets the SOAR platform's forced flags (PLATFORM_ARGS, which the platform appends to a
submission's own) ahead of the configuration's: the tiers run as the platform runs them, and a
configuration may still study another value (e.g. `--max-running-requests 64`), which the platform
would not run.

`ttft_excess_s` is how much longer a request waited for its first token than the prefills queued
ahead of it explain: (its prompt + the prompts sent before it still without a first token when it
was sent) at the S1 tier's measured prefill seconds per prompt token. A cold path (a compile after
start-up) or a scheduler that starves a request shows up there.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from salaserve.bench.floors import Ceilings, decode_bytes, prefill_flops
from salaserve.bench.report import provenance
from salaserve.bench.runner import CONCURRENCY, RunConfig, run_bench
from salaserve.config import ModelConfig

# name -> extra `salaserve serve` flags (besides --load-format dummy)
DEFAULT_CONFIGS = {"bf16": "", "w4a16": "--quantization w4a16", "fp8": "--quantization fp8"}
WEIGHT_BYTES = {"bf16": 2.0, "w4a16": 0.5 + 4 / 128, "fp8": 1.0}  # per parameter, scales included
TEXT_CHARS = 2000  # of each tier's first output, kept to compare configurations' greedy outputs


@dataclass(frozen=True)
class Shape:
    prompt: int
    output: int


def decode_floor_s(cfg: ModelConfig, shapes: list[Shape], concurrency: int | None, ceil: Ceilings,
                   weight_bytes: float) -> float:
    """Decode steps of the tier at its concurrency (requests start in order as slots free up;
    each step decodes one token of every running request) at their floor bytes each."""
    slots = concurrency or len(shapes)
    queue = list(shapes)
    running: list[list[int]] = []  # [context, tokens left]
    seconds = 0.0
    while queue or running:
        while queue and len(running) < slots:
            s = queue.pop(0)
            running.append([s.prompt, max(0, s.output - 1)])  # the first token comes from the prefill
        running = [r for r in running if r[1] > 0]
        if not running:
            continue
        context = sum(r[0] for r in running) // len(running)
        seconds += decode_bytes(cfg, len(running), context, weight_bytes) / (ceil.copy_gbps * 1e9)
        for r in running:
            r[0] += 1
            r[1] -= 1
    return seconds


def tier_floor(cfg: ModelConfig, shapes: list[Shape], concurrency: int | None, ceil: Ceilings,
               weight_bytes: float) -> dict:
    prefill = sum(prefill_flops(cfg, s.prompt) for s in shapes) / (ceil.matmul_tflops * 1e12)
    decode = decode_floor_s(cfg, shapes, concurrency, ceil, weight_bytes)
    return {"floor_s": prefill + decode, "prefill_floor_s": prefill, "decode_floor_s": decode}


def ttft_excess(records: list[dict], s_per_prompt_token: float) -> list[float]:
    """Per successful request: TTFT minus the prefill time of its prompt and of the prompts sent
    before it that had no first token yet when it was sent."""
    done = [(r["sent_s"], r["sent_s"] + r["ttft_s"], r["prompt_len"]) for r in records
            if r["success"] and "sent_s" in r]
    out = []
    for sent, first, prompt in done:
        queued = sum(p for s, f, p in done if s < sent and f > sent)
        out.append((first - sent) - (prompt + queued) * s_per_prompt_token)
    return out


def cold_builds_after_ready(server_info: dict | None) -> int | None:
    """Kernels compiled or autotuned and graphs captured after the server reported ready, from its
    /get_server_info (the engine's counters: internal_states[0]); None where it was not read."""
    states = (server_info or {}).get("internal_states") or [{}]
    return states[0].get("cold_builds_after_ready")


def summarize_config(name: str, result: dict, cfg: ModelConfig, ceil: Ceilings, weight_bytes: float) -> dict:
    tiers = result["tiers"]
    s1 = [r for r in tiers.get("S1", {}).get("per_request", []) if r["success"]]
    # the measured single-request prefill rate (S1: nothing else queued or decoding beside it)
    rate = (sum(r["ttft_s"] for r in s1) / sum(r["prompt_len"] for r in s1)) if s1 else None
    out = {"server_args": result.get("server_args"), "startup_s": result.get("startup_s"),
           "cold_builds_after_ready": cold_builds_after_ready(result.get("server_info_after")), "tiers": {}}
    for tier, t in tiers.items():
        recs = t["per_request"]
        shapes = [Shape(r["prompt_len"], r["output_len"]) for r in recs]
        floor = tier_floor(cfg, shapes, CONCURRENCY[tier], ceil, weight_bytes)
        excess = ttft_excess(recs, rate) if rate else []
        out["tiers"][tier] = {
            "duration_s": t["duration_s"], **floor,
            "floor_over_achieved": floor["floor_s"] / t["duration_s"] if t["duration_s"] else None,
            "requests": t["requests"], "successes": t["successes"], "lengths_exact": t["length_check"]["ok"],
            "input_tokens": t["total_input_tokens"], "output_tokens": t["total_output_tokens"],
            "ttft_ms": t["ttft_ms"], "itl_ms": t["itl_ms"], "e2e_ms": t["e2e_ms"],
            "max_ttft_excess_s": max(excess) if excess else None,
            "first_output": (recs[0].get("text") or "")[:TEXT_CHARS] if recs else "",
        }
    out["s1_prefill_tok_per_s"] = 1 / rate if rate else None
    return out


# appended by the SOAR platform's launch line to every submission's server arguments
# (shared/reference/serving_protocol.md); they override the server's defaults (64 running requests)
PLATFORM_ARGS = "--tp-size 1 --max-running-requests 32 --enable-metrics"


def server_args(config_args: str) -> str:
    """The server's flags for one configuration: dummy weights, the platform's flags, then the
    configuration's own (the last value of a flag wins)."""
    return f"--load-format dummy {PLATFORM_ARGS} {config_args}".strip()


def run_e2e(configs: dict[str, str], out_json: Path, work_dir: Path | None, argv: list[str],
            seed: int = 0, workload: str = "soar-quick", tiers: tuple[str, ...] = ("S1", "S8", "Smax"),
            progress: bool = False, append: bool = False,
            config_tiers: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Every configuration's tiers on one full-size dummy model; writes and returns the summary.
    config_tiers: a configuration's own tiers instead of `tiers` (e.g. a scheduling variant that
    only Smax tells apart). append: keep the configurations of an existing out_json (same workload
    and seed) that this run does not measure, so configurations too slow for one GPU session's call
    add up in one file; each configuration records its own commit, GPU, date and ceilings."""
    from salaserve.bench.floors import measure_ceilings
    from salaserve.config import preset_config
    from salaserve.model.checkpoint import write_checkpoint

    cfg = preset_config("full")
    ceil = measure_ceilings()
    tmp = Path(tempfile.mkdtemp(prefix="salaserve-e2e-"))
    work = work_dir or tmp
    model = tmp / "model"
    write_checkpoint(str(model), "full", weights=False)
    run_info = {**provenance(argv), "workload": workload, "seed": seed,
                "ceilings": {"copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops}}
    summary = {**run_info, "configs": previous_configs(out_json, workload, seed) if append else {}}
    try:
        for name, args in configs.items():
            run = RunConfig(out=work / name, tiers=(config_tiers or {}).get(name, tiers), workload=workload, seed=seed,
                            model=str(model),
                            server_args=server_args(args), progress=progress)
            result = run_bench(run, argv)
            (work / name / "result.json").write_text(json.dumps(result, indent=1))
            wb = WEIGHT_BYTES.get(name.split("-")[0], 2.0)
            summary["configs"][name] = {**summarize_config(name, result, cfg, ceil, wb),
                                        "run": {k: run_info[k] for k in RUN_KEYS if k in run_info}}
            out_json.parent.mkdir(parents=True, exist_ok=True)
            out_json.write_text(json.dumps(summary, indent=1))  # after each configuration
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


RUN_KEYS = ("git_commit", "git_dirty", "git_tree", "gpu", "date", "ceilings")  # a configuration's own provenance


def previous_configs(out_json: Path, workload: str, seed: int) -> dict:
    """The configurations of an earlier summary of the same workload and seed (none otherwise)."""
    try:
        old = json.loads(out_json.read_text())
    except (OSError, ValueError):
        return {}
    if old.get("workload") != workload or old.get("seed") != seed:
        return {}
    return dict(old.get("configs", {}))


def table(summary: dict) -> str:
    """Markdown: per configuration and tier, seconds beside the floor, TTFT / ITL tails."""
    lines = ["| config | tier | duration s | floor s | floor/achieved | TTFT p50 / p90 ms | ITL p50 / p99 ms | "
             "max TTFT excess s | start-up s | built after ready |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in summary["configs"].items():
        for tier, t in c["tiers"].items():
            ttft, itl = t["ttft_ms"] or {}, t["itl_ms"] or {}
            lines.append(
                f"| {name} | {tier} | {t['duration_s']:.1f} | {t['floor_s']:.1f} | "
                f"{t['floor_over_achieved'] or 0:.2f} | {ttft.get('p50', 0):.0f} / {ttft.get('p90', 0):.0f} | "
                f"{itl.get('p50', 0):.1f} / {itl.get('p99', 0):.0f} | "
                f"{'-' if t['max_ttft_excess_s'] is None else format(t['max_ttft_excess_s'], '.1f')} | "
                f"{'-' if c['startup_s'] is None else format(c['startup_s'], '.0f')} | "
                f"{'-' if c.get('cold_builds_after_ready') is None else c['cold_builds_after_ready']} |")
    return "\n".join(lines)
