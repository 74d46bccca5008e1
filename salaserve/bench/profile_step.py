"""Where a decode (or verify) step's time goes: per-kernel device time of one eager step.

    python -m salaserve.bench.profile_step [--model DIR] [--batch 1] [--context 131072]
                                           [--verify-k 0] [--top 25] [--json OUT.json]

Sequences are set up as in the micro-benchmark (prefilled to the context, random caches), then
one step runs eagerly under torch.profiler (the kernels are the ones the CUDA graph replays; the
launch gaps between them are not). Prints the kernels by total device time, with call counts,
and the total. Without a GPU it profiles the CPU ops instead (for tests of the tool).
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from salaserve.bench.micro import fake_decoding_requests, model_dir_or_full, release
from salaserve.config import EngineArgs
from salaserve.engine.runner import ModelRunner
from salaserve.engine.scheduler import ScheduledWork


def profile_step(runner: ModelRunner, batch: int, context: int, verify_k: int = 0, iters: int = 3) -> list[dict]:
    """[{name, total_us, calls}] of one step (averaged over `iters` runs), largest first."""
    reqs = fake_decoding_requests(runner, batch, context, extra_tokens=verify_k)
    work = [ScheduledWork(r, 1 + verify_k, [11 + j for j in range(verify_k)]) for r in reqs]
    b = runner.build_batch(work)
    cuda = runner.device.type == "cuda"
    for _ in range(2):  # compile / autotune outside the profile
        runner.model.forward(b, runner.caches)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(iters):
            runner.model.forward(b, runner.caches)
        if cuda:
            torch.cuda.synchronize()
    release(runner, reqs)
    rows = []
    for e in prof.key_averages():
        us = (e.device_time_total if cuda else e.self_cpu_time_total) / iters
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            rows.append({"name": e.key, "total_us": us, "calls": e.count // iters})
    return sorted(rows, key=lambda r: -r["total_us"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: a full-size config with dummy weights)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--verify-k", type=int, default=0, help="draft tokens per sequence (0: plain decode)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model_dir = model_dir_or_full(a.model)
    tokens = a.batch * (a.context + a.verify_k + 256) + 4096
    runner = ModelRunner(EngineArgs(model=model_dir, load_format="dummy", max_running_requests=max(a.batch, 1),
                                    max_total_tokens=tokens, context_length=a.context + 1024,
                                    enable_cuda_graph=False, kv_cache_dtype=a.kv_cache_dtype), model_dir)
    rows = profile_step(runner, a.batch, a.context, a.verify_k)
    total = sum(r["total_us"] for r in rows)
    print(f"batch {a.batch}, context {a.context}, verify k {a.verify_k}: {total / 1e3:.3f} ms of kernels")
    print(f"{'us':>9} {'share':>6} {'calls':>6}  kernel")
    for r in rows[: a.top]:
        print(f"{r['total_us']:>9.1f} {r['total_us'] / total:>6.1%} {r['calls']:>6}  {r['name'][:100]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"batch": a.batch, "context": a.context, "verify_k": a.verify_k, "total_us": total,
                       "kernels": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
