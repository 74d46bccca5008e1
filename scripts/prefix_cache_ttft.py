"""Time to first token with and without the prefix cache.

    .venv/bin/python scripts/prefix_cache_ttft.py [--system 3000] [--questions 6] [--turns 3]
    python scripts/prefix_cache_ttft.py --device cuda --preset full --system 32768   (GPU, dummy weights)

A system prompt shared by several questions, then a conversation whose turns extend each other;
each request alone, max_new_tokens=1, wall time from add_request to its first token. Prints the
per-request times and the tokens the cache supplied, for an engine with the cache and without.
Each engine runs the workload twice on different random tokens and reports the second pass (the
first compiles kernels for the new lengths).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time

import torch

from salaserve.engine.engine import Engine
from salaserve.engine.sampling_params import SamplingParams
from salaserve.model.checkpoint import write_checkpoint


def first_token_ms(eng, rid, prompt):
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            out += o.new_token_ids
    return (time.perf_counter() - t0) * 1e3, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", type=int, default=3000)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny", help="tiny (random weights, fp32) or full (dummy weights, bf16)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    d = tempfile.mkdtemp()
    full = a.preset != "tiny"
    write_checkpoint(d, a.preset, seed=0, **({"weights": False} if full else {}))
    kw = dict(load_format="dummy", dtype="bfloat16", chunked_prefill_size=8192) if full else dict(
        dtype="float32", backend="torch", chunked_prefill_size=512)
    for slots in (4, 0):
        eng = Engine(model=d, device=a.device, prefix_cache_slots=slots, **kw)
        for rep in range(2):  # the same workload on fresh tokens; the second pass is reported
            rng = random.Random(rep)
            system = [rng.randrange(3, 8000) for _ in range(a.system)]
            questions = [system + [rng.randrange(3, 8000) for _ in range(50)] for _ in range(a.questions)]
            cached0 = eng.stats["cached_prompt_tokens"]
            times = [first_token_ms(eng, f"q{rep}.{i}", q)[0] for i, q in enumerate(questions)]
            convo, turn_times = list(questions[0]), []
            for t in range(a.turns):
                convo += [rng.randrange(3, 8000) for _ in range(40)]
                ms, out = first_token_ms(eng, f"t{rep}.{t}", convo)
                turn_times.append(ms)
                convo += out
        print(f"prefix cache slots {slots}: questions {' '.join(f'{t:.0f}' for t in times)} ms "
              f"(median of 3rd on {statistics.median(times[2:]):.0f}); turns {' '.join(f'{t:.0f}' for t in turn_times)} ms; "
              f"cached prompt tokens {eng.stats['cached_prompt_tokens'] - cached0}", flush=True)
        del eng  # the next engine plans its caches from the memory this one held
        gc.collect()
        if a.device != "cpu":
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
