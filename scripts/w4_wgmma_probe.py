"""The warpgroup-MMA int4 GEMV (quant_gemm/w4_wgmma.py) at the model's shapes (GPU only):
parity against its bf16-weight twin, then us per call of every (config, split) next to the FMA
kernel's calibrated best, in CUDA graphs over L2-busting weight copies (calibrate_w4's timing).

    python scripts/w4_wgmma_probe.py [--m 1 4 8 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re

import torch

from salaserve.config import preset_config
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm import w4_wgmma as WG
from salaserve.kernels.quant_gemm.w4_decode import _w4_splits
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = preset_config("full")
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {"qkvg": (8704, H), "qkvz": (16384, H), "o_proj": (H, H), "gate_up": (2 * I, H), "down": (H, I)}
    rows, worst = [], 0.0
    for name, (N, K) in shapes.items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        qw = WG.repack_w4_for_wgmma(w)
        nbytes = N * K / 2 + N * K / 128 * 2.5
        for m in (1, 5, 16):  # parity
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            ref = WG.w4a16_wgmma_ref(x, w)
            for c in WG.W4_WGMMA_CONFIGS:
                if WG.w4_wgmma_usable(w, c):
                    y = WG.w4a16_gemv_wgmma(x, w, qw, config=c).float()
                    err = float((y - ref).abs().max() / ref.abs().max())
                    worst = max(worst, err)
        n_copies = l2_busting_count(w.qweight.nbytes)
        copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1))
                  for _ in range(n_copies)]
        packed = [WG.repack_w4_for_wgmma(c) for c in copies]
        for m in a.m:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                Q.calibrate_w4([w], "cuda", m_values=(m,), verbose=True)
            fma = min((float(h[1]) for h in re.findall(r" (fma|tc) .* split \d+: ([0-9.]+) us", log.getvalue())),
                      default=float("nan"))
            best, per_config = None, {}
            for c in WG.W4_WGMMA_CONFIGS:
                if not WG.w4_wgmma_usable(w, c):
                    continue
                for split in _w4_splits(N, K, c[0], c[1], "cuda"):
                    t = graph_time_us(lambda i: WG.w4a16_gemv_wgmma(x, copies[i % n_copies], packed[i % n_copies],
                                                                    config=c, split_k=split), calls=max(8, n_copies))
                    per_config[str((c, split))] = t
                    if best is None or t < best[2]:
                        best = (c, split, t)
            rows.append(dict(name=name, N=N, K=K, M=m, old_best_us=fma, wgmma=best, per_config=per_config))
            print(f"{name:8s} M={m:2d} old {fma:6.1f} us ({nbytes / fma / 1e3:5.0f} GB/s) | wgmma {best[0]} split "
                  f"{best[1]}: {best[2]:6.1f} us ({nbytes / best[2] / 1e3:5.0f} GB/s)  x{fma / best[2]:.2f}", flush=True)
            Q._W4_TABLE.clear()
        del w, copies, packed
    print(f"parity: worst max|err| / max|ref| against the bf16-weight twin {worst:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, parity_worst=worst), f, indent=1)


if __name__ == "__main__":
    main()
