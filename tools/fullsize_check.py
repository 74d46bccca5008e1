"""Full-size sanity check on a GPU: the reference (and optionally the engine) at the real 9.48B
shapes with dummy weights.

    python -m tools.fullsize_check --prompt-len 9000 [--engine] [--json OUT.json]

Builds `make-checkpoint --preset full --no-weights` in a temp dir, loads it with
load_format="dummy" on the GPU, runs a prompt in the sparse regime and a few decode steps, and
reports time, peak memory and whether the logits are finite. With --engine it also runs the
serving engine on the same weights and compares logits against the reference (relative error,
top-1 agreement).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from salaserve.model.checkpoint import write_checkpoint
from salaserve.model.reference import ReferenceModel


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=9000)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--engine", action="store_true", help="also compare the engine against the reference")
    ap.add_argument("--engine-prompt-len", type=int, default=1024)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

    d = tempfile.mkdtemp(prefix="sala-full-")
    t0 = time.perf_counter()
    write_checkpoint(d, "full", weights=False)
    results["make_checkpoint_s"] = time.perf_counter() - t0

    torch.cuda.reset_peak_memory_stats()
    t0 = sync_time()
    ref = ReferenceModel.from_pretrained(d, dtype=torch.bfloat16, device="cuda", load_format="dummy", seed=0)
    results["reference_load_s"] = sync_time() - t0
    results["weights_gib"] = torch.cuda.memory_allocated() / 2**30

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ref.config.vocab_size - 8, (a.prompt_len,), generator=g)
    state = ref.new_state()
    t0 = sync_time()
    logits = ref.forward(ids, state)
    results["reference_prefill_s"] = sync_time() - t0
    last = logits[-1]
    toks = []
    t0 = sync_time()
    for _ in range(a.decode_steps):
        t = int(last.argmax())
        toks.append(t)
        last = ref.forward([t], state)[-1]
    results["reference_decode_s_per_step"] = (sync_time() - t0) / max(1, a.decode_steps)
    results["prompt_len"] = a.prompt_len
    results["logits_finite"] = bool(torch.isfinite(logits).all()) and bool(torch.isfinite(last).all())
    results["logits_std"] = float(logits[-1].float().std())
    results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del logits, state

    if a.engine:
        from salaserve.core.sampling_params import SamplingParams
        from salaserve.engine.engine import Engine

        engine = Engine(model=d, device="cuda", dtype="bfloat16", backend=a.backend, load_format="dummy",
                        max_total_tokens=65536, max_running_requests=8, chunked_prefill_size=8192)
        captured = []
        fwd = engine.runner.forward

        def wrapped(work, **kw):
            out = fwd(work, **kw)
            captured.append(out.float().clone())
            return out

        engine.runner.forward = wrapped
        prompt = ids[: a.engine_prompt_len].tolist()
        engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_new_tokens=a.decode_steps + 1,
                                                       ignore_eos=True))
        steps = []
        while engine.has_unfinished():
            t0 = sync_time()
            engine.step()
            steps.append(sync_time() - t0)
        results["engine_prefill_s"] = steps[0]
        results["engine_decode_s_per_step"] = sum(steps[1:]) / max(1, len(steps) - 1)
        eng_rows = torch.cat(captured)  # prefill's last row + decode rows
        state = ref.new_state()
        rows = [ref.forward(prompt, state)[-1]]
        # feed the engine's own greedy tokens so both follow the same sequence
        gen = [int(r.argmax()) for r in eng_rows]
        for t in gen[:-1]:
            rows.append(ref.forward([t], state)[-1])
        ref_rows = torch.stack(rows).float()
        rel = ((eng_rows - ref_rows).norm(dim=-1) / ref_rows.norm(dim=-1)).max().item()
        agree = (eng_rows.argmax(-1) == ref_rows.argmax(-1)).float().mean().item()
        results["engine_vs_reference_max_rel_err"] = rel
        results["engine_vs_reference_top1_agreement"] = agree
        results["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30

    print(json.dumps(results, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
