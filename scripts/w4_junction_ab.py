"""The one-row int4 junction as one persistent kernel (quant_gemm.w4_junction) against the engine's
three-kernel chain (calibrated dp2a GEMV, add + RMSNorm, calibrated dp2a GEMV), at the model's
shapes. GPU only.

    python scripts/w4_junction_ab.py [--json FILE]

Per junction (o_proj -> gate_up, down -> qkvg, down -> qkvz) and per junction config: us per
junction in CUDA graphs of back-to-back junctions (PDL on, as in the step) over L2-busting weight
copies, and each phase launched alone (no barrier: where the time goes), next to the chain's and the DRAM floor of both weights' bytes at the copy bandwidth of run
100 (4221 GB/s). Before timing, each config's outputs are checked against the chain's within the
GPU tests' tolerance, and the barrier's error flag must stay clear.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.quant_gemm import w4_junction as J
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.kernels.triton_backend import TritonBackend
from salaserve.quant import rtn

COPY_GBS = 4221.0
JUNCTIONS = {"o_proj->gate_up": ((4096, 4096), (32768, 4096)), "down->qkvg": ((4096, 16384), (8704, 4096)),
             "down->qkvz": ((4096, 16384), (16384, 4096))}


def _w4(N, K):
    return rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=None, help="comma list of indices into W4_JUNCTION_CONFIGS (default all)")
    ap.add_argument("--orders", default="stream", help="comma list of stream,split (w4_junction's split_order)")
    a = ap.parse_args()
    orders = [o == "split" for o in a.orders.split(",")]
    configs = ([J.W4_JUNCTION_CONFIGS[int(i)] for i in a.configs.split(",")] if a.configs
               else list(J.W4_JUNCTION_CONFIGS))
    backend = TritonBackend()
    rows = []
    for name, (shape_a, shape_b) in JUNCTIONS.items():
        w_out, w_in = _w4(*shape_a), _w4(*shape_b)
        Q.calibrate_w4([w_out, w_in], "cuda", m_values=(1,))
        nbytes = sum(w.qweight.nbytes + w.scales.nbytes + w.qzeros.nbytes for w in (w_out, w_in))
        n = l2_busting_count(nbytes)
        pairs = [(w_out, w_in)] + [tuple(dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1))
                                         for w in (w_out, w_in)) for _ in range(n - 1)]
        x = torch.randn(1, shape_a[1], device="cuda").to(torch.bfloat16)
        h = (torch.randn(1, 4096, device="cuda") * 4).to(torch.bfloat16)
        norm_w = (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)

        def chain(i):
            wo, wi = pairs[i % n]
            return backend.residual_norm_linear(h, x, wo, 0.25, norm_w, 1e-6, wi)

        h_c, y_c = chain(0)
        chain_us = graph_time_us(chain, calls=max(8, n))
        floor_us = nbytes / COPY_GBS / 1e3
        row = dict(junction=name, chain_us=chain_us, floor_us=floor_us, configs={})
        print(f"{name:16s} chain {chain_us:6.1f} us  floor {floor_us:5.1f} us", flush=True)
        for cfg, split in [(c, o) for c in configs for o in orders]:
            h_j, y_j = J.w4_junction(h, x, w_out, 0.25, norm_w, 1e-6, w_in, config=cfg, split_order=split)
            errs = (_rel(h_j, h_c), _rel(y_j, y_c))
            if max(errs) > 4e-3 or J.barrier_error(torch.device("cuda")):
                print(f"  {cfg}: WRONG (rel err vs chain {errs}, barrier error {J.barrier_error(torch.device('cuda'))})")
                row["configs"][str((cfg, split))] = dict(wrong=errs)
                continue

            def fused(i, c=cfg, o=split):
                wo, wi = pairs[i % n]
                return J.w4_junction(h, x, wo, 0.25, norm_w, 1e-6, wi, config=c, split_order=o)

            def phase(i, c=cfg, o=split, p=1):
                wo, wi = pairs[i % n]
                return J.w4_junction(h, x, wo, 0.25, norm_w, 1e-6, wi, config=c, split_order=o, only_phase=p)

            us = graph_time_us(fused, calls=max(8, n))
            us_a = graph_time_us(phase, calls=max(8, n))
            us_b = graph_time_us(lambda i: phase(i, p=2), calls=max(8, n))
            grid = [v for k, v in J._GRIDS.items() if k[1] == cfg][-1]
            row["configs"][str((cfg, split))] = dict(us=us, phase_a_us=us_a, phase_b_us=us_b, grid=grid, rel_err=errs)
            print(f"  {str(cfg):22s} {'split ' if split else 'stream'} grid {grid:4d}  {us:6.1f} us  ({chain_us / us:4.2f}x the chain, "
                  f"floor/achieved {floor_us / us:4.2f}); phase A alone {us_a:5.1f}, phase B alone {us_b:5.1f}",
                  flush=True)
        rows.append(row)
        del pairs, w_out, w_in
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
