"""Micro-benchmark of the full-size model: decode step time vs batch and context, prefill time vs
length, each next to its floor (measured copy bandwidth and matmul rate, same run).

    python -m benchmarks.micro [--batches 1,8,32,128] [--contexts 4096,32768,131072,524288]
                                    [--prefill 8192,32768,131072] [--json OUT.json]

Decode: sequences are set up as if already prefilled to the context length (pages allocated and
filled with random keys/values, random Lightning states), then one decode step is timed as the
engine runs it (CUDA-graph replay when available) and, separately, the whole engine-side step
(metadata build + copy + replay), and the engine's own loop (`Engine.step`: scheduling, build,
forward, greedy sampling, outputs) with overlap scheduling and with serial steps. Prefill: one
request of the given length through the engine's chunked prefill, timed end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from salaserve.bench.floors import Ceilings, decode_bytes, measure_ceilings, prefill_flops
from salaserve.config import EngineArgs
from salaserve.core.request import Request, Status
from salaserve.core.sampling_params import SamplingParams
from salaserve.engine.engine import Engine
from salaserve.engine.runner import ModelRunner
from salaserve.engine.sampler import SamplingState
from salaserve.engine.scheduler import ScheduledWork


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def model_dir_or_full(model_dir: str | None) -> str:
    """The given model directory, or a fresh full-size config (no weights: load_format="dummy")."""
    if model_dir is not None:
        return model_dir
    import tempfile

    from salaserve.model.checkpoint import write_checkpoint

    model_dir = tempfile.mkdtemp(prefix="sala-full-")
    write_checkpoint(model_dir, "full", weights=False)
    return model_dir


def fake_decoding_requests(runner: ModelRunner, batch: int, context: int, extra_tokens: int = 0) -> list[Request]:
    """Requests that look prefilled to `context` tokens: pages and slots taken, caches random.
    Pages cover `extra_tokens` more (speculative verify writes past the pending token)."""
    caches = runner.caches
    block = caches.kv.block_size
    reqs = []
    g = torch.Generator(device=runner.device).manual_seed(batch * 7 + context)
    for i in range(batch):
        pages = caches.kv.allocator.alloc(-(-(context + 1 + extra_tokens) // block))
        slot = caches.states.alloc()
        r = Request(rid=f"b{i}", prompt_ids=[5] * context, params=SamplingParams(max_new_tokens=1 << 30))
        r.tokens.append(7)  # one sampled token pending: the request is decoding
        r.num_computed = context
        r.pages, r.state_slot, r.status = pages, slot, Status.RUNNING
        idx = torch.tensor(pages, device=runner.device)
        for pool in (caches.kv.k, caches.kv.v, caches.compressed.c1, caches.compressed.c2):
            pool[:, idx] = torch.randn(pool[:, idx].shape, generator=g, device=runner.device, dtype=torch.float32).to(pool.dtype)
        caches.states.state[slot].normal_(generator=g).mul_(0.1)
        reqs.append(r)
    return reqs


def release(runner: ModelRunner, reqs: list[Request]) -> None:
    for r in reqs:
        runner.caches.kv.allocator.free(r.pages)
        runner.caches.states.free(r.state_slot)


def step_device_ms(runner: ModelRunner, batch, iters: int = 30) -> tuple[float, bool]:
    """Median device ms of one forward of `batch` as the runner runs it (its CUDA graph when one
    fits, else eagerly), timed with CUDA events after 3 warm-up runs; and whether a graph ran."""
    graph = runner.graphs is not None and runner.graphs.can_run(batch)
    for _ in range(3):
        runner.run_batch(batch)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        runner.run_batch(batch)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev), graph


def time_decode(runner: ModelRunner, batch: int, context: int, iters: int = 30) -> dict:
    reqs = fake_decoding_requests(runner, batch, context)
    work = [ScheduledWork(r, 1) for r in reqs]
    device_ms, _ = step_device_ms(runner, runner.build_batch(work), iters)  # warms up too
    # host-inclusive step: build metadata + forward + wait for the logits
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.forward(work)
        torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
    # where the host part goes: building the batch, and handing it to the GPU (graph inputs + replay)
    build, launch = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        batch = runner.build_batch(work)
        t1 = time.perf_counter()
        runner.run_batch(batch)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        build.append((t1 - t0) * 1e3)
        launch.append((t2 - t1) * 1e3)
    release(runner, reqs)
    return {"device_ms": device_ms, "step_ms": statistics.median(host),
            "host_build_ms": statistics.median(build), "host_launch_ms": statistics.median(launch)}


def time_engine_decode(engine: Engine, batch: int, context: int, overlap: bool, steps: int = 30) -> float:
    """ms per `Engine.step` with `batch` greedy requests decoding at `context` (after 5 warm-up
    steps), with overlap scheduling on or off. The requests are aborted afterwards."""
    reqs = fake_decoding_requests(engine.runner, batch, context)
    for r in reqs:
        r.params = SamplingParams(temperature=0.0, max_new_tokens=1 << 30, ignore_eos=True)
        r.sampling = SamplingState(r.params, r.prompt_ids)
        engine.requests[r.rid] = r
        engine.scheduler.running.append(r)
        engine.scheduler.compressed.on_extend(0, r.num_computed)  # as if prefilled (accounting)
    engine.overlap = overlap
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    for _ in range(5):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for r in reqs:
        engine.abort(r.rid)
    while engine.has_unfinished():  # the step still in flight
        engine.step()
    return ms


def fresh_prompt(runner: ModelRunner, tokens: int) -> Request:
    """A running request with a prompt of `tokens` random ids, its pages and a zeroed state slot,
    nothing computed yet (release() frees them)."""
    caches = runner.caches
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, runner.cfg.vocab_size - 8, (tokens,), generator=g).tolist()
    r = Request(rid="p", prompt_ids=ids, params=SamplingParams(max_new_tokens=1))
    r.pages = caches.kv.allocator.alloc(-(-tokens // caches.kv.block_size))
    r.state_slot = caches.states.alloc()
    caches.states.state[r.state_slot].zero_()
    r.status = Status.RUNNING
    return r


def time_prefill(runner: ModelRunner, tokens: int, chunk: int | None = None) -> float:
    """Seconds for one `tokens`-long prompt, in chunks of `chunk` tokens (default: the engine's
    chunked_prefill_size)."""
    chunk = chunk or runner.args.chunked_prefill_size
    r = fresh_prompt(runner, tokens)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while r.num_computed < tokens:
        n = min(chunk, tokens - r.num_computed)
        runner.forward([ScheduledWork(r, n)])
        r.num_computed += n
    sync()
    dt = time.perf_counter() - t0
    release(runner, [r])
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model dir (default: a full-size config with dummy weights)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="4096,32768,131072,524288")
    ap.add_argument("--prefill", default="8192,32768,131072", help='"" skips the prefill rows')
    ap.add_argument("--prefill-repeats", type=int, default=3,
                    help="timed prompts per prefill length after an uncounted first one (median reported)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quantization", default=None, choices=["fp8", "w4a16"], help="quantize the weights on load")
    ap.add_argument("--quantize-lm-head", action="store_true", help="lm_head quantized on load too (default bf16)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                    help="fp8_e4m3: the sparse layers' K/V pages in fp8 with per-page scales")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--max-kv-gib", type=float, default=90.0, help="skip decode points needing more KV")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    model_dir = model_dir_or_full(a.model)
    batches, contexts, prefills = _ints(a.batches), _ints(a.contexts), _ints(a.prefill)
    cfg_tokens = max(max(contexts) + 128, max(prefills, default=0) + 128)
    kv_tokens = int(a.max_kv_gib * 2**30 / 8704)  # ~8.5 KiB per token incl. compressed keys
    args = EngineArgs(model=model_dir, backend=a.backend, load_format="dummy", dtype="bfloat16",
                      max_running_requests=max(batches), max_total_tokens=max(kv_tokens, cfg_tokens),
                      enable_cuda_graph=not a.no_cuda_graph, context_length=max(contexts) + 1024,
                      quantization=a.quantization, quantize_lm_head=a.quantize_lm_head,
                      kv_cache_dtype=a.kv_cache_dtype)
    t0 = time.perf_counter()
    engine = Engine(args)
    runner = engine.runner
    startup = time.perf_counter() - t0
    ceil: Ceilings = measure_ceilings()
    cfg = runner.cfg
    gbps = ceil.copy_gbps * 1e9
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": runner.backend_name,
              "quantization": a.quantization, "quantize_lm_head": a.quantize_lm_head,
              "kv_cache_dtype": a.kv_cache_dtype,
              "kv_page_bytes": runner.plan.page_bytes,
              "cuda_graphs": runner.graphs is not None, "startup_s": startup, "startup_phases": runner.startup_phases,
              "graph_capture_s": runner.graphs.capture_seconds if runner.graphs else 0.0,
              "copy_gbps": ceil.copy_gbps, "matmul_tflops": ceil.matmul_tflops, "decode": [], "prefill": []}

    print(f"GPU {result['gpu']}: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.matmul_tflops:.0f} TFLOP/s; "
          f"backend {runner.backend_name}, graphs {result['cuda_graphs']}, start-up {startup:.1f} s, "
          f"KV cache {a.kv_cache_dtype}")
    print(f"start-up phases: {runner.describe_startup()}")
    print(f"{'decode':>8} {'batch':>6} {'context':>8} {'device ms':>10} {'step ms':>8} {'floor ms':>9} {'floor/dev':>9} {'tok/s':>9} {'build ms':>8} {'launch ms':>9} "
          f"{'eng ms':>7} {'eng tok/s':>9} {'serial ms':>9}")
    free_tokens = runner.caches.kv.allocator.num_free * runner.caches.kv.block_size
    for ctx in contexts:
        for b in batches:
            if b * (ctx + 128) > free_tokens or b > runner.caches.states.num_free:
                print(f"{'':>8} {b:>6} {ctx:>8}  skipped: KV for {b}x{ctx} tokens exceeds the pool")
                continue
            t = time_decode(runner, b, ctx)
            t["engine_overlap_ms"] = time_engine_decode(engine, b, ctx, overlap=True)
            t["engine_serial_ms"] = time_engine_decode(engine, b, ctx, overlap=False)
            wbytes = {None: 2.0, "fp8": 1.0, "w4a16": 0.5 + 2 / 128}[a.quantization]  # + group scales
            floor_ms = decode_bytes(cfg, b, ctx, weight_bytes_per_param=wbytes,
                                    lm_head_bytes_per_param=wbytes if a.quantize_lm_head else 2.0) / gbps * 1e3
            row = {"batch": b, "context": ctx, **t, "floor_ms": floor_ms,
                   "achieved_over_floor": floor_ms / t["device_ms"], "tokens_per_s": b / t["step_ms"] * 1e3,
                   "engine_tokens_per_s": b / t["engine_overlap_ms"] * 1e3}
            result["decode"].append(row)
            print(f"{'':>8} {b:>6} {ctx:>8} {t['device_ms']:>10.3f} {t['step_ms']:>8.3f} {floor_ms:>9.3f} "
                  f"{row['achieved_over_floor']:>9.2f} {row['tokens_per_s']:>9.0f} {t['host_build_ms']:>8.3f} "
                  f"{t['host_launch_ms']:>9.3f} {t['engine_overlap_ms']:>7.3f} {row['engine_tokens_per_s']:>9.0f} "
                  f"{t['engine_serial_ms']:>9.3f}")
    # first calls compile kernels and run fla's autotuner (tens of seconds): not part of a prefill
    if prefills:
        time_prefill(runner, min(2 * runner.args.chunked_prefill_size, max(prefills)))
        print(f"{'prefill':>8} {'tokens':>8} {'seconds':>8} {'floor s':>8} {'floor/ach':>9} {'tok/s':>9} {'first s':>8}"
              f" {'min-max s':>11}")
    for n in prefills:
        # The first prompt is not counted: later chunks of a long prompt meet kernel
        # specialisations the warm-up did not (integer arguments' divisibility), and compiling
        # them cost a cold first process ~0.6 s of a 128K prefill. Then the
        # median of --prefill-repeats prompts (one prompt varied by 2-3% between processes).
        first = time_prefill(runner, n)
        runs = [time_prefill(runner, n) for _ in range(max(1, a.prefill_repeats))]
        dt = statistics.median(runs)
        floor_s = prefill_flops(cfg, n) / (ceil.matmul_tflops * 1e12)
        row = {"tokens": n, "seconds": dt, "runs_seconds": runs, "first_seconds": first, "floor_s": floor_s,
               "achieved_over_floor": floor_s / dt, "tokens_per_s": n / dt}
        result["prefill"].append(row)
        print(f"{'':>8} {n:>8} {dt:>8.3f} {floor_s:>8.2f} {row['achieved_over_floor']:>9.2f} {n / dt:>9.0f} "
              f"{first:>8.2f} {min(runs):>5.3f}-{max(runs):.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
