"""Time the Lightning decode step and the fused elementwise kernels inside CUDA graphs (GPU only).

    python -m benchmarks.bench_lightning [--batch 1 8 64] [--layers 24] [--sweep]

Every variant is captured as one CUDA graph running `--layers` Lightning layers back to back (each
layer its own state slice, as in the model), replayed many times; the table gives microseconds per
layer. Compared:
  ours        lightning_decode_step: q/k norm + RoPE + state update + output, one kernel
  fla+torch   what an engine gets from stock parts: TorchBackend.lightning_qk_norm_rope, .float(),
              gather of the state slots, fla fused_recurrent_simple_gla, scatter of the new states
  fla alone   fused_recurrent_simple_gla on ready fp32 inputs and a contiguous [B, H, d, d] state
              (not in place: writes a new final state; the anchor measured 6.3 / 12.6 / 90 us)
  floor       state bytes read + written once at 4.27 TB/s: B * H * d * d * 4 B * 2 / 4.27e12
--sweep also times every (block_v, num_warps) of the decode kernel, and the program order (batch-
or slot-major) at the default pick. A second table times
lightning_output and the fused.py kernels against their torch twins at decode batch sizes.
"""

from __future__ import annotations

import argparse

import torch

from salaserve.config import alibi_slopes
from salaserve.kernels import fused
from salaserve.kernels.lightning import lightning_decode_step, lightning_output
from salaserve.kernels.timing import graph_time_us
from salaserve.kernels.torch_ops import TorchBackend

H, D, HIDDEN, FFN = 32, 128, 4096, 16384
EPS, THETA = 1e-6, 10000.0
BANDWIDTH = 4.27e12  # measured device-to-device copy, bytes/s (shared/reference/anchors.md)


def graph_us(fn) -> float:
    """Median us of one replay of a CUDA graph holding fn() (5 timings of 50 replays)."""
    return graph_time_us(lambda i: fn(), replays=50)


