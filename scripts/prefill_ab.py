"""A/B of the long-prompt prefill's engine-level options in one process (GPU only).

    python scripts/prefill_ab.py [--tokens 131072] [--reps 3] [--json OUT]
        [--variants "8192:fp32,8192:bf16,16384:fp32,16384:bf16"]

Each variant is "chunk:gla[:stage1[:pages]]": the prefill chunk size (engine arg
chunked_prefill_size), fla's input precision (the backend's gla_input_dtype, SALASERVE_GLA_INPUT),
optionally the stage-1 keys kernel's prefill launch "warps/stages/maxnreg" (sparse.STAGE1_PREFILL_LAUNCH,
SALASERVE_STAGE1_LAUNCH; "/" instead of ","; empty: the default) and the per-token attention's
page list, 0 or 1 (sparse.SPARSE_ATTN_PAGE_LIST). One engine (full config,
dummy weights, micro's set-up); each variant runs one uncounted prompt (new kernel
specialisations), then the variants are timed in turn, `--reps` rounds, so that drift between
rounds hits every variant alike. Prints the median seconds per variant.
Why: the 128K prefill is 4.81 s against the 4.5 s target (issue 4); bf16 GLA inputs measured
-0.08 s in separate processes (run 54), and larger chunks cut per-chunk launches and syncs and
give the GEMMs a larger M.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salaserve.bench.micro import model_dir_or_full, time_prefill  # noqa: E402
from salaserve.config import EngineArgs  # noqa: E402
from salaserve.engine.engine import Engine  # noqa: E402
from salaserve.kernels import sparse as ks  # noqa: E402

GLA = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default="8192:fp32,8192:bf16,16384:fp32,16384:bf16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    variants = [tuple(v.split(":")) for v in a.variants.split(",")]
    variants = [(int(v[0]), v[1], v[2] if len(v) > 2 else "", v[3] if len(v) > 3 else "") for v in variants]
    max_chunk = max(v[0] for v in variants)
    default_stage1, default_pages = dict(ks.STAGE1_PREFILL_LAUNCH), ks.SPARSE_ATTN_PAGE_LIST
    args = EngineArgs(model=model_dir_or_full(None), load_format="dummy", dtype="bfloat16",
                      max_running_requests=4, max_total_tokens=a.tokens + 4 * max_chunk,
                      context_length=a.tokens + 1024, chunked_prefill_size=max_chunk,
                      enable_cuda_graph=False)  # prefill runs eagerly; capture only costs start-up
    runner = Engine(args).runner
    ops = runner.model.ops

    def prompt(chunk: int, gla: str, stage1: str, pages: str) -> float:
        ops.gla_input_dtype = GLA[gla]
        ks.set_knob("SPARSE_ATTN_PAGE_LIST", default_pages if pages == "" else pages == "1")
        ks.set_knob("STAGE1_PREFILL_LAUNCH",
                    ks.launch_options(*map(int, stage1.split("/"))) if stage1 else default_stage1)
        return time_prefill(runner, a.tokens, chunk)

    first = {v: prompt(*v) for v in variants}
    times = {v: [] for v in variants}
    for _ in range(a.reps):
        for v in variants:
            times[v].append(prompt(*v))
    rows = []
    print(f"{'chunk':>6} {'gla':>5} {'stage-1':>9} {'pages':>5} {'median s':>9} {'runs s':>24} {'first s':>8}")
    for v in variants:
        med = statistics.median(times[v])
        rows.append({"chunk": v[0], "gla": v[1], "stage1_launch": v[2] or "default", "page_list": v[3] or "default",
                     "median_s": med, "runs_s": times[v], "first_s": first[v]})
        print(f"{v[0]:>6} {v[1]:>5} {v[2] or 'default':>9} {v[3] or '-':>5} {med:>9.3f} {' '.join(f'{t:.3f}' for t in times[v]):>24} "
              f"{first[v]:>8.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "tokens": a.tokens,
                                            "variants": rows}, indent=2))


if __name__ == "__main__":
    main()
