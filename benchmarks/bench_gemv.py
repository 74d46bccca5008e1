"""Decode GEMV vs cuBLAS at the model's shapes, alone and as whole decode steps (GPU only).

    python -m benchmarks.bench_gemv [--m 1 2 4 8 16] [--quick] [--no-step] [--verbose]
    python -m benchmarks.bench_gemv --m 32 64 128 --no-step     # the large-M tensor-core path

1. Per shape and M: `calibrate` times cuBLAS and every candidate GEMV config, each as a CUDA graph
   of >= 8 back-to-back calls cycling through >= 256 MB of weight copies (no L2 reuse; gaps
   between kernels included). Printed: the weight-bandwidth floor (2*N*K bytes at 4.27 TB/s), us
   per call and GB/s of weights for cuBLAS, the best GEMV, the same with PDL, and the fused op
   that replaces the linear in the fused chain (its extra input/output bytes are negligible;
   M > 16: only o_proj's residual epilogue, the prologues stop at gemv.GEMV_MAX_M).
2. Predicted linear time per decode step: sum over the model's linears of (1) x their count.
3. Whole decode step, one CUDA graph, 32 layers + lm_head, distinct weights per layer (18.35 GB):
     linears cuBLAS       every linear as torch.mm, nothing else (the anchor's 4.99 ms at M = 1)
     linears dispatch     every linear through gemv.linear (calibrated winner per shape)
     linears gemv (+pdl)  every linear through the GEMV
     step cuBLAS          the engine's current linear-side kernels: linears + fused.add_rms_norm x2
                          + fused.silu_mul per layer, rms_norm + lm_head (attention left out: o is
                          a fixed buffer)
     step dispatch        the same with gemv.linear
     fused (+pdl)         the fused chain: gemv_rmsnorm(qkv), gemv_residual(o_proj),
                          gemv_rmsnorm(gate_up), gemv_silu_mul(down, residual); lm_head with the
                          final-norm prologue: 4 kernels per layer instead of 7 (M <= 16 only)
   Printed: ms per step, effective GB/s over the weight bytes, % of the 4.30 ms floor.
--quick times only the default config per shape (fewer Triton compiles; all compiles are cached
on disk, so a second run is fast).
"""

from __future__ import annotations

import argparse
import time

import torch

from salaserve.config import preset_config
from salaserve.kernels import fused
from salaserve.kernels import gemv as G
from salaserve.kernels.timing import graph_time_us

BANDWIDTH = 4.27e12  # measured device-to-device copy, bytes/s (shared/reference/anchors.md)
EPS = 1e-6


def _gbs(bytes_, us):
    return bytes_ / (us * 1e-6) / 1e9


def _fused_op(name, M, N, K, cfg, ws, pdl):
    """The fused op replacing linear `name` in the fused chain, as fn(i) for time_linear-style
    timing; (None, label) where it does not exist at this M (prologues above GEMV_MAX_M)."""
    dev = ws[0].device
    if M > G.GEMV_MAX_M and not name.startswith("o_proj"):
        return None, "-"
    if name in ("down",):
        gu = torch.randn(M, 2 * K, device=dev).bfloat16()
        res = torch.randn(M, N, device=dev).bfloat16()
        return lambda i: G.gemv_silu_mul(gu, ws[i % len(ws)], residual=res, scale=0.25, config=cfg, pdl=pdl), "silu+res"
    if name.startswith("o_proj"):
        x = torch.randn(M, K, device=dev).bfloat16()
        res = torch.randn(M, N, device=dev).bfloat16()
        return lambda i: G.gemv_residual(x, ws[i % len(ws)], res, 0.25, config=cfg, pdl=pdl), "residual"
    x = torch.randn(M, K, device=dev).bfloat16()
    nw = torch.ones(K, device=dev, dtype=torch.bfloat16)
    return lambda i: G.gemv_rmsnorm(x, nw, EPS, ws[i % len(ws)], config=cfg, pdl=pdl), "rmsnorm"


