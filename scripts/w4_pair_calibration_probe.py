"""Would the int4 calibration pick differently if it timed each GEMV after the kernel that precedes
it in the decode step, instead of back to back with itself? (GPU only.)

    python scripts/w4_pair_calibration_probe.py [--json FILE]

Why: in the step's PDL-off timeline (run 105) o_proj took 7.8 us, against 6.0-6.3 us in the
calibration's back-to-back loop. Back to back, a GEMV's tail overlaps the next call's ramp under
PDL, which favours many short CTAs (o_proj's pick: split 16, 2048 one-warp CTAs). In the step
each GEMV follows a short row kernel instead.

Per shape at one row: every calibration candidate timed two ways, in CUDA graphs over L2-busting
weight copies:
- back to back (calibrate_w4's way);
- as a pair with its producer: add + RMSNorm of a hidden row (qkv, gate_up, and o_proj for want
  of the attention kernels) or silu_mul (down). The GEMV reads what that kernel wrote, PDL on as
  in the step.
The candidates: the calibration's bf16-x ones, and for the shapes whose producer writes x rounded to
int16 in the step (all but o_proj) the rounded-x ones (the TMA GEMV's too with SALASERVE_W4_TMA=1:
run 121-122 it won gate_up and qkvz back to back and lost 0.11-0.16 ms in the step).
Printed per shape: the back-to-back pick and the pair pick, each with its pair time, then each
kernel's best in the pair. If the pair pick saves >= 0.5 us on several shapes, the calibration
should time pairs.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.fused import add_rms_norm, silu_mul
from salaserve.kernels.quant_gemm import w4_decode
from salaserve.kernels.compile_ahead import precompile
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = preset_config("full")
    hidden = cfg.hidden_size
    rows = []
    for name, (N, K) in G.distinct_linear_shapes(cfg).items():
        w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
        n = l2_busting_count(w.qweight.nbytes)
        copies = [w] + [rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128) for _ in range(n - 1)]
        if name == "down":
            gate_up = torch.randn(1, 2 * K, device="cuda").to(torch.bfloat16)

            def produce(int16_out=False):
                return silu_mul(gate_up, int16_out=int16_out)
        else:
            assert K == hidden, (name, K)
            residual = torch.randn(1, K, device="cuda").to(torch.bfloat16)
            update = torch.randn(1, K, device="cuda").to(torch.bfloat16)
            norm_w = torch.ones(K, device="cuda", dtype=torch.bfloat16)

            def produce(int16_out=False):
                return add_rms_norm(residual, update, 1.0, norm_w, 1e-6, int16_out=int16_out)[1]
        # bf16-x candidates, and (where the step's producer writes x rounded: not o_proj) the rounded-x
        # ones, the TMA kernel's among them with SALASERVE_W4_TMA=1
        choices = [("bf16", c) for c in w4_decode._w4_candidates(1, w, "cuda")]
        if name != "o_proj" and w4_decode.w4_rounded_usable(w):
            choices += [("rounded", c) for c in w4_decode.rounded_choices(1, w, "cuda")]
        x = produce()
        xq, xs = produce(int16_out=True)

        def call(choice, i, x=None, xr=None):
            kind, c = choice
            if kind == "bf16":
                return Q.w4a16_decode(produce() if x is None else x, copies[i % n], c)
            xq_, xs_ = produce(int16_out=True) if xr is None else xr
            return w4_decode.w4a16_decode_rounded(xq_, xs_, copies[i % n], c)

        precompile(functools.partial(call, c, 0, x, (xq, xs)) for c in choices)
        b2b = {c: graph_time_us(lambda i, c=c: call(c, i, x, (xq, xs)), calls=max(8, n)) for c in choices}
        pair = {c: graph_time_us(lambda i, c=c: call(c, i), calls=max(8, n)) for c in choices}
        producer_alone = graph_time_us(lambda i: produce(), calls=max(8, n))
        pick_b2b = min(b2b, key=b2b.get)
        pick_pair = min(pair, key=pair.get)
        rows.append(dict(name=name, N=N, K=K, producer_us=producer_alone,
                         b2b_pick=[str(pick_b2b), b2b[pick_b2b], pair[pick_b2b]],
                         pair_pick=[str(pick_pair), b2b[pick_pair], pair[pick_pair]],
                         all={str(c): [b2b[c], pair[c]] for c in choices}))
        print(f"{name:8s} producer alone {producer_alone:5.1f} us | back-to-back pick {pick_b2b}: "
              f"{b2b[pick_b2b]:5.1f} us alone, {pair[pick_b2b]:5.1f} in the pair | pair pick {pick_pair}: "
              f"{b2b[pick_pair]:5.1f} alone, {pair[pick_pair]:5.1f} in the pair "
              f"({pair[pick_b2b] - pair[pick_pair]:+.1f} us)", flush=True)
        for kind in ("bf16", "rounded"):  # each kernel's best in the pair
            for kern in sorted({c[1][0] for c in choices if c[0] == kind}):
                mine = {c: t for c, t in pair.items() if c[0] == kind and c[1][0] == kern}
                best = min(mine, key=mine.get)
                print(f"    {kind:7s} {kern:12s} best in the pair {best[1][1]} split {best[1][2]}: {mine[best]:5.1f} us "
                      f"(back to back {b2b[best]:5.1f})", flush=True)
        del w, copies
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
