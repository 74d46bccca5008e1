"""The fp8 prefill's activation quantizer at one 8K-token chunk (GPU only): quantize_rows_fp8 at
the model's widths (4096 for q/k/v, o_proj and gate_up inputs; down's 16384 with silu_mul fused
in, from the 32768-wide gate_up) under several rows-per-program and warp counts, each in a CUDA
graph over L2-busting inputs, against the bytes-moved floor at the measured copy bandwidth.

    python scripts/rowquant_ab.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from salaserve.bench.floors import measure_ceilings
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.fused import silu_mul
from salaserve.kernels.timing import graph_time_us, l2_busting_count


def main(path: str) -> None:
    bw = measure_ceilings().copy_gbps * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    M, res = 8192, []
    for name, width, silu in (("qkv/o/gate_up input", 4096, False), ("down input (silu fused)", 32768, True),
                              ("down input (plain)", 16384, False)):
        n = l2_busting_count(M * width * 2)
        xs = [torch.randn(M, width, device="cuda").to(torch.bfloat16) for _ in range(n)]
        K = width // 2 if silu else width
        floor_us = (M * width * 2 + M * K + 4 * M) / bw * 1e6
        for rows in (None, 1, 2, 4, 8):
            for warps in (4, 8, 16):
                per_thread = (rows or Q.rowquant_constexprs(K)["ROWS"]) * triton.next_power_of_2(K) // (32 * warps)
                if per_thread > 64:  # past the default's 64 values per thread: spills
                    continue
                t = graph_time_us(lambda i: Q.quantize_rows_fp8(xs[i % n], silu=silu, rows=rows, num_warps=warps),
                                  calls=max(8, n))
                res.append(dict(name=name, width=width, silu=silu, rows=rows, warps=warps, us=t, floor_us=floor_us))
                print(f"{name:24s} rows {str(rows):4s} warps {warps:2d}: {t:7.1f} us (floor {floor_us:6.1f}, "
                      f"{floor_us / t:4.0%})", flush=True)
        if silu:  # the two kernels it replaces
            t = graph_time_us(lambda i: Q.quantize_rows_fp8(silu_mul(xs[i % n])), calls=max(8, n))
            print(f"{name:24s} silu_mul kernel + quantizer: {t:7.1f} us", flush=True)
            res.append(dict(name=name + " unfused", us=t))
        del xs
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(dict(copy_bandwidth=bw, rows=res), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