def shape_rows(shapes, ms):
    """Section 1 from the calibration table; returns {(N, K, M): (cublas, dispatch, gemv) us}."""
    dev = torch.device("cuda")
    table = {}
    print("\n# 1. one linear, CUDA graph of back-to-back calls (L2-busting weight copies); us per call, GB/s;")
    print("#    'gemv' = best calibrated config, '+pdl' = same with PDL, 'fused' = the op replacing it in the chain")
    print(f"{'shape':<15} {'N':>6} {'K':>6} {'M':>3} {'floor':>6} {'cuBLAS':>15} {'gemv':>15} {'+pdl':>7} "
          f"{'fused':>16}  config")
    for N, K in dict.fromkeys((N, K) for _, N, K, _ in shapes):
        names = [n for n, n_, k_, _ in shapes if (n_, k_) == (N, K)]
        ws = G.weight_copies(N, K, torch.bfloat16, dev)
        calls = max(8, len(ws))
        for M in ms:
            c = G.calibrated_choice(M, N, K, dev)
            t_pdl = G.time_linear("gemv", M, N, K, dev, config=c.gemv, pdl=True, weights=ws)
            fn, label = _fused_op(names[0], M, N, K, c.gemv, ws, pdl=False)
            fused_cell = f"{graph_time_us(fn, calls):>6.1f}" if fn is not None else f"{'-':>6}"
            b = N * K * 2
            table[(N, K, M)] = (c.cublas_us, min(c.gemv_us, c.cublas_us), c.gemv_us)
            print(f"{'/'.join(names):<15} {N:>6} {K:>6} {M:>3} {b / BANDWIDTH * 1e6:>6.1f} "
                  f"{c.cublas_us:>6.1f} {_gbs(b, c.cublas_us):>5.0f}GB/s "
                  f"{c.gemv_us:>6.1f} {_gbs(b, c.gemv_us):>5.0f}GB/s "
                  f"{t_pdl:>7.1f} {fused_cell} {label:<9}  {c.gemv}{'' if c.use_gemv else ' (cuBLAS wins)'}")
        del ws
        torch.cuda.empty_cache()
    return table


def predicted_rows(shapes, ms, table):
    print("\n# 2. predicted linear time per decode step (sum of section 1 x uses), ms; floor "
          f"{sum(N * K * 2 * c for _, N, K, c in shapes) / BANDWIDTH * 1e3:.2f} ms")
    print(f"{'M':>3} {'cuBLAS':>8} {'dispatch':>9} {'gemv':>8}")
    for M in ms:
        tot = [sum(table[(N, K, M)][j] * c for _, N, K, c in shapes) / 1e3 for j in range(3)]
        print(f"{M:>3} {tot[0]:>8.3f} {tot[1]:>9.3f} {tot[2]:>8.3f}")


class Model:
    """Random weights with the model's linear shapes, one set per layer (18.35 GB at full size)."""

    def __init__(self, cfg, dev):
        self.cfg = cfg
        bf = torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)

        def mat(n, k):
            w = torch.empty(n, k, device=dev, dtype=bf)
            for i in range(0, n, 8192):  # fp32 randn in slices: bounded temporary memory
                rows = min(8192, n - i)
                w[i:i + rows] = (torch.randn(rows, k, device=dev, generator=g) * k ** -0.5).to(bf)
            return w

        h, f = cfg.hidden_size, cfg.intermediate_size
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            sparse = cfg.is_sparse_layer(i)
            n_qkv = 2 * cfg.q_size + 2 * cfg.kv_size if sparse else 4 * cfg.lightning_size
            k_o = cfg.q_size if sparse else cfg.lightning_size
            self.layers.append(dict(qkv=mat(n_qkv, h), o=mat(h, k_o), gate_up=mat(2 * f, h), down=mat(h, f),
                                    in_norm=torch.ones(h, device=dev, dtype=bf),
                                    post_norm=torch.ones(h, device=dev, dtype=bf)))
        self.lm_head = mat(cfg.vocab_size, h)
        self.final_norm = torch.ones(h, device=dev, dtype=bf)
        self.bytes = sum(w.numel() * 2 for L in self.layers for k, w in L.items() if w.dim() == 2)
        self.bytes += self.lm_head.numel() * 2


STEP_VARIANTS = ("linears cuBLAS", "linears dispatch", "linears gemv", "linears gemv+pdl",
                 "step cuBLAS", "step dispatch", "fused", "fused+pdl")


