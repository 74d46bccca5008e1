"""Does asking L2 for an int4 GEMV's weights while a short unrelated kernel runs make the GEMV faster?
(GPU only; kernels/l2_prefetch.py.)

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

import torch
import triton

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.l2_prefetch import prefetch_l2, prefetch_plan, split_front_ranges
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn

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
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
