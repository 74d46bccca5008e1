"""The w4 decode calibration's candidates at the model's shapes, best per kernel (GPU only).

    python scripts/w4_candidates.py [--m 1 8] [--json FILE]

For each linear shape and M bucket: the fastest (config, split) of the FMA kernel and of the
wgmma kernel (us per call in CUDA graphs over L2-busting weight copies, calibrate_w4's
timing), and the weight bytes per second of each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import torch

from salaserve.config import preset_config
from salaserve.kernels import quant_gemm as Q
from salaserve.quant import rtn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = preset_config("full")
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkvg": (8704, H), "qkvz": (16384, H), "o_proj": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    rows = []
    for name, (N, K) in shapes.items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        nbytes = N * K / 2 + N * K / 128 * 2.5
        for m in a.m:
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                Q.calibrate_w4([w], "cuda", m_values=(m,), verbose=True)
            best = {}
            for line in log.getvalue().splitlines():
                hit = re.search(r" (fma|wgmma) (\(.*\)) split (\d+): ([0-9.]+) us", line)
                if hit and (hit[1] not in best or float(hit[4]) < best[hit[1]][2]):
                    best[hit[1]] = (hit[2], int(hit[3]), float(hit[4]))
            row = dict(name=name, N=N, K=K, M=m, **{k: v for k, v in best.items()})
            rows.append(row)
            print(f"{name:8s} M={m:2d} " + " | ".join(
                f"{k} {v[0]} split {v[1]}: {v[2]:6.1f} us ({nbytes / v[2] / 1e3:5.0f} GB/s)" for k, v in best.items()),
                flush=True)
        del w
        Q._W4_TABLE.clear()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
