"""Quantized linears at the model's shapes: decode GEMVs and prefill GEMMs, old vs new (GPU only).

    python -m benchmarks.bench_quant [--m 1 2 4 8 16] [--prefill-m 8192] [--json FILE]

Decode (per shape and M): us per call in a CUDA graph of back-to-back calls cycling through
>= 256 MB of weight copies (no L2 reuse), and GB/s of weight bytes next to the copy bandwidth:
  w4 old      w4a16_gemv (tl.dot / FMA on the unpacked tile, autotuned)
  w4 new      M <= 16: calibrate_w4's candidates (w4a16_gemv_fma and w4a16_gemv_wgmma, config x split),
              the best kept and timed through quant_linear
  fp8         the faster of w8a16_gemv (autotuned; tensor cores at every M, weights converted to
              bf16) and (M <= 8) gemv/'s fp8 FMA GEMV with calibrate_fp8_gemv's choice, if it won
  bf16        the calibrated bf16 GEMV (reference point)
Then the sum over the model's linears per decode step (w4: the faster kernel per shape), vs the floor.
Prefill (M = --prefill-m): bf16 torch.mm, fp8 w8a8 (row quantize + torch._scaled_mm, and the
_scaled_mm alone), w4a16 dequantize-in-tile GEMM (old) and dequantize + torch.mm (new), TFLOP/s.
"""

from __future__ import annotations

import argparse
import json

import torch

from salaserve.config import preset_config
from salaserve.kernels import gemv as G
from salaserve.kernels import quant_gemm as Q
from salaserve.quant.matmul import linear_ref
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn

BANDWIDTH = 4.27e12


def _copies(make, nbytes):
    return [make(i) for i in range(l2_busting_count(nbytes))]


