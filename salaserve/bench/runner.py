"""`salaserve bench run`: workload -> server -> tiers -> result dict.

The server is started (`salaserve serve --model-path MODEL SERVER_ARGS`) unless a URL is given.
As the official client does, the model id comes from `GET /v1/models` and the tokenizer is
loaded locally from it; that tokenizer sizes a generated workload and sets every request's
output length. Tiers run one after another with concurrency 1 / 8 / unlimited.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from salaserve.bench.client import run_tier
from salaserve.bench.dataset import read_pairs, sample_requests, tier_file
from salaserve.bench.metrics import failed_records, record_of, summarize
from salaserve.bench.official import printed_latency_ms, run_official_tier
from salaserve.bench.report import provenance
from salaserve.bench.server_proc import ServeProcess
from salaserve.bench.workload import write_workload

CONCURRENCY = {"S1": 1, "S8": 8, "Smax": None}


@dataclass
class RunConfig:
    out: Path
    tiers: tuple[str, ...] = ("S1", "S8", "Smax")
    workload: str | None = None  # a name from workload.WORKLOADS, or None with workload_dir
    workload_dir: str | None = None
    counts: dict[str, int] | None = None  # requests per tier when generating
    seed: int = 0  # workload seed (the client's shuffle seed is always 1, as the official one)
    url: str | None = None
    model: str | None = None
    server_args: str = ""
    client: str = "ours"  # or "sglang"
    tokenizer: str | None = None  # default: the /v1/models id, as the official client loads it
    trust_remote_code: bool = False  # run the tokenizer directory's own code (the official client does)
    progress: bool = True
    start_timeout_s: float = 900.0


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _server_config(url: str) -> dict:
    """`/get_server_info`, without the API key should the server have one."""
    info = _get_json(url + "/get_server_info")
    if info.get("api_key"):
        info["api_key"] = "<redacted>"
    return info


def _official_tier(cfg: RunConfig, url: str, pairs, requests, tier: str) -> dict:
    c = CONCURRENCY[tier]
    o = run_official_tier(url, pairs, requests, tier, c, cfg.out / "official", echo=cfg.progress)
    # no result file (e.g. its warm-up failed): every request counts as failed
    records = o["records"] or failed_records(requests, "no result from sglang.bench_serving")
    s = summarize(records, o["duration_s"], c, o["printed"].get("Accept length"))
    # per-request E2E is not in its result file: the printed statistics stand in
    s["e2e_ms"] = printed_latency_ms(o["printed"], "E2E Latency")
    s["tpot_ms"] = printed_latency_ms(o["printed"], "TPOT")
    s["official"] = {k: o[k] for k in ("command", "returncode", "result_duration_s", "printed", "order_matches")}
    if o["returncode"] != 0 or not o["records"]:
        s["official"]["stdout_tail"] = o["stdout_tail"]
    return s | {"per_request": records}


def _our_tier(cfg: RunConfig, url: str, requests, tier: str) -> dict:
    c = CONCURRENCY[tier]
    try:
        run = run_tier(url, requests, c, progress=cfg.progress, desc=tier)
    except Exception as e:  # noqa: BLE001 - a failed warm-up or flush fails this tier only (the toolkit records 0)
        records = failed_records(requests, f"tier aborted: {type(e).__name__}: {e}")
        return summarize(records, 0.0, c) | {"error": records[0]["error"] if records else str(e),
                                             "per_request": records}
    records = [record_of(r, run.window_start) for r in run.results]
    if not any(r["success"] for r in records):
        # the official client crashes before printing a duration then; the toolkit records 0
        return summarize(records, 0.0, c) | {"window_s": run.duration, "per_request": records}
    return summarize(records, run.duration, c, run.accept_length) | {"per_request": records}


def run_bench(cfg: RunConfig, argv: list[str]) -> dict:
    """Run every tier; the result dict `write_report` takes."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    server = None
    if cfg.url is None:
        if cfg.model is None:
            raise ValueError("give --url of a running server or --model to start one")
        server = ServeProcess(cfg.model, cfg.server_args, cfg.out / "server.log", cfg.start_timeout_s).start()
    url = (cfg.url or server.url).rstrip("/")
    try:
        from salaserve.model.hf_tokenizer import load_tokenizer

        model_id = _get_json(url + "/v1/models")["data"][0]["id"]
        tok = load_tokenizer(cfg.tokenizer or model_id, trust_remote_code=cfg.trust_remote_code)
        wdir = Path(cfg.workload_dir) if cfg.workload_dir else cfg.out / "workload"
        if not cfg.workload_dir:
            write_workload(wdir, cfg.workload, tok, cfg.seed, cfg.counts)
        result = {**provenance(argv), "client": cfg.client, "url": url, "model_id": model_id,
                  "server_args": cfg.server_args if server else None,
                  "workload": {"name": cfg.workload, "dir": str(wdir), "seed": cfg.seed, "counts": cfg.counts},
                  "server_config": _server_config(url), "startup_s": server.startup_s if server else None,
                  "tiers": {}}
        for tier in cfg.tiers:
            pairs = read_pairs(tier_file(wdir, tier))
            requests = sample_requests(pairs, tok)
            if cfg.client == "sglang":
                s = _official_tier(cfg, url, pairs, requests, tier)
            else:
                s = _our_tier(cfg, url, requests, tier)
            result["tiers"][tier] = s
            tput = s["output_throughput"]
            print(f"{tier}: {s['successes']}/{s['requests']} ok, duration {s['duration_s']:.2f} s, "
                  f"{'-' if tput is None else f'{tput:.1f}'} output tok/s, "
                  f"lengths exact: {s['length_check']['ok']}", flush=True)
        # what the server built after it reported ready (a cold path the tiers hit; 0 expected)
        result["server_info_after"] = _server_config(url)
    finally:
        if server is not None:
            server.stop()
    return result