def step_variants(model: Model, M: int, dev) -> dict:
    """name -> fn() running one decode step's linear-side kernels (section 3)."""
    cfg = model.cfg
    r = cfg.residual_scale
    bf = torch.bfloat16
    h0 = torch.randn(M, cfg.hidden_size, device=dev).to(bf)
    o = torch.randn(M, cfg.q_size, device=dev).to(bf)  # attention output stand-in
    act = torch.randn(M, cfg.intermediate_size, device=dev).to(bf)
    outs = {}

    def out(key, n):
        if key not in outs:
            outs[key] = torch.empty(M, n, device=dev, dtype=bf)
        return outs[key]

    def one_linear(kind, x, w, y):
        if kind == "cublas" or (kind == "dispatch" and not G.uses_gemv(M, *w.shape, dev)):
            torch.mm(x, w.t(), out=y)
        else:
            G.gemv(x, w, out=y, pdl=True if kind == "gemv+pdl" else None)

    def linears(kind):
        def run():
            for L in model.layers:
                for name, x in (("qkv", h0), ("o", o), ("gate_up", h0), ("down", act)):
                    w = L[name]
                    one_linear(kind, x, w, out((name, w.shape[0]), w.shape[0]))
            one_linear(kind, h0, model.lm_head, out("lm", model.lm_head.shape[0]))
        return run

    def step(kind):
        lin = (lambda x, w: x @ w.t()) if kind == "cublas" else G.linear

        def run():
            h = h0
            normed = fused.rms_norm(h, model.layers[0]["in_norm"], EPS)
            for i, L in enumerate(model.layers):
                lin(normed, L["qkv"])
                u = lin(o, L["o"])
                h, normed = fused.add_rms_norm(h, u, r, L["post_norm"], EPS)
                m = lin(fused.silu_mul(lin(normed, L["gate_up"])), L["down"])
                nxt = model.layers[i + 1]["in_norm"] if i + 1 < len(model.layers) else model.final_norm
                h, normed = fused.add_rms_norm(h, m, r, nxt, EPS)
            lin(normed, model.lm_head)
        return run

    def fused_chain(pdl):
        def run():
            h = h0
            for L in model.layers:
                G.gemv_rmsnorm(h, L["in_norm"], EPS, L["qkv"], pdl=pdl)
                h = G.gemv_residual(o, L["o"], h, r, pdl=pdl)
                gu = G.gemv_rmsnorm(h, L["post_norm"], EPS, L["gate_up"], pdl=pdl)
                h = G.gemv_silu_mul(gu, L["down"], residual=h, scale=r, pdl=pdl)
            G.gemv_rmsnorm(h, model.final_norm, EPS, model.lm_head, pdl=pdl)
        return run

    fns = [linears("cublas"), linears("dispatch"), linears("gemv"), linears("gemv+pdl"),
           step("cublas"), step("dispatch"), fused_chain(None), fused_chain(True)]
    if M > G.GEMV_MAX_M:  # no fused prologues there
        fns[-2:] = [None, None]
    return dict(zip(STEP_VARIANTS, fns))


def step_rows(model: Model, ms):
    dev = torch.device("cuda")
    floor_ms = model.bytes / BANDWIDTH * 1e3
    print(f"\n# 3. whole decode step in one CUDA graph: {model.cfg.num_hidden_layers} layers + lm_head, "
          f"{model.bytes / 1e9:.2f} GB of weights, floor {floor_ms:.2f} ms; ms per step (GB/s, % of floor speed)")
    print(f"{'M':>3} " + " ".join(f"{n:>18}" for n in STEP_VARIANTS))
    for M in ms:
        cells = []
        for fn in step_variants(model, M, dev).values():
            if fn is None:
                cells.append("-")
                continue
            t = graph_time_us(lambda i: fn(), repeats=7) / 1e3
            cells.append(f"{t:6.3f} ({_gbs(model.bytes, t * 1e3):4.0f} {100 * floor_ms / t:3.0f}%)")
            del fn
        print(f"{M:>3} " + " ".join(f"{c:>18}" for c in cells))
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                    help=f"batch rows, 1..{G.DOT_MAX_M} (above {G.GEMV_MAX_M}: tensor-core GEMV, explicit splits)")
    ap.add_argument("--quick", action="store_true", help="default GEMV config only (no candidate search)")
    ap.add_argument("--no-shapes", action="store_true", help="skip sections 1-2 (calibration still runs)")
    ap.add_argument("--no-step", action="store_true", help="skip section 3 (needs ~19 GB of GPU memory)")
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time")
    args = ap.parse_args(argv)
    if not all(1 <= m <= G.DOT_MAX_M for m in args.m):
        ap.error(f"--m values must be in 1..{G.DOT_MAX_M}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA GPU")
    cfg = preset_config("full")
    shapes = G.model_linear_shapes(cfg)
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}; "
          f"copy bandwidth {BANDWIDTH / 1e12:.2f} TB/s")
    t0 = time.perf_counter()
    distinct = list(dict.fromkeys((N, K) for _, N, K, _ in shapes))
    configs = (lambda M: [G.default_config(M, 0, 0)]) if args.quick else None
    G.calibrate(distinct, "cuda", m_values=args.m, configs=configs, verbose=args.verbose)
    print(f"# calibrate({len(distinct)} shapes x M {args.m}): {time.perf_counter() - t0:.1f} s "
          f"(Triton compiles included; cached on disk for the next run)")
    if not args.no_shapes:
        table = shape_rows(shapes, args.m)
        predicted_rows(shapes, args.m, table)
    if not args.no_step:
        model = Model(cfg, torch.device("cuda"))
        step_rows(model, args.m)


if __name__ == "__main__":
    main()
