"""A/B of programmatic dependent launch on the quantized decode GEMVs (GPU only): w8a16 (PDL off
in the engine since run 14) and the w4 FMA kernel (PDL on), at the model's large shapes, M = 1,
back to back in CUDA graphs over L2-busting weight copies. Prints us per call with PDL off / on
and the autotuner's w8a16 config (chosen with PDL off, reused with it on)."""

import dataclasses
import sys

import torch

from salaserve.kernels import _triton_utils as U
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn

SHAPES = {"qkvz": (16384, 4096), "gate_up": (32768, 4096), "down": (4096, 16384)}


def main() -> None:
    dev = torch.device("cuda")
    print(f"{'shape':8} {'kernel':6} {'PDL off us':>10} {'PDL on us':>10}")
    for name, (N, K) in SHAPES.items():
        x = torch.randn(1, K, device=dev).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev) * 0.02
        scale = (w.abs().amax(1) / 448.0).float()
        w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
        n8 = l2_busting_count(w8.nbytes)
        w8s = [w8.clone() for _ in range(n8)]
        t8 = [graph_time_us(lambda i, p=p: Q.w8a16_gemv(x, w8s[i % n8], scale, pdl=p), calls=max(8, n8))
              for p in (False, True)]
        print(f"{name:8} {'w8a16':6} {t8[0]:10.1f} {t8[1]:10.1f}   config {Q._w8a16_gemv_dot_tuned.best_config}")
        q4 = rtn.quantize_w4a16_rtn(w.float().cpu(), 128).to(dev)
        n4 = l2_busting_count(q4.qweight.nbytes)
        q4s = [dataclasses.replace(q4, qweight=torch.randint_like(q4.qweight, -2**31, 2**31 - 1)) for _ in range(n4)]
        Q.calibrate_w4([q4], dev, m_values=(1,))
        pick = Q._W4_TABLE[Q._w4_key(1, q4, dev)]  # the calibrated one-row kernel, config and split
        t4 = []
        for p in (False, True):
            U.set_pdl(p)
            t4.append(graph_time_us(lambda i: Q.w4a16_decode(x, q4s[i % n4], pick), calls=max(8, n4)))
        U.set_pdl(True)
        print(f"{name:8} {'w4':6} {t4[0]:10.1f} {t4[1]:10.1f}   pick {pick}")
        del w8s, q4s
    sys.stdout.flush()


if __name__ == "__main__":
    main()
