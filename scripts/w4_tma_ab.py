"""The int4 decode GEMV with TMA-streamed weights (quant_gemm.w4_tma, experimental) against the
calibration's dp2a picks, per linear shape at one row. GPU only.

    python scripts/w4_tma_ab.py [--json FILE]

Per shape: the best dp2a config and split on bf16 x, the best on x rounded by its producer
(w4a16_gemv_dp2a_rounded, the TMA kernel's input), and every TMA config at its split-K choices,
in CUDA graphs of back-to-back calls (PDL on) over L2-busting weight copies, next to the DRAM floor
of the weights and group scales at run 100's copy bandwidth (4221 GB/s). The TMA picks are checked
against dequantize-then-matmul first (relative error < 4e-3, the GPU tests' bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm import w4_decode
from salaserve.kernels.quant_gemm import w4_tma as T
from salaserve.kernels.compile_ahead import precompile
from salaserve.kernels.timing import l2_busting_count
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref

COPY_GBS = 4221.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=None, help="comma list of indices into W4_TMA_CONFIGS (default all)")
    ap.add_argument("--check-only", action="store_true",
                    help="no timing: every TMA config and split against the reference, one at a time, printed "
                         "before it runs (with CUDA_LAUNCH_BLOCKING=1 a fault names its launch)")
    a = ap.parse_args()
    configs = [T.W4_TMA_CONFIGS[int(i)] for i in a.configs.split(",")] if a.configs else list(T.W4_TMA_CONFIGS)
    rows = []
    for name, (N, K) in G.distinct_linear_shapes(preset_config("full")).items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        n = l2_busting_count(w.qweight.nbytes)
        copies = [w] + [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1))
                        for _ in range(n - 1)]
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        xq, xs = Q.round_x_int16(x)
        ref = linear_ref(x.float(), w)
        floor = (w.qweight.nbytes + w.scales.nbytes + w.qzeros.nbytes) / COPY_GBS / 1e3
        if a.check_only:
            print(f"{name} N={N} K={K} scales {w.scales.dtype} {tuple(w.scales.shape)} zeros {tuple(w.qzeros.shape)} "
                  f"ptrs % 128: {[t.data_ptr() % 128 for t in (w.qweight, w.qzeros, w.scales, xq, xs)]}", flush=True)
            for cfg in configs:
                for split in (1, 2, 4, 8):
                    print(f"  {cfg} split {split}", end=" ", flush=True)
                    y = T.w4a16_gemv_tma(xq, xs, w, config=cfg, split_k=split)
                    torch.cuda.synchronize()
                    print(f"rel err {float((y.float() - ref).norm() / ref.norm()):.2e}", flush=True)
            continue
        dp2a = w4_decode.time_choices(w4_decode._w4_candidates(1, w, "cuda"),
                                      lambda c, i: Q.w4a16_gemv_dp2a(x, copies[i % n], config=c[1], split_k=c[2]), n)
        rounded = w4_decode.time_choices(
            w4_decode.rounded_choices(1, w, "cuda", configs=Q.W4_DP2A_CONFIGS[1]),
            lambda c, i: Q.w4a16_gemv_dp2a_rounded(xq, xs, copies[i % n], config=c[1], split_k=c[2]), n)
        cands = [(cfg, split) for cfg in configs if T.w4_tma_usable(w, cfg[0])
                 for split in sorted(set(w4_decode._w4_splits(N, K, cfg[0], T.TMA_ROWS, "cuda")) | {2, 4})
                 if K // 8 >= split * 2 * T.TMA_ROWS]
        precompile(functools.partial(T.w4a16_gemv_tma, xq, xs, w, config=cfg, split_k=split) for cfg, split in cands)
        tma = []
        for cfg, split in cands:
            y = T.w4a16_gemv_tma(xq, xs, w, config=cfg, split_k=split)
            err = float((y.float() - ref).norm() / ref.norm())
            if err > 4e-3:
                print(f"{name} TMA {cfg} split {split}: WRONG, rel err {err:.2e}", flush=True)
                continue
            tma.append(("tma", cfg, split))
        best, per_config = None, {}
        for cfg in configs:  # each config's best split, then the best of those
            mine = [c for c in tma if c[1] == cfg]
            if mine:
                per_config[str(cfg)] = w4_decode.time_choices(
                    mine, lambda c, i: T.w4a16_gemv_tma(xq, xs, copies[i % n], config=c[1], split_k=c[2]), n)
                if best is None or per_config[str(cfg)][3] < best[3]:
                    best = per_config[str(cfg)]
        for cfg, b in per_config.items():
            print(f"  {name} TMA {cfg:22s} split {b[2]:3d}: {b[3]:6.1f} us", flush=True)
        row = dict(name=name, N=N, K=K, floor_us=floor, dp2a=[str(dp2a[1]), dp2a[2], dp2a[3]],
                   dp2a_rounded=[str(rounded[1]), rounded[2], rounded[3]],
                   tma=None if best is None else [str(best[1]), best[2], best[3]],
                   tma_per_config={k: [v[2], v[3]] for k, v in per_config.items()})
        rows.append(row)
        tma_txt = "none correct" if best is None else f"{best[3]:6.1f} us {best[1]} split {best[2]} " \
                                                      f"(floor/achieved {floor / best[3]:.2f})"
        print(f"{name:8s} floor {floor:5.1f} | dp2a {dp2a[3]:6.1f} us | dp2a rounded {rounded[3]:6.1f} us | "
              f"TMA {tma_txt}", flush=True)
        del w, copies
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
