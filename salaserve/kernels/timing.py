"""Timing GPU work the way the engine runs it: inside a CUDA graph (GPU only).

One helper for the calibration at start-up (gemv.calibrate) and the kernel benchmarks, so they
all measure the same thing: launch gaps inside a graph included, Python launch cost excluded.
"""

from __future__ import annotations

import statistics

import torch

L2_BUST_BYTES = 256 << 20  # H200 L2 is 50 MB: timed calls cycle through this many bytes of copies


def l2_busting_count(nbytes: int, least: int = 2, most: int = 32) -> int:
    """How many distinct copies of an nbytes operand a timing loop cycles through so that no call
    finds its operand in L2 (at least `least`, at most `most`)."""
    return min(most, max(least, -(-L2_BUST_BYTES // nbytes)))


def graph_time_us(fn, calls: int = 1, replays: int = 1, repeats: int = 5) -> float:
    """Microseconds per call of fn(i) (i = the call's index in the graph).

    fn runs twice on a side stream first (compilation, autotuning, workspaces, cuBLAS handles stay
    out of the capture), then `calls` times back to back in one CUDA graph. The graph is replayed
    once to warm up, then timed `repeats` times over `replays` back-to-back replays each; the
    median is divided by replays * calls.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)