def _w4(N, K, seed):
    """int4 weights with the wgmma kernel's repacked copy, as TritonBackend.prepare_weights leaves them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, 128)
    w.wgmma = Q.repack_w4_for_wgmma(w)
    return w


def _fp8(N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return rtn.quantize_fp8(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)


def _time(fn, ws):
    return graph_time_us(lambda i: fn(ws[i % len(ws)]), calls=max(8, len(ws)))


def decode_table(shapes, ms, out):
    rows = []
    per_step = {}
    for name, N, K, uses in shapes:
        w4s = _copies(lambda i: _w4(N, K, i), N * K // 2)
        f8s = _copies(lambda i: _fp8(N, K, i), N * K)
        bfs = G.weight_copies(N, K, torch.bfloat16, "cuda")
        b4, b8, b16 = N * K / 2 + N * K / 128 * 2.5, N * K + N * 4, 2 * N * K
        for M in ms:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            r = dict(name=name, N=N, K=K, M=M)
            r["w4_old"] = _time(lambda w: Q.w4a16_gemv(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size,
                                                       act_order=False), w4s)
            if M <= Q.W4_WGMMA_MAX_M:  # the start-up calibration's candidates (kernel x config x split), printed
                bucket = 1 << (M - 1).bit_length()
                Q.calibrate_w4([w4s[0]], "cuda", m_values=(bucket,), verbose=True)
                if (choice := Q.w4_decode_choice(x, w4s[0])) is not None:
                    kernel, cfg, split = choice
                    r["w4_new"] = {f"{kernel} {cfg} split{split}": _time(lambda w: Q.quant_linear(x, w), w4s)}
            r["fp8_w8a16"] = _time(lambda w: Q.w8a16_gemv(x, w.weight, w.scale), f8s)
            r["fp8_gemv"] = None
            if M <= G.FMA_MAX_M:  # the fp8 FMA GEMV's best config, where it beat w8a16 at calibration
                Q.calibrate_fp8_gemv([f8s[0]], "cuda", m_values=(M,), verbose=M == 1)
                cfg = Q.fp8_gemv_choice(M, f8s[0], "cuda")
                if cfg is not None:
                    r["fp8_gemv"] = _time(lambda w: G.gemv_fp8(x, w.weight, w.scale, cfg), f8s)
            r["fp8"] = min(t for t in (r["fp8_w8a16"], r["fp8_gemv"]) if t is not None)
            fma8 = f" (w8a16 {r['fp8_w8a16']:7.1f}, gemv {r['fp8_gemv'] or float('nan'):7.1f})"
            G.calibrate([(N, K)], "cuda", m_values=(M,))
            r["bf16"] = _time(lambda w: G.linear(x, w), bfs)
            best4 = min([r["w4_old"]] + list(r.get("w4_new", {}).values()))
            r["best_w4"] = best4
            print(f"{name:8s} M={M:2d} | w4 old {r['w4_old']:7.1f} us ({b4 / r['w4_old'] / 1e3:5.0f} GB/s)"
                  f" best {best4:7.1f} ({b4 / best4 / 1e3:5.0f})"
                  f" | fp8 {r['fp8']:7.1f} ({b8 / r['fp8'] / 1e3:5.0f}){fma8}"
                  f" | bf16 {r['bf16']:7.1f} ({b16 / r['bf16'] / 1e3:5.0f})", flush=True)
            rows.append(r)
            for kind, t in (("w4_old", r["w4_old"]), ("w4", best4), ("fp8", r["fp8"]), ("bf16", r["bf16"])):
                per_step.setdefault((M, kind), 0.0)
                per_step[(M, kind)] += t * uses
        del w4s, f8s, bfs
        torch.cuda.empty_cache()
    floor = {}
    for name, N, K, uses in shapes:
        floor["w4"] = floor.get("w4", 0) + uses * (N * K / 2 + N * K / 128 * 2.5)
        floor["fp8"] = floor.get("fp8", 0) + uses * (N * K + N * 4)
        floor["bf16"] = floor.get("bf16", 0) + uses * 2 * N * K
    print("\nlinears per decode step (ms; lm_head included, in the format of the rest):")
    for M in ms:
        line = f"  M={M:2d}"
        for kind in ("bf16", "fp8", "w4_old", "w4"):
            ms_ = per_step[(M, kind)] / 1e3
            fl = floor[kind.split("_")[0]] / BANDWIDTH * 1e3
            line += f" | {kind} {ms_:6.3f} ({fl / ms_:4.0%} of floor {fl:.3f})"
        print(line)
    out["decode"] = rows
    out["per_step_ms"] = {f"M{m}-{k}": v / 1e3 for (m, k), v in per_step.items()}


def prefill_table(shapes, M, out):
    rows = []
    for name, N, K, _ in shapes:
        if name == "lm_head":
            continue
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        wb = (torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
        w8 = _fp8(N, K, 0)
        w4 = _w4(N, K, 0)
        x8, sx = Q.quantize_rows_fp8(x)
        flops = 2 * M * N * K
        r = dict(name=name, N=N, K=K, M=M)
        r["bf16"] = graph_time_us(lambda i: x @ wb.t(), 3)
        r["fp8_w8a8"] = graph_time_us(lambda i: Q.fp8_scaled_mm(x, w8.weight, w8.scale), 3)
        r["fp8_mm_only"] = graph_time_us(lambda i: torch._scaled_mm(
            x8, w8.weight.t(), scale_a=sx, scale_b=w8.scale.view(1, -1), out_dtype=torch.bfloat16), 3)
        r["fp8_rowquant"] = graph_time_us(lambda i: Q.quantize_rows_fp8(x), 3)
        r["w4_gemm_old"] = graph_time_us(lambda i: Q.w4a16_gemm(x, w4.qweight, w4.qzeros, w4.scales, None, 128,
                                                               act_order=False), 3)
        r["w4_dense"] = graph_time_us(lambda i: Q.w4a16_dense_mm(x, w4), 3)
        print(f"{name:8s} M={M} " + " | ".join(f"{k} {v / 1e3:.3f} ms ({flops / v / 1e6:4.0f} TF/s)"
                                               for k, v in r.items() if k not in ("name", "N", "K", "M")), flush=True)
        rows.append(r)
        del x, wb, w8, w4
        torch.cuda.empty_cache()
    out["prefill"] = rows


def check_outputs(out):
    """Correctness at the real shapes on this GPU (besides tests/test_gpu_quant.py): new kernels
    against the dequantize-then-matmul reference, relative Frobenius error."""
    res = {}
    for N, K in ((4096, 4096), (32768, 4096), (4096, 16384)):
        w4, w8 = _w4(N, K, 7), _fp8(N, K, 7)
        for M in (1, 2, 4, 16, 300):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            for fmt, w in (("w4a16", w4), ("fp8", w8)):
                ref = linear_ref(x, w).float()
                y = Q.quant_linear(x, w).float()
                res[f"{fmt} {N}x{K} M={M}"] = float((y - ref).norm() / ref.norm())
    worst = max(res.values())
    print(f"quant_linear vs reference at real shapes: worst relative error {worst:.2e}")
    out["check"] = res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prefill-m", type=int, default=8192)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant needs a CUDA GPU")
    cfg = preset_config("full")
    shapes = list(G.model_linear_shapes(cfg))
    out = {"gpu": torch.cuda.get_device_name()}
    check_outputs(out)
    decode_table(shapes, args.m, out)
    if not args.no_prefill:
        prefill_table(shapes, args.prefill_m, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
