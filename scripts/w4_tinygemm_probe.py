"""PyTorch's int4 GEMM (`torch.ops.aten._weight_int4pack_mm`, gpt-fast's "tinygemm" path: bf16 x,
int4 weights packed for mma.sync, per-group bf16 scale and zero) against the w4 FMA decode kernel
at the model's shapes, 1 and 8 rows (GPU only).

    python scripts/w4_tinygemm_probe.py [--json FILE]

Our GPTQ weights map onto its format exactly up to the zero's rounding: w = (q - z) s =
(q - 8) s + (8 - z) s, so scale s and zero (8 - z) s (both bf16). Each inner-k-tiles packing is
checked against dequantize-then-matmul first (rel err < 4e-3), then timed (us per call in CUDA
graphs over L2-busting copies, as calibrate_w4 times its candidates).
"""

from __future__ import annotations

import argparse
import json

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import formats, rtn
from salaserve.quant.matmul import linear_ref


def pack(w, inner_k_tiles, high_first=True):
    q = formats.unpack_int4(w.qweight).t().contiguous().to(torch.int32)  # [N, K]
    a, b = (q[:, ::2], q[:, 1::2]) if high_first else (q[:, 1::2], q[:, ::2])
    packed = torch.ops.aten._convert_weight_to_int4pack(((a << 4) | b).to(torch.uint8), inner_k_tiles)
    z = formats.unpack_zeros(w.qzeros, w.out_features, formats.GPTQ_V2).float()
    s = w.scales.float()
    return packed, torch.stack([s, (8 - z) * s], dim=-1).to(torch.bfloat16).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    shapes = G.distinct_linear_shapes(preset_config("full"))  # the int4 linears (lm_head stays bf16)
    rows = []
    for name, (N, K) in shapes.items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        nbytes = N * K / 2 + N * K / 128 * 4
        n = l2_busting_count(N * K // 2)
        for m in (1, 8):
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            ref = linear_ref(x, w).float()
            row = dict(name=name, N=N, K=K, M=m)
            if m <= 4:
                res = Q.calibrate_w4([w], "cuda", m_values=(m,))
                row["fma"] = res[(m, N, K)][3]
            for ikt in (2, 4, 8):
                try:
                    packed, sz = pack(w, ikt)
                    y = torch.ops.aten._weight_int4pack_mm(x, packed, 128, sz).float()
                    rel = float((y - ref).norm() / ref.norm())
                    if not rel < 4e-3:
                        packed, sz = pack(w, ikt, high_first=False)
                        y = torch.ops.aten._weight_int4pack_mm(x, packed, 128, sz).float()
                        rel2 = float((y - ref).norm() / ref.norm())
                        print(f"{name} M={m} ikt={ikt}: rel err {rel:.2e} high-first, {rel2:.2e} low-first")
                        row[f"ikt{ikt}_order"] = "low-first" if rel2 < 4e-3 else "bad"
                        if not rel2 < 4e-3:
                            continue
                    copies = [packed] + [torch.randint_like(packed, -2**31, 2**31 - 1) for _ in range(n - 1)]
                    t = graph_time_us(lambda i: torch.ops.aten._weight_int4pack_mm(x, copies[i % n], 128, sz),
                                      calls=max(8, n))
                    row[f"ikt{ikt}"] = t
                    del copies
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{name} M={m} ikt={ikt}: {type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            timed = [(v, k) for k, v in row.items() if k.startswith("ikt") and isinstance(v, float)]
            best = f" | tinygemm best {min(timed)[1]} {nbytes / min(timed)[0] / 1e3:5.0f} GB/s" if timed else ""
            print(f"{name:8s} M={m}: " + " | ".join(f"{k} {v:6.1f} us" for k, v in row.items()
                                                    if isinstance(v, float)) + best, flush=True)
        Q._W4_TABLE.clear()
        del w
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
