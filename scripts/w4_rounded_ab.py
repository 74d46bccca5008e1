"""The dp2a GEMV on x rounded by its producer (w4a16_gemv_dp2a_rounded) against the calibrated dp2a
GEMV on bf16 x, at the model's int4 shapes (GPU only).

    python scripts/w4_rounded_ab.py [--m 1 2] [--json FILE]

Per shape and M: every exploration config below (split-K as the calibration's choices) is first
checked against dequantize-then-matmul (rel err < 4e-3), then timed as calibrate_w4 times (CUDA
graphs of back-to-back calls over L2-busting weight copies); the bf16-x side is calibrate_w4's own
best dp2a pick. The rounding's cost is not in the rounded side: it moves into x's producer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm import w4_decode
from salaserve.kernels.timing import l2_busting_count
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref

# (BLOCK_N, BLOCK_R, warps, SLABS, PREFETCH, -): the bf16-x winners, and column-vector pairs per
# thread (VECS 2), cheaper in registers once x arrives as integers
EXPLORE = {
    1: ((64, 16, 2, 4, 2, False), (32, 16, 1, 4, 2, False), (128, 16, 4, 4, 1, False), (64, 16, 2, 4, 1, False),
        (128, 16, 4, 2, 2, False), (64, 16, 2, 2, 2, False), (256, 16, 4, 4, 1, False), (32, 16, 1, 4, 1, False)),
    2: ((128, 16, 4, 4, 1, False), (64, 16, 2, 4, 1, False), (64, 16, 2, 4, 2, False), (128, 16, 4, 2, 2, False)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for name, (N, K) in G.distinct_linear_shapes(preset_config("full")).items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        n = l2_busting_count(w.qweight.nbytes)
        copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1)) for _ in range(n)]
        for m in a.m:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            xq, xs = Q.round_x_int16(x)
            ref = linear_ref(x, w).float()
            Q._W4_TABLE.clear()
            base = Q.calibrate_w4([w], "cuda", m_values=(m,))[(m, N, K)]
            choices = w4_decode.rounded_choices(m, w, "cuda", configs=EXPLORE[m])
            for _, cfg, split in choices:
                y = Q.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=split).float()
                rel = float((y - ref).norm() / ref.norm())
                if not rel < 4e-3:
                    raise SystemExit(f"{name} M={m} rounded {cfg} split {split}: rel err {rel:.2e}")
            _, cfg, split, us = w4_decode.time_choices(
                choices, lambda c, i: Q.w4a16_gemv_dp2a_rounded(xq, xs, copies[i % n], config=c[1], split_k=c[2]), n,
                f"{name} M={m}")
            nbytes = N * K / 2 + N * K / 128 * 2.5
            rows.append(dict(name=name, N=N, K=K, M=m, dp2a=[str(base[1]), base[2], base[3]],
                             rounded=[str(cfg), split, us]))
            print(f"{name:8s} M={m} dp2a {base[1]} split {base[2]}: {base[3]:6.1f} us | rounded {cfg} split "
                  f"{split}: {us:6.1f} us ({nbytes / us / 1e3:5.0f} GB/s) | {base[3] / us:.2f}x", flush=True)
        del w, copies
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
