"""Host time of an engine decode step on the CPU, the model forward faked (GPU-free).

    .venv/bin/python scripts/host_step_time.py [--batch 1 32 128] [--steps 200]

The tiny model's engine runs `batch` greedy requests into decode; then runner.forward is replaced
by one returning ready logits, so that each engine.step() times only the engine's own Python
(scheduling, batch build, sampling bookkeeping, outputs). Prints the median ms per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from salaserve.engine.engine import Engine
from salaserve.engine.sampling_params import SamplingParams
from salaserve.model.checkpoint import write_checkpoint


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    d = tempfile.mkdtemp()
    write_checkpoint(d, "tiny", seed=0)
    for b in a.batch:
        eng = Engine(model=d, device="cpu", dtype="float32", backend="torch", max_running_requests=b,
                     chunked_prefill_size=8192, overlap_schedule=False)
        for i in range(b):
            eng.add_request(f"r{i}", [3 + (i * 7 + j) % 500 for j in range(32)],
                            SamplingParams(temperature=0.0, max_new_tokens=10**6, ignore_eos=True))
        while any(not r.is_decoding for r in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        logits = torch.randn(b, eng.cfg.vocab_size)
        eng.runner.forward = lambda work, **kw: logits[:len(work)]
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"batch {b:4d}: {statistics.median(times):.3f} ms per step (host only)", flush=True)


if __name__ == "__main__":
    main()
