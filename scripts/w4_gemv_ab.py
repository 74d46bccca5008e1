"""int4 (w4a16, group 128) decode GEMVs per quantized linear of the full model at one row (GPU
only): the FMA kernel's register-prefetch configs against its stream configs (a fifth element:
the loop's loads pipelined through shared memory by cp.async), each at its calibration splits, in
CUDA graphs of back-to-back calls over L2-busting weight copies. Each (config, split) is checked
once against dequantize-then-matmul first. Prints the best of each kind per shape and the sums
per decode step against the weight-read floor; writes JSON to OUT.

    python scripts/w4_gemv_ab.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from salaserve.bench.floors import measure_ceilings
from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm.w4_fma import _w4_splits
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref

# the register-prefetch configs that calibrations picked at one row, and every stream config
MANUAL = ((64, 16, 4, 1), (64, 16, 2, 1), (64, 16, 2, 2), (128, 16, 4, 1))
TOL = 2e-2  # relative error against dequantize-then-matmul (bf16 output rounding, fp32 sums)


def main(path: str) -> None:
    cfg = preset_config("full")
    bw = measure_ceilings().copy_gbps * 1e9
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    stream = tuple(c for c in Q.W4_FMA_CONFIGS[1] if len(c) > 4)
    rows, step = [], {"manual": 0.0, "stream": 0.0, "best": 0.0, "floor": 0.0}
    dev = torch.device("cuda")
    for name, N, K, uses in G.model_linear_shapes(cfg):
        if name == "lm_head":  # bf16 unless --quantize-lm-head
            continue
        g = torch.Generator(device="cuda").manual_seed(N + K)
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, 128)
        n = l2_busting_count(w.qweight.nbytes)
        copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1)) for _ in range(n)]
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        ref = linear_ref(x, w).float()
        r = dict(name=name, N=N, K=K, uses=uses, times={})
        for c in MANUAL + stream:
            splits = _w4_splits(N, K, c[0], c[1], dev)[:2 if len(c) > 4 else None]
            for split in splits:
                y = Q.w4a16_gemv_fma(x, w, config=c, split_k=split).float()
                err = ((y - ref).norm() / ref.norm()).item()
                if not err < TOL:
                    raise SystemExit(f"{name} {c} split {split}: rel err {err:.2e} >= {TOL}")
                r["times"][f"{c} split{split}"] = graph_time_us(
                    lambda i: Q.w4a16_gemv_fma(x, copies[i % n], config=c, split_k=split), calls=max(8, n))
        nbytes = w.qweight.nbytes + w.scales.nbytes + w.qzeros.nbytes
        r["floor_us"] = nbytes / bw * 1e6
        best = {kind: min((v, k) for k, v in r["times"].items() if (k.count(",") > 3) == (kind == "stream"))
                for kind in ("manual", "stream")}
        print(f"{name:9s} {N:6d}x{K:5d} | floor {r['floor_us']:5.1f} us | register prefetch {best['manual'][0]:6.1f} "
              f"({nbytes / best['manual'][0] / 1e3:4.0f} GB/s) {best['manual'][1]} | stream {best['stream'][0]:6.1f} "
              f"({nbytes / best['stream'][0] / 1e3:4.0f} GB/s) {best['stream'][1]}", flush=True)
        for kind in ("manual", "stream"):
            step[kind] += uses * best[kind][0]
        step["best"] += uses * min(best["manual"][0], best["stream"][0])
        step["floor"] += uses * r["floor_us"]
        rows.append(r)
        del copies
        torch.cuda.empty_cache()
    print(f"\nw4 linears per decode step at M = 1 (ms; lm_head bf16 not included): register prefetch "
          f"{step['manual'] / 1e3:.3f}, stream {step['stream'] / 1e3:.3f}, best per shape {step['best'] / 1e3:.3f}, "
          f"floor {step['floor'] / 1e3:.3f}")
    with open(path, "w") as f:
        json.dump(dict(copy_bandwidth=bw, rows=rows, per_step_us=step), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
