"""The w4 decode calibration's candidates at the model's shapes, best per kernel (GPU only).

    python scripts/w4_candidates.py [--m 1 8] [--json FILE] [--log FILE]

For each linear shape and M bucket: the fastest (config, split) of each kernel the calibration
times (the FMA and dp2a kernels, and on the repacked copy the mma and wgmma kernels; us per call in CUDA
graphs over L2-busting weight copies, calibrate_w4's timing), and the weight bytes per second of
each. Every mma config is first checked against dequantize-then-matmul at each M; the calibration
times the mma kernel only with SALASERVE_W4_MMA=1 (opt-in).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref


def check(name, m, w, kind, configs, run):
    """Every config (heuristic split and none) against dequantize-then-matmul on a fresh x; exits on a
    mismatch."""
    x = torch.randn(m, w.in_features, device="cuda").to(torch.bfloat16)
    ref = linear_ref(x, w).float()
    for cfg in configs:
        for split in (None, 1):
            rel = float((run(x, cfg, split).float() - ref).norm() / ref.norm())
            if not rel < 4e-3:
                raise SystemExit(f"{name} M={m} {kind} {cfg} split {split}: rel err {rel:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", default=None, help="append every candidate's time (the calibration's verbose lines)")
    a = ap.parse_args()
    shapes = G.distinct_linear_shapes(preset_config("full"))  # the int4 linears (lm_head stays bf16)
    rows = []
    for name, (N, K) in shapes.items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        w.wgmma = Q.repack_w4_for_wgmma(w)  # as TritonBackend.prepare_weights attaches them
        w.mma = Q.repack_w4_for_mma(w)
        nbytes = N * K / 2 + N * K / 128 * 2.5
        for m in a.m:
            if m <= Q.W4_MMA_MAX_M:
                check(name, m, w, "mma", Q.W4_MMA_CONFIGS,
                      lambda x, cfg, split: Q.w4a16_gemv_mma(x, w, w.mma, config=cfg, split_k=split))
            if m <= Q.W4_DP2A_MAX_M:
                check(name, m, w, "dp2a", Q.W4_DP2A_CONFIGS[m],
                      lambda x, cfg, split: Q.w4a16_gemv_dp2a(x, w, config=cfg, split_k=split))
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                Q.calibrate_w4([w], "cuda", m_values=(m,), verbose=True)
            if a.log:
                with open(a.log, "a") as f:
                    f.write(log.getvalue())
            best = {}
            for line in log.getvalue().splitlines():
                hit = re.search(r" (fma|dp2a|mma|wgmma) (\(.*\)) split (\d+): ([0-9.]+) us", line)
                kind = hit[1] + ("+prep" if hit and hit[1] == "dp2a" and hit[2].endswith("True)") else "") if hit else None
                if hit and (kind not in best or float(hit[4]) < best[kind][2]):
                    best[kind] = (hit[2], int(hit[3]), float(hit[4]))
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