def decode_rows(B: int, layers: int, sweep: bool):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    qkvz = torch.randn(B, 4 * H * D, device=dev, generator=g).bfloat16()
    q, k, v, _ = (x.view(B, H, D) for x in qkvz.split(H * D, dim=-1))
    qw = torch.ones(D, device=dev, dtype=torch.bfloat16)
    kw = torch.ones(D, device=dev, dtype=torch.bfloat16)
    log_decay = -torch.tensor(alibi_slopes(H), dtype=torch.float32, device=dev)
    state = torch.zeros(B, layers, H, D, D, device=dev)  # one slot per sequence, fp32
    slots = torch.randperm(B, device=dev)
    positions = torch.randint(0, 500000, (B,), device=dev)
    scale = D ** -0.5
    row = {"B": B, "floor": B * H * D * D * 4 * 2 / BANDWIDTH * 1e6}

    def ours(block_v=None, num_warps=None, **order):
        def run():
            for layer in range(layers):
                lightning_decode_step(q, k, v, qw, kw, positions, state, slots, layer, log_decay, scale, EPS,
                                      THETA, block_v=block_v, num_warps=num_warps, **order)
        return run

    row["ours"] = graph_us(ours()) / layers
    if sweep:  # every (block_v, warps) with at most 64 state values per thread (more spills)
        row["sweep"] = {(bv, nw): graph_us(ours(bv, nw)) / layers for bv in (16, 32, 64, 128) for nw in (2, 4, 8, 16)
                        if D * bv // (32 * nw) <= 64}
        best = min((t, bv, nw) for (bv, nw), t in row["sweep"].items())
        row["best"] = f"{best[0]:.1f} (bv {best[1]}, {best[2]} warps)"
        # program order at the default block pick
        row["orders"] = {f"{'slot' if sm else 'batch'}-major": graph_us(ours(slot_major=sm)) / layers
                         for sm in (False, True)}

    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except ImportError:
        return row
    tb = TorchBackend()

    def fla_torch():
        for layer in range(layers):
            qn, kn = tb.lightning_qk_norm_rope(q, k, qw, kw, positions, EPS, THETA)
            h0 = state[slots, layer]
            o, ht = fused_recurrent_simple_gla(qn.float()[:, None], kn.float()[:, None], v.float()[:, None],
                                               g_gamma=log_decay, scale=scale, initial_state=h0,
                                               output_final_state=True)
            state[slots, layer] = ht

    qf, kf, vf = (x.float()[:, None].contiguous() for x in (q, k, v))
    h0s = [torch.zeros(B, H, D, D, device=dev) for _ in range(layers)]

    def fla_alone():
        for layer in range(layers):
            fused_recurrent_simple_gla(qf, kf, vf, g_gamma=log_decay, scale=scale, initial_state=h0s[layer],
                                       output_final_state=True)

    row["fla+torch"] = graph_us(fla_torch) / layers
    row["fla alone"] = graph_us(fla_alone) / layers
    return row


def elementwise_rows(B: int):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    bf = torch.bfloat16
    tb = TorchBackend()
    h = torch.randn(B, HIDDEN, device=dev, generator=g).to(bf)
    upd = torch.randn(B, HIDDEN, device=dev, generator=g).to(bf)
    w = torch.ones(HIDDEN, device=dev, dtype=bf)
    o = torch.randn(B, H, D, device=dev, generator=g)
    qkvz = torch.randn(B, 4 * HIDDEN, device=dev, generator=g).to(bf)
    z = qkvz[:, 3 * HIDDEN:]
    gate_up = torch.randn(B, 2 * FFN, device=dev, generator=g).to(bf)
    r = 1.4 / 32 ** 0.5
    cases = {
        "lightning_output": (lambda: lightning_output(o, w, z, EPS, bf), lambda: tb.lightning_output(o, w, z, EPS, bf)),
        "rms_norm": (lambda: fused.rms_norm(h, w, EPS), lambda: tb.rms_norm(h, w, EPS)),
        "add_rms_norm": (lambda: fused.add_rms_norm(h, upd, r, w, EPS), lambda: tb.add_rms_norm(h, upd, r, w, EPS)),
        "silu_mul": (lambda: fused.silu_mul(gate_up), lambda: tb.silu_mul(gate_up)),
        "sigmoid_mul": (lambda: fused.sigmoid_mul(h, z), lambda: h * torch.sigmoid(z)),
    }
    reps = 32  # per graph, so graph launch overhead is amortised as in a full model graph

    def many(fn):
        def run():
            for _ in range(reps):
                fn()
        return run

    return [(B, name, graph_us(many(ours)) / reps, graph_us(many(twin)) / reps)
            for name, (ours, twin) in cases.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--sweep", action="store_true", help="also sweep block_v x num_warps of the decode kernel")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lightning needs a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; us per layer, CUDA graph of {args.layers} layers")
    print(f"{'B':>4} {'ours':>8} {'fla+torch':>10} {'fla alone':>10} {'floor':>7}  best (sweep)")
    for B in args.batch:
        r = decode_rows(B, args.layers, args.sweep)
        fmt = lambda key: f"{r[key]:.1f}" if key in r else "-"  # noqa: E731
        print(f"{B:>4} {fmt('ours'):>8} {fmt('fla+torch'):>10} {fmt('fla alone'):>10} {r['floor']:>7.1f}  {r.get('best', '')}")
        if "sweep" in r:
            print("     sweep (block_v, warps): " + ", ".join(f"{k}: {t:.1f}" for k, t in r["sweep"].items()))
            print("     order (default pick): " + ", ".join(f"{k}: {t:.1f}" for k, t in r["orders"].items()))
    print("\n# elementwise kernels, us per call (32 calls per graph)")
    print(f"{'B':>4} {'op':<18} {'triton':>8} {'torch':>8}")
    for B in args.batch:
        for b, name, t_ours, t_twin in elementwise_rows(B):
            print(f"{b:>4} {name:<18} {t_ours:>8.1f} {t_twin:>8.1f}")


if __name__ == "__main__":
    main()
