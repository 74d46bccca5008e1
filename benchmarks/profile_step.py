"""Where a decode (or verify) step's time goes: per-kernel device time of one step.

    python -m benchmarks.profile_step [--model DIR] [--batch 1] [--context 131072[,4096...]]
                                           [--verify-k 0] [--graph] [--no-pdl] [--top 25]
                                           [--quantization {fp8,w4a16} [--quantize-lm-head]]
                                           [--json OUT.json]
    python -m benchmarks.profile_step --prefill 131072 [--model DIR] [--top 25] [--json OUT.json]
    python -m benchmarks.profile_step --graph --ab MODULE:ATTR=V1,V2 [--rounds 5] [...]
    python -m benchmarks.profile_step --graph --ab-kv-cache [--kv-cache-dtype fp8_e4m3] [--rounds 5] [...]
    python -m benchmarks.profile_step --mixed 128 --batch 31 --context 16384 [--quantization w4a16] [...]

Sequences are set up as in the micro-benchmark (prefilled to the context, random caches). By
default one step runs eagerly under torch.profiler: the kernels are the ones the CUDA graph
replays, but eager kernel times and launch gaps differ from the replay's. With --graph the
runner's captured decode graph is replayed instead, and the kernel timeline of that replay is
read back: its span, the time no kernel runs (gaps), the largest gaps with their neighbours, and
the kernels by total time. Prints the kernels by total device time, with call counts, and the
total. With --prefill N it profiles one whole N-token prompt instead, chunked as the engine
chunks it (the micro-benchmark's prefill): kernels by total time over all chunks. Without a GPU it
profiles the CPU ops instead (for tests of the tool). With --ab it compares a module switch's values
instead, in one process: graphs captured per value, replays timed in interleaved rounds (machine
starts differ by ~0.05 ms per step, more than most changes). --ab-kv-cache does
the same for the KV cache's format: a second pool of the other format, same pages and contents.
With --mixed T it times one eager step of --batch decoding sequences plus a T-token prompt chunk (the
steps that carry prefill in S8 and Smax): its wall time, the host time until the forward returns,
and under the profiler the kernels' busy and idle time. A step whose host time is close to its wall
time is bound by its launches, not its kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.micro import fake_decoding_requests, fresh_prompt, model_dir_or_full, release, time_prefill
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
    return _kernel_rows(prof, cuda, iters)


def _kernel_rows(prof, cuda: bool, iters: int = 1) -> list[dict]:
    """[{name, total_us, calls}] per run of the profiled region, largest first: device kernels on
    a GPU, CPU ops elsewhere."""
    rows = []
    for e in prof.key_averages():
        us = (e.device_time_total if cuda else e.self_cpu_time_total) / iters
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            rows.append({"name": e.key, "total_us": us, "calls": e.count // iters})
    return sorted(rows, key=lambda r: -r["total_us"])


def profile_prefill(runner: ModelRunner, tokens: int) -> tuple[list[dict], float, dict]:
    """Kernel rows of one `tokens`-long prompt prefilled in the engine's chunks, its wall seconds
    under the profiler (a first, shorter prompt compiles and autotunes outside it), and on a GPU
    its kernel_timeline (without the sequence) plus the CUDA runtime calls that can leave the GPU
    idle (syncs, copies, allocations: {name: [calls, host us]})."""
    cuda = runner.device.type == "cuda"
    time_prefill(runner, min(2 * runner.args.chunked_prefill_size, tokens))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]) as prof:
        seconds = time_prefill(runner, tokens)
    timeline = {}
    if cuda:
        events = _trace_events(prof)
        timeline = kernel_timeline(events)
        timeline.pop("sequence")
        timeline["runtime_calls"] = _blocking_calls(events)
    return _kernel_rows(prof, cuda), seconds, timeline


def profile_mixed(runner: ModelRunner, batch: int, context: int, tokens: int, iters: int = 5) -> dict:
    """One eager step of `batch` sequences decoding at `context` plus a fresh prompt's first
    `tokens` tokens, run `iters` times after 2 warm-up runs (nothing advances: every run computes
    the same step). Medians of its wall ms (batch build, forward, wait for the logits), of the host
    ms until the forward returns (everything launched) and of the batch build alone; then one run
    under the profiler: kernel count, busy and idle ms, and the runtime calls that can block."""
    reqs = fake_decoding_requests(runner, batch, context)
    prompt = fresh_prompt(runner, tokens)
    work = [ScheduledWork(r, 1) for r in reqs] + [ScheduledWork(prompt, tokens)]
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    wall, host, build = [], [], []
    try:
        for i in range(2 + iters):
            sync()
            t0 = time.perf_counter()
            runner.build_batch(work)
            t1 = time.perf_counter()
            runner.forward(work)
            t2 = time.perf_counter()
            sync()
            t3 = time.perf_counter()
            if i >= 2:
                build.append((t1 - t0) * 1e3)
                host.append((t2 - t1) * 1e3)
                wall.append((t3 - t1) * 1e3)
        activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            runner.forward(work)
            sync()
    finally:
        release(runner, [*reqs, prompt])
    out = {"batch": batch, "context": context, "prefill_tokens": tokens, "wall_ms": statistics.median(wall),
           "host_ms": statistics.median(host), "build_ms": statistics.median(build)}
    if cuda:
        events = _trace_events(prof)
        tl = kernel_timeline(events)
        out.update(kernels=tl["kernels"], busy_ms=tl["busy_us"] / 1e3, idle_ms=tl["idle_us"] / 1e3,
                   gaps=tl["gaps"][:10], runtime_calls=_blocking_calls(events))
    out["rows"] = _kernel_rows(prof, cuda)
    return out


def _blocking_calls(events: list[dict]) -> dict:
    """{CUDA runtime call: [calls, host us]} of the calls in _BLOCKING_CALLS."""
    blocking: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cuda_runtime" and any(k in name for k in _BLOCKING_CALLS):
            blocking[name][0] += 1
            blocking[name][1] += e.get("dur", 0.0)
    return dict(blocking)


def _trace_events(prof) -> list[dict]:
    """The chrome-trace events of a finished torch.profiler run."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


