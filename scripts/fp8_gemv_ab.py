"""fp8 decode GEMVs per linear of the full model (GPU only), at the given row counts: w8a16_gemv
against gemv.gemv_fp8 with every FP8_FMA_CONFIGS and FP8_STREAM_CONFIGS config of the M bucket
(FP8_DOT_CONFIGS too with SALASERVE_FP8_DOT=1, with and without PDL; FP8_MMA_CONFIGS with
SALASERVE_FP8_MMA=1), each at several splits, and the bf16 GEMV, each in a CUDA graph of
back-to-back calls over L2-busting weight copies.
Prints a table and the sums per decode step against the weight-read floor; writes JSON to OUT.

    python scripts/fp8_gemv_ab.py OUT.json [M ...]     (M default: 1)

FP8_AB_KINDS=stream,fma (config kinds as GemvConfig prints them) times only those kinds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from salaserve.bench.floors import measure_ceilings
from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn


def main(path: str, m_values: list[int]) -> None:
    cfg = preset_config("full")
    bw = measure_ceilings().copy_gbps * 1e9  # the micro-benchmark's floor bandwidth
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = {}
    for M in m_values:
        print(f"\n== M = {M}")
        results[M] = _one_m(cfg, M, bw)
    with open(path, "w") as f:
        json.dump(dict(copy_bandwidth=bw, by_m=results), f, indent=1)


def _configs(M: int) -> tuple:
    kinds = os.environ.get("FP8_AB_KINDS")  # e.g. "stream": only those kinds' configs
    return tuple(c for c in _all_configs(M) if not kinds or str(c).split()[0] in kinds.split(","))


def _all_configs(M: int) -> tuple:
    return (G.FP8_FMA_CONFIGS[G._bucket(M)] + G.FP8_STREAM_CONFIGS.get(G._bucket(M), ())
            + (G.FP8_DOT_CONFIGS if Q.FP8_DOT else ()) + (G.FP8_MMA_CONFIGS if Q.FP8_MMA else ()))


def _one_m(cfg, M: int, bw: float) -> dict:
    rows, step = [], {"w8a16": 0.0, "fp8_gemv": 0.0, "bf16": 0.0, "floor_fp8": 0.0, "floor_bf16": 0.0}
    for name, N, K, uses in G.model_linear_shapes(cfg):
        n = l2_busting_count(N * K)
        g = torch.Generator(device="cuda").manual_seed(N + K)
        f8 = [rtn.quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5) for _ in range(n)]
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        r = dict(name=name, N=N, K=K, uses=uses)
        r["w8a16"] = graph_time_us(lambda i: Q.w8a16_gemv(x, f8[i % n].weight, f8[i % n].scale), calls=max(8, n))
        r["gemv"] = {}
        for c in _configs(M):
            auto = G._auto_split(N, K, c, torch.device("cuda"))
            for split in sorted({auto, 1, 2, 4, 8} | ({16, 32} if c.mma else set())):
                if K // split < c.block_k or K % split or (c.mma and K % (64 * split)):
                    continue
                cs = dataclasses.replace(c, split_k=split)
                # the DOT path waits for the previous kernel before its first W load: also without PDL
                for pdl in (None, False) if c.dot else (None,):
                    t = graph_time_us(lambda i: G.gemv_fp8(x, f8[i % n].weight, f8[i % n].scale, cs, pdl=pdl),
                                      calls=max(8, n))
                    r["gemv"][str(cs) + (" nopdl" if pdl is False else "")] = t
        best = min(r["gemv"].items(), key=lambda kv: kv[1])
        bfs = G.weight_copies(N, K, torch.bfloat16, "cuda")
        G.calibrate([(N, K)], "cuda", m_values=(M,))
        r["bf16"] = graph_time_us(lambda i: G.linear(x, bfs[i % len(bfs)]), calls=max(8, len(bfs)))
        b8, b16 = N * K + 4 * N, 2 * N * K
        r["floor_fp8_us"], r["floor_bf16_us"] = b8 / bw * 1e6, b16 / bw * 1e6
        print(f"{name:9s} {N:6d}x{K:5d} | w8a16 {r['w8a16']:6.1f} us ({b8 / r['w8a16'] / 1e3:4.0f} GB/s)"
              f" | gemv best {best[1]:6.1f} ({b8 / best[1] / 1e3:4.0f} GB/s) {best[0]}"
              f" | bf16 {r['bf16']:6.1f} ({b16 / r['bf16'] / 1e3:4.0f} GB/s) | fp8 floor {r['floor_fp8_us']:5.1f}",
              flush=True)
        for kind in ("fma", "stream", "mma"):
            of_kind = [kv for kv in r["gemv"].items() if kv[0].startswith(kind)]
            if of_kind:
                k, v = min(of_kind, key=lambda kv: kv[1])
                print(f"           best {kind}: {v:6.1f} us ({b8 / v / 1e3:4.0f} GB/s) {k}", flush=True)
        print("           " + ", ".join(f"{k}: {v:.1f}" for k, v in r["gemv"].items()), flush=True)
        rows.append(r)
        step["w8a16"] += uses * r["w8a16"]
        step["fp8_gemv"] += uses * min(best[1], r["w8a16"])
        step["bf16"] += uses * r["bf16"]
        step["floor_fp8"] += uses * r["floor_fp8_us"]
        step["floor_bf16"] += uses * r["floor_bf16_us"]
        del f8, bfs
        torch.cuda.empty_cache()
    print(f"\nall linears per decode step at M = {M} (ms):")
    for k in ("w8a16", "fp8_gemv", "bf16"):
        fl = step["floor_bf16" if k == "bf16" else "floor_fp8"]
        print(f"  {k:9s} {step[k] / 1e3:6.3f}  (floor {fl / 1e3:.3f}, {fl / step[k]:.0%} of it)")
    return dict(rows=rows, per_step_us=step)


if __name__ == "__main__":
    main(sys.argv[1], [int(m) for m in sys.argv[2:]] or [1])
