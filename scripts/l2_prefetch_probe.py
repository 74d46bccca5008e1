"""Does asking L2 for an int4 GEMV's weights while a short unrelated kernel runs make the GEMV faster?
(GPU only.) Measured in run 106: no; the engine does not prefetch
(perf-notes, twenty-first session).

    python scripts/l2_prefetch_probe.py [--sleep-us 12] [--json FILE]

Per model shape, one row (M = 1), the calibrated dp2a pick, weights cycled through L2-busting copies:
  gemv      sleep(T) -> GEMV                    minus  sleep(T)
  pf        prefetch(f) -> sleep(T) -> GEMV     minus  prefetch(f) -> sleep(T)
  pf_cost   prefetch(f) -> sleep(T)             minus  sleep(T)   (the prefetch kernel's own cost)
  pf_late   prefetch(f) -> GEMV                 minus  GEMV alone (no time for the bytes to land)
f: the first fraction of every split's rows (qweight, scales, zeros), what all programs read first.
Variants: bulk prefetch in chunks of 16 KB and 4 KB, line prefetches in chunks of 4 KB. T stands in
for the attention kernels between qkv and o_proj (8-16 us per layer at 4K).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# ---- the prefetch: each lane of a program issues one cp.async.bulk.prefetch.L2 of its chunk (the TMA
# unit walks it; nothing comes back to the SM, nothing waits) or, with BULK off, one
# prefetch.global.L2 per 128-byte line; chunks spread over many programs, since one SM's request rate
# is far below DRAM's.
LINE = 128  # bytes per prefetch.global.L2
ALIGN = 16  # cp.async.bulk: 16-byte aligned address and size


@dataclass(frozen=True)
class PrefetchPlan:
    """Chunks of device memory to ask L2 for: addresses and sizes (bytes), one chunk per lane."""
    addrs: torch.Tensor  # int64 [n]
    sizes: torch.Tensor  # int32 [n]
    nbytes: int  # the sum of sizes
    largest: int  # the largest chunk (known on the host: no sync at launch, so graphs can capture it)

    def __len__(self) -> int:
        return int(self.addrs.numel())


def prefetch_plan(ranges, chunk: int = 16 << 10, device=None) -> PrefetchPlan:
    """Chunks of at most `chunk` bytes covering each (tensor, first_byte, n_bytes) range of a tensor's
    storage (ranges outside the tensor's bytes are refused). Range ends are rounded out to 16 bytes,
    which stays inside the allocation (torch allocations are 512-byte aligned)."""
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk must be a positive multiple of {ALIGN} bytes, got {chunk}")
    addrs, sizes = [], []
    for t, first, n in ranges:
        total = t.numel() * t.element_size()
        if not t.is_contiguous():
            raise ValueError("prefetch ranges must be of contiguous tensors")
        if first < 0 or n < 0 or first + n > total:
            raise ValueError(f"byte range [{first}, {first + n}) outside the tensor's {total} bytes")
        if n == 0:
            continue
        lo = t.data_ptr() + first
        hi = t.data_ptr() + first + n
        lo -= lo % ALIGN
        hi += -hi % ALIGN
        for a in range(lo, hi, chunk):
            addrs.append(a)
            sizes.append(min(chunk, hi - a))
        device = device or t.device
    device = device or "cpu"
    return PrefetchPlan(torch.tensor(addrs, dtype=torch.int64, device=device),
                        torch.tensor(sizes, dtype=torch.int32, device=device), int(sum(sizes)), max(sizes, default=0))


def split_front_ranges(t: torch.Tensor, splits: int, rows_per_split: int, fraction: float) -> list[tuple]:
    """(t, first_byte, n_bytes) ranges of the first `fraction` of each split's rows of a row-major
    t whose rows a split-K GEMV divides into `splits` runs of rows_per_split (the last one short):
    what all of its programs read first, since they run at once and advance together."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    rows = t.shape[0]
    row_bytes = t.numel() * t.element_size() // rows
    out = []
    for s in range(splits):
        begin = s * rows_per_split
        if begin >= rows:
            break
        n = min(rows, begin + rows_per_split) - begin
        take = min(n, -(-int(n * fraction * 1024) // 1024))  # rounded up, so a fraction of 1 is every row
        if take:
            out.append((t, begin * row_bytes, take * row_bytes))
    return out


@triton.jit
def _l2_prefetch_kernel(addr_ptr, size_ptr, n, BLOCK: tl.constexpr, BULK: tl.constexpr, LINES: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    a = tl.load(addr_ptr + i, mask=ok, other=0)
    s = tl.load(size_ptr + i, mask=ok, other=0)
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", args=[a, s], dtype=tl.int32, is_pure=False, pack=1)
    else:
        line = tl.arange(0, LINES)[None, :] * 128
        on = (line < s[:, None]).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", args=[a[:, None] + line, on], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_supported(device) -> bool:
    """Whether prefetch_l2 issues anything on this device (sm_90+ CUDA, not the interpreter)."""
    d = torch.device(device)
    return (d.type == "cuda" and not _INTERPRET and torch.cuda.is_available()
            and torch.cuda.get_device_capability(d) >= (9, 0))


def prefetch_l2(plan: PrefetchPlan, lanes: int = 32, bulk: bool = True) -> None:
    """Ask L2 for the plan's chunks: one kernel of len(plan) / lanes programs, nothing waits for
    the bytes. A no-op where prefetch_supported is false (CPU, the interpreter, before sm_90)."""
    if len(plan) == 0 or not prefetch_supported(plan.addrs.device):
        return
    lines = 1
    if not bulk:
        lines = triton.next_power_of_2(max(1, -(-plan.largest // LINE)))
    _l2_prefetch_kernel[(triton.cdiv(len(plan), lanes),)](plan.addrs, plan.sizes, len(plan), BLOCK=lanes,
                                                          BULK=bulk, LINES=lines, num_warps=max(1, lanes // 32))


VARIANTS = {"bulk16k": (16 << 10, True), "bulk4k": (4 << 10, True), "line4k": (4 << 10, False)}


def w4_ranges(w, block_r: int, split: int, fraction: float) -> list[tuple]:
    """The dp2a GEMV's first `fraction` of each split: packed rows of qweight, groups of scales / zeros."""
    k8 = w.in_features // 8
    r_len = triton.cdiv(k8, split * block_r) * block_r
    g_len = r_len * 8 // w.group_size
    return (split_front_ranges(w.qweight, split, r_len, fraction) + split_front_ranges(w.scales, split, g_len, fraction)
            + split_front_ranges(w.qzeros, split, g_len, fraction))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep-us", type=float, default=12.0)
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    # torch.cuda._sleep spins for a number of cycles: calibrate cycles per us once
    cycles = 100000
    t = graph_time_us(lambda i: torch.cuda._sleep(cycles), calls=4)
    per_us = cycles / t
    spin = int(a.sleep_us * per_us)
    print(f"sleep: {per_us:.0f} cycles/us, {spin} cycles for {a.sleep_us} us", flush=True)
    rows = []
    for name, (N, K) in G.distinct_linear_shapes(preset_config("full")).items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        n = l2_busting_count(w.qweight.nbytes)
        copies = [w] + [rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128) for _ in range(n - 1)]
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        Q._W4_TABLE.clear()
        kernel, cfg, split, us_cal = Q.calibrate_w4([w], "cuda", m_values=(1,))[(1, N, K)]
        if kernel != "dp2a":
            print(f"{name}: pick {kernel}, skipped")
            continue

        def gemv(i):
            Q.w4a16_gemv_dp2a(x, copies[i % n], config=cfg, split_k=split)

        def sleep(i):
            torch.cuda._sleep(spin)

        def timed(fn):
            return graph_time_us(fn, calls=n)

        base_sleep = timed(sleep)
        base_gemv = timed(gemv)
        gemv_after_sleep = timed(lambda i: (sleep(i), gemv(i))) - base_sleep
        row = dict(name=name, N=N, K=K, pick=[kernel, list(cfg), split], calibrated_us=us_cal, gemv_us=base_gemv,
                   gemv_after_sleep_us=gemv_after_sleep, variants={})
        print(f"{name:8s} {N}x{K} {cfg} split {split}: gemv {base_gemv:6.1f} us, after sleep {gemv_after_sleep:6.1f}",
              flush=True)
        for f in a.fractions:
            for vname, (chunk, bulk) in VARIANTS.items():
                plans = [prefetch_plan(w4_ranges(c, cfg[1], split, f), chunk=chunk) for c in copies]

                def pf(i, plans=plans, bulk=bulk):
                    prefetch_l2(plans[i % n], bulk=bulk)

                pf_sleep = timed(lambda i: (pf(i), sleep(i)))
                with_pf = timed(lambda i: (pf(i), sleep(i), gemv(i))) - pf_sleep
                late = timed(lambda i: (pf(i), gemv(i))) - base_gemv
                mb = plans[0].nbytes / 1e6
                row["variants"][f"{vname}@{f}"] = dict(mb=mb, chunks=len(plans[0]), gemv_us=with_pf,
                                                       cost_us=pf_sleep - base_sleep, late_us=late)
                print(f"   f {f:4.2f} {vname:8s} {mb:6.1f} MB: gemv {with_pf:6.1f} us "
                      f"({gemv_after_sleep / with_pf:4.2f}x), prefetch cost {pf_sleep - base_sleep:5.1f} us, "
                      f"prefetch right before {late:+5.1f} us", flush=True)
        rows.append(row)
        del w, copies
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