# CUDA runtime calls during a prefill that can stall the stream or the host: any of them in the
# trace points at a sync, a host copy or an allocation on the critical path
_BLOCKING_CALLS = ("Synchronize", "Memcpy", "Malloc", "Free", "HostAlloc", "MemsetAsync")


def kernel_timeline(trace_events: list[dict], top_gaps: int = 15) -> dict:
    """Summary of one graph replay's kernels from a chrome trace's events: span (first start to
    last end), busy (union of kernel intervals), idle = span - busy, the kernels in order, and the
    largest gaps between consecutive kernels with the kernels on either side (times in us)."""
    ks = sorted((e for e in trace_events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    if not ks:
        return {"kernels": 0, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": [], "sequence": []}
    t0 = ks[0]["ts"]
    busy, end, last, gaps, seq = 0.0, t0, None, [], []
    for e in ks:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if last is not None and start > end:
            gaps.append({"gap_us": start - end, "after": last, "before": e["name"], "at_us": end - t0})
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, last = stop, e["name"]
        seq.append({"name": e["name"], "start_us": start - t0, "dur_us": e["dur"]})
    span = end - t0
    return {"kernels": len(ks), "span_us": span, "busy_us": busy, "idle_us": span - busy,
            "gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:top_gaps], "sequence": seq}


def profile_graph_replay(runner: ModelRunner, batch: int, context: int) -> dict:
    """Replay the captured decode graph for `batch` sequences at `context` once under the
    profiler; kernel_timeline of that replay plus per-kernel totals ({name, total_us, calls})."""
    from benchmarks.micro import step_device_ms

    reqs = fake_decoding_requests(runner, batch, context)
    b = runner.build_batch([ScheduledWork(r, 1) for r in reqs])
    if runner.graphs is None or not runner.graphs.can_run(b):
        release(runner, reqs)
        raise SystemExit("--graph: no captured decode graph fits this batch (CUDA and the triton backend needed)")
    device_ms, _ = step_device_ms(runner, b)  # warms up too
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.graphs.run(b)
        torch.cuda.synchronize()
    release(runner, reqs)
    tl = kernel_timeline(_trace_events(prof))
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for k in tl["sequence"]:
        totals[k["name"]][0] += k["dur_us"]
        totals[k["name"]][1] += 1
    rows = sorted(({"name": n, "total_us": t, "calls": c} for n, (t, c) in totals.items()), key=lambda r: -r["total_us"])
    return {**tl, "device_ms_events": device_ms, "rows": rows}


def parse_ab(spec: str) -> tuple[object, str, list]:
    """--ab "module:ATTR=v1,v2[,...]" -> (the imported module, ATTR, the values converted to the type of
    the attribute's current value: bools from 0/1/true/false, ints, floats, else strings). Raises
    ValueError (a CLI message) on a malformed spec, a missing module or attribute, or a bad value."""
    import importlib

    try:
        target, values = spec.split("=", 1)
        module_name, attr = target.split(":", 1)
    except ValueError:
        raise ValueError(f"--ab wants module:ATTR=v1,v2, got {spec!r}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--ab: cannot import {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"--ab: {module_name} has no attribute {attr!r}")
    current = getattr(module, attr)
    out = []
    for v in values.split(","):
        v = v.strip()
        if isinstance(current, bool):
            if v.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"--ab: {attr} is a bool; {v!r} is not 0/1/true/false")
            out.append(v.lower() in ("1", "true"))
        elif isinstance(current, (int, float)):
            try:
                out.append(type(current)(v))
            except ValueError:
                raise ValueError(f"--ab: {attr} is {type(current).__name__}; {v!r} is not") from None
        else:
            out.append(v)
    if len(set(out)) < len(out) or len(out) < 2:
        raise ValueError("--ab needs at least two distinct values to compare")
    return module, attr, out


def _interleaved_replays(runner: ModelRunner, batch: int, context: int, variants: dict, rounds: int, timer,
                         fill=None) -> dict:
    """The decode step's graph replay under each of `variants` ({label: apply()}, apply() puts the
    runner in that variant), in one process: one set of graphs captured per variant with it applied,
    then requests prefilled to `context` (fill(reqs) runs after they are made), then `rounds` rounds
    timing each variant in turn (interleaved: the same calibration and machine for all). Returns
    {label: [device ms per round]}; the runner keeps the first variant's graphs (the caller restores
    whatever else apply() changed)."""
    graphs = {}
    try:
        for label, apply in variants.items():
            apply()
            runner._capture_graphs()
            graphs[label] = runner.graphs
        first = next(iter(variants))
        variants[first]()
        reqs = fake_decoding_requests(runner, batch, context)
        if fill is not None:
            fill(reqs)
        b = runner.build_batch([ScheduledWork(r, 1) for r in reqs])
        times = {label: [] for label in variants}
        for _ in range(rounds):
            for label, apply in variants.items():
                apply()
                runner.graphs = graphs[label]
                ms, ran = timer(runner, b)
                if not ran:
                    raise SystemExit("--ab: no captured decode graph fits this batch")
                times[label].append(ms)
        variants[first]()
        release(runner, reqs)
    finally:
        if graphs:
            runner.graphs = graphs[next(iter(variants))]
    return times


def ab_graph_replays(runner: ModelRunner, batch: int, context: int, module, attr: str, values: list,
                     rounds: int = 5, timer=None) -> dict:
    """The decode step's graph replay with a module attribute (a switch read when the forward runs)
    set to each of `values`, in one process (_interleaved_replays). Returns {value: [device ms per
    round]}. timer(runner, batch) -> (ms, graph ran): micro's step_device_ms by default. The attribute
    is restored, and the runner keeps the first value's graphs. Switches consumed at start-up
    (calibration tables, weight preparation) need fresh starts."""
    from benchmarks.micro import step_device_ms

    original = getattr(module, attr)
    variants = {v: (lambda v=v: setattr(module, attr, v)) for v in values}
    try:
        return _interleaved_replays(runner, batch, context, variants, rounds, timer or step_device_ms)
    finally:
        setattr(module, attr, original)


def _pool_label(pool) -> str:
    return "fp8_e4m3 pages" if pool.fp8 else f"{str(pool.k.dtype).replace('torch.', '')} pages"


def ab_kv_cache_replays(runner: ModelRunner, batch: int, context: int, rounds: int = 5, timer=None) -> dict:
    """The decode step's graph replay on the runner's KV pages and on a second KV pool of the other
    format (fp8 e4m3 against the model dtype), in one process (_interleaved_replays). The second pool
    holds the same pages with the same random contents (rounded to its format; fp8 scales 1) and
    shares the compressed keys and the Lightning states. Returns {"<dtype> pages": [device ms per
    round]}, the runner's own format first; the runner keeps its own caches and graphs afterwards.
    The issue's fp8 KV criterion compares the two formats, and separate processes differ by more than
    the difference (a fraction of a percent at 128K)."""
    from benchmarks.micro import step_device_ms
    from salaserve.cache.pages import FP8, KVPool
    from salaserve.model.sala import Caches

    own = runner.caches
    n_layers, num_pages, block, kv_heads, head_dim = own.kv.k.shape
    other_kv = KVPool(n_layers, num_pages, block, kv_heads, head_dim, own.kv.compute_dtype if own.kv.fp8 else FP8,
                      own.kv.k.device, compute_dtype=own.kv.compute_dtype)
    other = Caches(kv=other_kv, compressed=own.compressed, states=own.states)

    def fill(reqs):
        for r in reqs:
            idx = torch.tensor(r.pages, device=own.kv.k.device)
            for src, dst in ((own.kv.k, other_kv.k), (own.kv.v, other_kv.v)):
                dst[:, idx] = src[:, idx].float().to(dst.dtype)

    def use(caches):
        runner.caches = caches

    variants = {_pool_label(own.kv): lambda: use(own), _pool_label(other_kv): lambda: use(other)}
    try:
        return _interleaved_replays(runner, batch, context, variants, rounds, timer or step_device_ms, fill)
    finally:
        runner.caches = own


# kernels that are a linear layer's GEMV (the Triton GEMVs, int4 and fp8 ones included) or its cuBLAS GEMM
_LINEAR_KERNELS = ("gemv", "nvjet", "gemm", "w8a16", "w8a8")
_LINEAR_NAMES = ("qkv", "o_proj", "gate_up", "down")


def linear_breakdown(sequence: list[dict], mixer_kinds: list[str]) -> list[dict] | None:
    """Per (layer kind, linear) of a decode graph's kernel sequence: calls and mean / min / max us,
    plus lm_head; the linears are the kernels named like _LINEAR_KERNELS, in order qkv, o_proj,
    gate_up, down per layer (mixer_kinds: each layer's kind, e.g. "sparse" / "lightning"), then
    lm_head. None where the count does not fit that pattern (another kernel mix; nothing guessed)."""
    durs = [k["dur_us"] for k in sequence if any(t in k["name"] for t in _LINEAR_KERNELS)]
    if len(durs) != 4 * len(mixer_kinds) + 1:
        return None
    groups: dict[tuple[str, str], list[float]] = {}
    for i, us in enumerate(durs[:-1]):
        groups.setdefault((mixer_kinds[i // 4], _LINEAR_NAMES[i % 4]), []).append(us)
    groups[("", "lm_head")] = [durs[-1]]
    return [{"layers": kind, "linear": name, "calls": len(v), "mean_us": sum(v) / len(v), "min_us": min(v),
             "max_us": max(v), "total_us": sum(v)} for (kind, name), v in groups.items()]


def _mixer_kinds(cfg) -> list[str]:
    return ["sparse" if cfg.is_sparse_layer(i) else "lightning" for i in range(cfg.num_hidden_layers)]


def _print_rows(rows: list[dict], top: int) -> float:
    total = sum(r["total_us"] for r in rows)
    print(f"{'us':>9} {'share':>6} {'calls':>6}  kernel")
    for r in rows[:top]:
        print(f"{r['total_us']:>9.1f} {r['total_us'] / total:>6.1%} {r['calls']:>6}  {r['name'][:100]}")
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: a full-size config with dummy weights)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="131072", help="context length(s), comma-separated")
    ap.add_argument("--verify-k", type=int, default=0, help="draft tokens per sequence (0: plain decode)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"])
    ap.add_argument("--quantization", default=None, choices=["fp8", "w4a16"],
                    help="weights quantized on load (default: bf16)")
    ap.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head on load too")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch without PDL, so that kernel times do not overlap (the step is slower); the plan "
                         "cache's fingerprint stays, so the PDL run's picks are reused")
    ap.add_argument("--graph", action="store_true", help="profile a replay of the captured decode graph")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    ap.add_argument("--mixed", type=int, default=0, metavar="T",
                    help="time one eager step of --batch decoding sequences at --context plus a T-token prompt chunk")
    ap.add_argument("--ab", default=None, metavar="MODULE:ATTR=V1,V2",
                    help="with --graph: time the replay with a module switch at each value, interleaved in this "
                         "process (e.g. salaserve.kernels._triton_utils:_PDL=1,0); switches read when the "
                         "forward runs, not at start-up")
    ap.add_argument("--ab-kv-cache", action="store_true",
                    help="with --graph: time the replay on the KV pages of --kv-cache-dtype and on a second pool of "
                         "the other format (bf16 / fp8 e4m3), interleaved in this process")
    ap.add_argument("--rounds", type=int, default=5, help="--ab / --ab-kv-cache: rounds of the interleaved timing")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    contexts = [int(c) for c in a.context.split(",")]
    if a.graph and a.verify_k:
        ap.error("--graph profiles plain decode graphs; drop --verify-k")
    if a.prefill and (a.graph or a.verify_k):
        ap.error("--prefill profiles a prompt; drop --graph / --verify-k")
    if a.mixed and (a.graph or a.verify_k or a.prefill or len(contexts) > 1):
        ap.error("--mixed times one eager step at one --context; drop --graph / --verify-k / --prefill")
    if a.quantize_lm_head and not a.quantization:
        ap.error("--quantize-lm-head needs --quantization")
    ab = None
    if (a.ab or a.ab_kv_cache) and not a.graph:
        ap.error("--ab / --ab-kv-cache compare graph replays; add --graph")
    if a.ab and a.ab_kv_cache:
        ap.error("--ab and --ab-kv-cache: one comparison per process")
    if a.ab:
        try:
            ab = parse_ab(a.ab)
        except ValueError as e:
            ap.error(str(e))
    if a.no_pdl:
        from salaserve.kernels._triton_utils import set_pdl

        set_pdl(False)
    model_dir = model_dir_or_full(a.model)
    if a.prefill:
        runner = ModelRunner(EngineArgs(model=model_dir, load_format="dummy", max_running_requests=1,
                                        max_total_tokens=a.prefill + 4096, context_length=a.prefill + 1024,
                                        enable_cuda_graph=False, kv_cache_dtype=a.kv_cache_dtype,
                                        quantization=a.quantization, quantize_lm_head=a.quantize_lm_head),
                             model_dir)
        rows, seconds, tl = profile_prefill(runner, a.prefill)
        total = sum(r["total_us"] for r in rows)
        print(f"prefill of {a.prefill} tokens: {seconds:.3f} s under the profiler, {total / 1e6:.3f} s of kernels")
        _print_rows(rows, a.top)
        if tl:
            print(f"timeline: span {tl['span_us'] / 1e6:.3f} s = {tl['busy_us'] / 1e6:.3f} s with a kernel running "
                  f"+ {tl['idle_us'] / 1e6:.3f} s idle; largest gaps (us, after -> before):")
            for g in tl["gaps"][:10]:
                print(f"{g['gap_us']:>9.1f} at {g['at_us'] / 1e3:8.1f} ms  {g['after'][:40]} -> {g['before'][:40]}")
            print("runtime calls that can block (calls, host us): "
                  + ", ".join(f"{n} {c} {us:.0f}" for n, (c, us) in sorted(tl["runtime_calls"].items())))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"prefill": a.prefill, "seconds": seconds, "total_us": total, "kernels": rows,
                           "timeline": tl}, f, indent=2)
        return 0
    if a.mixed:
        runner = ModelRunner(EngineArgs(model=model_dir, load_format="dummy", max_running_requests=a.batch + 1,
                                        max_total_tokens=a.batch * (contexts[0] + 256) + a.mixed + 4096,
                                        context_length=max(contexts[0], a.mixed) + 1024, enable_cuda_graph=False,
                                        chunked_prefill_size=max(a.mixed, 64), kv_cache_dtype=a.kv_cache_dtype,
                                        quantization=a.quantization, quantize_lm_head=a.quantize_lm_head),
                             model_dir)
        r = profile_mixed(runner, a.batch, contexts[0], a.mixed)
        print(f"mixed step, {a.batch} decode rows at {contexts[0]} + a {a.mixed}-token prompt chunk: wall "
              f"{r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} ms until the forward returns, batch build "
              f"{r['build_ms']:.2f} ms")
        if "kernels" in r:
            print(f"under the profiler: {r['kernels']} kernels, busy {r['busy_ms']:.2f} ms, idle {r['idle_ms']:.2f} ms; "
                  "runtime calls that can block (calls, host us): "
                  + ", ".join(f"{n} {c} {us:.0f}" for n, (c, us) in sorted(r["runtime_calls"].items())))
        _print_rows(r["rows"], a.top)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    tokens = a.batch * (max(contexts) + a.verify_k + 256) + 4096
    runner = ModelRunner(EngineArgs(model=model_dir, load_format="dummy", max_running_requests=max(a.batch, 1),
                                    max_total_tokens=tokens, context_length=max(contexts) + 1024,
                                    enable_cuda_graph=a.graph, cuda_graph_max_bs=a.batch if a.graph else None,
                                    kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization,
                                    quantize_lm_head=a.quantize_lm_head), model_dir)
    print(f"start-up phases: {runner.describe_startup()}")
    if ab is not None or a.ab_kv_cache:
        out = {}
        for context in contexts:
            if a.ab_kv_cache:
                times, name = ab_kv_cache_replays(runner, a.batch, context, a.rounds), "KV"
            else:
                module, attr, values = ab
                times, name = ab_graph_replays(runner, a.batch, context, module, attr, values, a.rounds), attr
            for v, ms in times.items():
                med = sorted(ms)[len(ms) // 2]
                print(f"batch {a.batch}, context {context}, {name}={v}: median {med:.3f} ms over {len(ms)} rounds "
                      f"({', '.join(f'{t:.3f}' for t in ms)})")
            out[str(context)] = {str(v): ms for v, ms in times.items()}
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"batch": a.batch, "ab": a.ab or "kv-cache", "rounds": a.rounds, "device_ms": out,
                           "startup_phases": runner.startup_phases}, f, indent=2)
        return 0
    results = []
    for context in contexts:
        if a.graph:
            r = profile_graph_replay(runner, a.batch, context)
            print(f"batch {a.batch}, context {context}, graph replay: {r['device_ms_events']:.3f} ms (CUDA events), "
                  f"span {r['span_us'] / 1e3:.3f} ms = {r['busy_us'] / 1e3:.3f} ms in {r['kernels']} kernels "
                  f"+ {r['idle_us'] / 1e3:.3f} ms with no kernel running")
            _print_rows(r["rows"], a.top)
            print("largest gaps (us, after -> before):")
            for g in r["gaps"][:8]:
                print(f"{g['gap_us']:>9.1f}  {g['after'][:45]} -> {g['before'][:45]}")
            linears = linear_breakdown(r["sequence"], _mixer_kinds(runner.cfg)) if a.batch == 1 else None
            if linears:
                print("linears in the chain (us per call: mean, min-max; kernel times overlap under PDL):")
                for row in linears:
                    print(f"{row['layers']:>9} {row['linear']:>7} x{row['calls']:<3} {row['mean_us']:7.1f} "
                          f"({row['min_us']:.1f}-{row['max_us']:.1f})  total {row['total_us']:7.1f}")
            results.append({"context": context, "total_us": r["busy_us"], "kernels": r.pop("rows"), "graph": r,
                            "linears": linears})
        else:
            rows = profile_step(runner, a.batch, context, a.verify_k)
            total = sum(r["total_us"] for r in rows)
            print(f"batch {a.batch}, context {context}, verify k {a.verify_k}: {total / 1e3:.3f} ms of kernels")
            _print_rows(rows, a.top)
            results.append({"context": context, "total_us": total, "kernels": rows})
    if a.json:
        with open(a.json, "w") as f:
            first = results[0]
            json.dump({"batch": a.batch, "context": first["context"], "verify_k": a.verify_k, "total_us": first["total_us"],
                       "kernels": first["kernels"], "runs": results, "startup_phases": runner.startup_phases}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
