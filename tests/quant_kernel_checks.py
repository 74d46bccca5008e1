"""Triton quantized-GEMM kernels vs their torch twins, under the Triton interpreter (CPU).

Run as a subprocess by tests/test_quant.py (TRITON_INTERPRET must be set before triton is first
imported, which a shared pytest process cannot guarantee):
    TRITON_INTERPRET=1 python tests/quant_kernel_checks.py {w4a16_gemv|w4a16_gemm|w8a16|dispatch|...}
Exits non-zero with a message on the first mismatch.
"""

import functools
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from salaserve.kernels import quant_gemm as qg  # noqa: E402
from salaserve.kernels.quant_gemm._common import _WORKSPACE  # noqa: E402
from salaserve.quant import formats, rtn  # noqa: E402
from salaserve.quant.matmul import fp8_matmul_ref, linear_ref, w4a16_matmul_ref  # noqa: E402


def random_w4a16(K, N, gs, act_order, gen):
    """Random GPTQ-layout weights; act-order as GPTQ makes it: g_idx[perm[i]] = i // gs."""
    q = torch.randint(0, 16, (K, N), generator=gen)
    G = (K + gs - 1) // gs
    zeros = torch.randint(0, 16, (G, N), generator=gen)
    scales = (torch.rand(G, N, generator=gen) * 0.02 + 0.005).half()
    if act_order:
        perm = torch.randperm(K, generator=gen)
        g_idx = (torch.argsort(perm) // gs).int()
    else:
        g_idx = formats.trivial_g_idx(K, gs)
    return formats.QuantizedLinearWeights.from_gptq(
        formats.pack_int4(q), formats.pack_zeros(zeros, "gptq_v2"), scales, g_idx, gs, "gptq_v2"
    )


def extreme_w4a16(K, N, gs, gen):
    """Weights whose codes and zero points are all 0 or 15 (the unpacking tricks' edge bits)."""
    q = torch.randint(0, 2, (K, N), generator=gen) * 15
    zeros = torch.randint(0, 2, (K // gs, N), generator=gen) * 15
    return formats.QuantizedLinearWeights.from_gptq(formats.pack_int4(q), formats.pack_zeros(zeros, "gptq_v2"),
                                                   torch.rand(K // gs, N, generator=gen).half() * 0.01 + 0.001,
                                                   None, gs, "gptq_v2")


def check(name, y, ref, rtol):
    """Max error relative to the largest reference value must stay under rtol."""
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() + 1e-6
    status = "ok " if err <= rtol * scale else "BAD"
    print(f"{status} {name}: max|err| {err:.3g} (ref max {scale:.3g}, allowed {rtol * scale:.3g})", flush=True)
    if status == "BAD":
        sys.exit(1)


def same_bits(name, y, y2):
    """y2 must equal y bit for bit (the same arithmetic on the same values, loaded at another time)."""
    if not torch.equal(y, y2):
        print(f"BAD {name}: differs (max {(y.float() - y2.float()).abs().max().item():.3g})")
        sys.exit(1)
    print(f"ok  {name}: bit-equal")


def tol(dtype):
    # fp32: summation order only; fp16: the output rounding plus fp16 weight tiles on the dot path
    return 2e-5 if dtype == torch.float32 else 4e-3


def refused(what, fn, *args):
    """fn(*args) must raise ValueError (bad input gets a clear error, not a wrong result)."""
    try:
        fn(*args)
    except ValueError as e:
        print(f"ok  {what} refused: {e}", flush=True)
    else:
        print(f"BAD {what} accepted", flush=True)
        sys.exit(1)


def counters_rearmed():
    for ws, cnt in _WORKSPACE.values():
        if int(cnt.abs().sum()) != 0:
            print("BAD split-K counters left non-zero", flush=True)
            sys.exit(1)


def w4a16_gemv_checks(gen):
    for act_order in (False, True):
        w = random_w4a16(256, 128, 64, act_order, gen)
        for M in (1, 3, 17):
            x = torch.randn(M, 256, generator=gen)
            ref = linear_ref(x, w)
            for split in (1, 2, 4):
                y = qg.w4a16_gemv(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size,
                                  act_order=act_order, split_k=split, block_k=64, block_n=64)
                check(f"w4a16_gemv M={M} act_order={act_order} split={split}", y, ref, tol(x.dtype))
            # autotuned path (the interpreter keeps one config) with heuristic split-K
            y = qg.w4a16_gemv(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size)
            check(f"w4a16_gemv tuned M={M} act_order={act_order}", y, ref, tol(x.dtype))
            xh = x.half()
            y = qg.w4a16_gemv(xh, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, split_k=2, block_k=64)
            check(f"w4a16_gemv fp16 M={M} act_order={act_order}", y, linear_ref(xh, w), tol(xh.dtype))
        # act-order reordered to contiguous groups: x gathered through perm in the kernel
        if act_order:
            wr = formats.reorder_act_order(w)
            assert wr.g_idx_trivial and wr.perm is not None
            for M in (1, 3):
                x = torch.randn(M, 256, generator=gen)
                y = qg.w4a16_gemv(x, wr.qweight, wr.qzeros, wr.scales, wr.g_idx, wr.group_size, wr.perm,
                                  act_order=False, split_k=2, block_k=64)
                check(f"w4a16_gemv reordered act-order M={M}", y, linear_ref(x, w), tol(x.dtype))
    # group smaller than the K tile (per-channel group lookup), ragged N and K, several M tiles
    for K, N, gs, M, bk in ((256, 128, 32, 1, 64), (256, 128, 32, 5, 64), (192, 100, 64, 1, 128),
                            (192, 100, 64, 3, 128), (256, 72, 128, 80, 64)):
        w = random_w4a16(K, N, gs, False, gen)
        x = torch.randn(M, K, generator=gen)
        y = qg.w4a16_gemv(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, split_k=2, block_k=bk)
        check(f"w4a16_gemv K={K} N={N} gs={gs} M={M} BK={bk}", y, linear_ref(x, w), tol(x.dtype))
    # the raw-tensor API accepts the checkpoint (v1) zeros after conversion, and g_idx=None
    w = random_w4a16(256, 128, 64, False, gen)
    x = torch.randn(2, 256, generator=gen)
    ck = w.to_checkpoint("gptq")
    ref = w4a16_matmul_ref(x, ck["qweight"], ck["qzeros"], ck["scales"], None, 64, fmt="gptq")
    y = qg.w4a16_gemv(x, w.qweight, w.qzeros, w.scales, None, 64, block_k=64)
    check("w4a16_gemv g_idx=None vs checkpoint-format reference", y, ref, tol(x.dtype))
    counters_rearmed()


def w4a16_fma_checks(gen):
    """The decode FMA kernel (1 + q/16 mantissa trick, the constant parts and the zero folded into
    each group's start value): every M bucket and config, split-K 1..4 (empty splits included),
    groups 32..K, ragged N, a reordered act-order layout, fp32 (summation order only), fp16 and bf16
    activations (bf16: read as int32 pairs, 16 bytes per packed row)."""
    for K, N, gs in ((256, 128, 64), (512, 72, 128), (256, 100, 256), (384, 64, 32)):
        w = random_w4a16(K, N, gs, False, gen)
        for M in (1, 2, 3, 4):
            x = torch.randn(M, K, generator=gen)
            ref = linear_ref(x, w)
            bucket = 1 if M == 1 else (2 if M == 2 else 4)
            for cfg in qg.W4_FMA_CONFIGS[bucket]:
                if gs % (cfg[1] * 8):
                    continue
                for split in (1, 2, 4):
                    y = qg.w4a16_gemv_fma(x, w, config=cfg, split_k=split)
                    check(f"w4a16_gemv_fma K={K} N={N} gs={gs} M={M} cfg={cfg} split={split}", y, ref, tol(x.dtype))
            xh = x.half()
            y = qg.w4a16_gemv_fma(xh, w, config=(64, 4, 4), split_k=2)
            check(f"w4a16_gemv_fma fp16 K={K} N={N} gs={gs} M={M}", y, linear_ref(xh, w), tol(xh.dtype))
    # bf16 x as the model runs it: whole tiles (EVEN, no masks) and ragged N and K (the last group
    # half full); within the bf16 output's rounding (the interpreter truncates where the GPU rounds)
    for K, N in ((256, 128), (320, 72)):
        w = random_w4a16(K, N, 128, False, gen)
        for M in (1, 2, 3, 4):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            ref = linear_ref(x.float(), w)
            for cfg in qg.W4_FMA_CONFIGS[1 if M == 1 else (2 if M == 2 else 4)]:
                y = qg.w4a16_gemv_fma(x, w, config=cfg, split_k=2)
                check(f"w4a16_gemv_fma bf16 K={K} N={N} M={M} cfg={cfg}", y, ref, 2 ** -7)
    wr = formats.reorder_act_order(random_w4a16(256, 128, 64, True, gen))
    x = torch.randn(2, 256, generator=gen)
    y = qg.w4a16_gemv_fma(x, wr, config=(64, 8, 4), split_k=2)
    check("w4a16_gemv_fma reordered act-order", y, linear_ref(x, wr), tol(x.dtype))
    # codes at the extremes (0 and 15) with zeros at the extremes: the mantissa trick's edge bits
    K = 256
    w = extreme_w4a16(K, 64, 128, gen)
    x = torch.randn(1, K, generator=gen)
    check("w4a16_gemv_fma extreme codes", qg.w4a16_gemv_fma(x, w, split_k=2), linear_ref(x, w), tol(x.dtype))
    refused("act-order weights without reordering", qg.w4a16_gemv_fma, torch.randn(1, 256),
            random_w4a16(256, 64, 64, True, gen))
    counters_rearmed()


def w4a16_dp2a_checks(gen):
    """The dp2a decode kernel (x rounded to int16 per thread and tile, or once per CTA into the
    scratch): every config of both M buckets, split-K 1..4 (empty splits included), ragged N and K
    (masks), codes and zeros at 0 and 15, an outlier channel, all-zero x, a NaN in x, and what it
    refuses."""
    for K, N in ((256, 128), (320, 72), (512, 64)):
        w = random_w4a16(K, N, 128, False, gen)
        for M in (1, 2):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            x[:, 3] = 30.0  # one large channel: the others keep 2^-16 of it as their step
            ref = linear_ref(x.float(), w)
            for cfg in qg.W4_DP2A_CONFIGS[M]:
                for split in ((1, 2, 4) if cfg == qg.W4_DP2A_CONFIGS[M][0] else (2,)):
                    y = qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=split)
                    # within the bf16 output's rounding (the interpreter truncates where the GPU rounds)
                    check(f"w4a16_gemv_dp2a K={K} N={N} M={M} cfg={cfg} split={split}", y, ref, 2 ** -7)
                    if split in (1, 4):
                        same_bits(f"w4a16_gemv_dp2a sz_ahead K={K} N={N} M={M} cfg={cfg} split={split}", y,
                                  qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=split, sz_ahead=True))
    # a group of two K tiles (the scales and zero points of a step ahead are those of its own group)
    w = random_w4a16(512, 64, 256, False, gen)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16)
    for cfg in qg.W4_DP2A_CONFIGS[1]:
        y = qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=2)
        check(f"w4a16_gemv_dp2a group 256 cfg={cfg}", y, linear_ref(x.float(), w), 2 ** -7)
        same_bits(f"w4a16_gemv_dp2a sz_ahead group 256 cfg={cfg}", y,
                  qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=2, sz_ahead=True))
    # channel scales spread over ~4 orders of magnitude (lognormal, as LLM activations' outlier
    # channels): the small channels of a tile keep only 2^-16 of its largest as their step
    w = random_w4a16(512, 128, 128, False, gen)
    x = (torch.randn(2, 512, generator=gen) * torch.exp(2 * torch.randn(512, generator=gen))).to(torch.bfloat16)
    for cfg in qg.W4_DP2A_CONFIGS[2]:
        check(f"w4a16_gemv_dp2a lognormal channels {cfg}", qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=2),
              linear_ref(x.float(), w), 2 ** -7)
    w = extreme_w4a16(256, 64, 128, gen)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16)
    for cfg in (qg.W4_DP2A_CONFIGS[1][0], next(c for c in qg.W4_DP2A_CONFIGS[2] if c[5])):
        check(f"w4a16_gemv_dp2a extreme codes {cfg}", qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=2),
              linear_ref(x.float(), w), 2 ** -7)
        y = qg.w4a16_gemv_dp2a(torch.zeros(1, 256, dtype=torch.bfloat16), w, config=cfg)
        if y.abs().max().item() != 0:
            print(f"BAD w4a16_gemv_dp2a zero x {cfg}: {y.abs().max().item()}")
            sys.exit(1)
        xn = x.clone()
        xn[0, 5] = float("nan")  # as dequantize-then-matmul: a NaN in x makes every output NaN
        if not qg.w4a16_gemv_dp2a(xn, w, config=cfg).isnan().all():
            print(f"BAD w4a16_gemv_dp2a NaN x {cfg}: not propagated")
            sys.exit(1)
        print(f"ok  w4a16_gemv_dp2a zero and NaN x {cfg}")
    refused("fp32 x", qg.w4a16_gemv_dp2a, torch.randn(1, 256), w)
    w4a16_dp2a_rounded_checks(gen)
    w4a16_dp2a_silu_out_checks(gen)
    refused("3 rows", qg.w4a16_gemv_dp2a, torch.randn(3, 256).to(torch.bfloat16), w)
    refused("act-order weights", qg.w4a16_gemv_dp2a, torch.randn(1, 256).to(torch.bfloat16),
            random_w4a16(256, 64, 128, True, gen))
    counters_rearmed()


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """TorchBackend.silu_mul: silu(gate) * up on bf16 [M, 2F], rounded after the silu and the product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def w4a16_dp2a_silu_out_checks(gen):
    """silu_out (the gate_up GEMV writes silu_mul of its output): every one- and two-row config, on bf16
    x and on rounded x, split-K 1 and 3, whole tiles and a ragged F (36: masked halves), against
    silu_mul of dequantize-then-matmul (not against the GEMV followed by the silu_mul kernel: the
    interpreter's bf16 store truncates where the epilogue rounds; the GPU test compares the two bit for
    bit); SZ_AHEAD with it changes no bit. Refuses an odd N."""
    for K, F in ((256, 64), (384, 36)):
        w = random_w4a16(K, 2 * F, 128, False, gen)
        for M in (1, 2):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            ref = silu_mul_ref(linear_ref(x.float(), w).to(torch.bfloat16))
            xq, xs = qg.round_x_int16(x)
            for cfg in qg.W4_DP2A_CONFIGS[M]:
                for split in (1, 3):
                    y = qg.w4a16_gemv_dp2a(x, w, config=cfg, split_k=split, silu_out=True)
                    check(f"w4a16_gemv_dp2a silu_out K={K} F={F} M={M} cfg={cfg} split={split}", y, ref, 2 ** -7)
            for cfg in qg.W4_DP2A_ROUNDED_CONFIGS[M]:
                y = qg.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=3, silu_out=True)
                check(f"w4a16_gemv_dp2a_rounded silu_out K={K} F={F} M={M} cfg={cfg}", y, ref, 2 ** -7)
                same_bits(f"w4a16_gemv_dp2a_rounded silu_out sz_ahead K={K} F={F} M={M} cfg={cfg}", y,
                          qg.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=3, silu_out=True,
                                                     sz_ahead=True))
    refused("silu_out with an odd N", functools.partial(qg.w4a16_gemv_dp2a, silu_out=True),
            torch.randn(1, 256).to(torch.bfloat16), random_w4a16(256, 72 + 1, 128, False, gen))


def w4a16_dp2a_rounded_checks(gen):
    """The dp2a kernel on x rounded by its producer (round_x_int16's layout): round_x_int16 equals what
    the X_PREP prologue writes to its scratch (the consumer's layout), and the rounded path equals
    dequantize-then-matmul at 1 and 2 rows, split-K 1 and 3, ragged N, an outlier channel and
    lognormal channel scales."""
    prep_cfg = next(c for c in qg.W4_DP2A_CONFIGS[2] if c[5])
    for M in (1, 2):
        x = torch.randn(M, 384, generator=gen).to(torch.bfloat16)
        x[:, 7] = -40.0
        w = random_w4a16(384, 72, 128, False, gen)
        qg.w4a16_gemv_dp2a(x, w, config=prep_cfg, split_k=1)
        xq, xs = qg.round_x_int16(x)
        scratch_q, scratch_s = sys.modules["salaserve.kernels.quant_gemm.w4_dp2a"]._X_SCRATCH["cpu"]
        if not (torch.equal(scratch_q[:xq.numel()], xq.flatten()) and torch.equal(scratch_s[:xs.numel()], xs.flatten())):
            print(f"BAD round_x_int16 M={M}: differs from the X_PREP prologue's scratch")
            sys.exit(1)
        print(f"ok  round_x_int16 M={M} equals the X_PREP scratch")
        ref = linear_ref(x.float(), w)
        for cfg in qg.W4_DP2A_ROUNDED_CONFIGS[M]:
            for split in (1, 3):
                y = qg.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=split)
                check(f"w4a16_gemv_dp2a_rounded M={M} cfg={cfg} split={split}", y, ref, 2 ** -7)
                same_bits(f"w4a16_gemv_dp2a_rounded sz_ahead M={M} cfg={cfg} split={split}", y,
                          qg.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=split, sz_ahead=True))
    w = random_w4a16(512, 128, 128, False, gen)
    x = (torch.randn(2, 512, generator=gen) * torch.exp(2 * torch.randn(512, generator=gen))).to(torch.bfloat16)
    check("w4a16_gemv_dp2a_rounded lognormal channels",
          qg.w4a16_gemv_dp2a_rounded(*qg.round_x_int16(x), w, split_k=2), linear_ref(x.float(), w), 2 ** -7)
    xq, xs = qg.round_x_int16(x)
    refused("rounded x of the wrong width", qg.w4a16_gemv_dp2a_rounded, xq[:, :128], xs[:, :2], w)
    refused("rounded x as int16", qg.w4a16_gemv_dp2a_rounded, xq.to(torch.int16), xs, w)
    refused("rounded x, 3 rows", qg.w4a16_gemv_dp2a_rounded, *qg.round_x_int16(torch.randn(3, 512)), w)
    ragged = random_w4a16(320, 64, 128, False, gen)  # K = 2.5 tiles: no whole-tile scale for the last
    refused("rounded x, K not whole tiles", qg.w4a16_gemv_dp2a_rounded, torch.zeros(1, 160, dtype=torch.int32),
            torch.zeros(1, 2), ragged)


def w4a16_wgmma_checks(gen):
    """The decode GEMV on warpgroup MMAs, on the repacked copy: every config at 1..16 rows of bf16 x
    (rows past M are clamped copies, never written), split-K 1..4 (empty splits included), one and
    several groups per split, codes and zeros at the extremes. Against its twin (weights rounded
    to bf16 as (q - z) * bf16(s), fp32 sums): within the bf16 output's rounding (the interpreter
    truncates); against the exact product: within that plus the weights' rounding."""
    for K, N, gs in ((256, 256, 128), (512, 256, 256), (1024, 512, 128)):
        w = random_w4a16(K, N, gs, False, gen)
        packed = qg.repack_w4_for_wgmma(w)
        for M in (1, 3, 16):
            x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            twin, exact = qg.w4a16_wgmma_ref(x, w), linear_ref(x.float(), w)
            for cfg in qg.W4_WGMMA_CONFIGS:
                if not qg.w4_wgmma_usable(w, cfg):
                    continue
                for split in (1, 2, 4):
                    y = qg.w4a16_gemv_wgmma(x, w, packed, config=cfg, split_k=split)
                    check(f"w4a16_gemv_wgmma K={K} N={N} gs={gs} M={M} cfg={cfg} split={split}", y, twin, 2 ** -7)
                    check("  ... against the exact product", y, exact, 2 ** -6)
    K, gs = 256, 128
    w = extreme_w4a16(K, 256, gs, gen)
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16)
    y = qg.w4a16_gemv_wgmma(x, w, qg.repack_w4_for_wgmma(w), config=qg.W4_WGMMA_CONFIGS[0], split_k=2)
    check("w4a16_gemv_wgmma extreme codes", y, qg.w4a16_wgmma_ref(x, w), 2 ** -7)
    ragged = random_w4a16(K, 96, gs, False, gen)
    refused("a ragged N", qg.w4a16_gemv_wgmma, x, ragged, qg.repack_w4_for_wgmma(ragged))
    refused("17 rows", qg.w4a16_gemv_wgmma, torch.randn(17, K).to(torch.bfloat16), w, qg.repack_w4_for_wgmma(w))
    refused("fp32 x", qg.w4a16_gemv_wgmma, torch.randn(1, K), w, qg.repack_w4_for_wgmma(w))
    refused("another weight's copy", qg.w4a16_gemv_wgmma, x, w, qg.repack_w4_for_wgmma(random_w4a16(512, 256, gs, False, gen)))
    counters_rearmed()


def w4a16_dense_checks(gen):
    """Prefill path: dequantize into the scratch W^T, then torch.mm. fp32 activations: the scratch
    is fp32, exact; fp16: weights rounded once to fp16."""
    for K, N, gs in ((256, 128, 64), (512, 72, 128), (256, 100, 256)):
        w = random_w4a16(K, N, gs, False, gen)
        wt = qg.w4a16_dequantize(w, torch.float32)
        ref_w = w.dequantize(torch.float32)
        if not torch.equal(wt.t(), ref_w):
            print(f"BAD w4a16_dequantize K={K} N={N} gs={gs}", flush=True)
            sys.exit(1)
        for M in (1, 70):
            x = torch.randn(M, K, generator=gen)
            check(f"w4a16_dense_mm K={K} N={N} gs={gs} M={M}", qg.w4a16_dense_mm(x, w), linear_ref(x, w), tol(x.dtype))
            xh = x.half()
            check(f"w4a16_dense_mm fp16 K={K} M={M}", qg.w4a16_dense_mm(xh, w), linear_ref(xh, w), tol(xh.dtype))
    wr = formats.reorder_act_order(random_w4a16(256, 128, 64, True, gen))
    x = torch.randn(33, 256, generator=gen)
    check("w4a16_dense_mm reordered act-order", qg.w4a16_dense_mm(x, wr), linear_ref(x, wr), tol(x.dtype))
    print("ok  w4a16_dequantize equals formats.dequantize_gptq exactly", flush=True)


def w4a16_gemm_checks(gen):
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}
    for act_order in (False, True):
        w = random_w4a16(256, 128, 64, act_order, gen)
        for M in (1, 3, 17, 40):
            x = torch.randn(M, 256, generator=gen)
            ref = linear_ref(x, w)
            y = qg.w4a16_gemm(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, act_order=act_order)
            check(f"w4a16_gemm tuned M={M} act_order={act_order}", y, ref, tol(x.dtype))
            y = qg.w4a16_gemm(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size,
                              act_order=act_order, config=small)
            check(f"w4a16_gemm 16x32x64 M={M} act_order={act_order}", y, ref, tol(x.dtype))
        xh = torch.randn(17, 256, generator=gen).half()
        y = qg.w4a16_gemm(xh, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, config=small)
        check(f"w4a16_gemm fp16 act_order={act_order}", y, linear_ref(xh, w), tol(xh.dtype))
    w = formats.reorder_act_order(random_w4a16(256, 128, 64, True, gen))
    x = torch.randn(33, 256, generator=gen)
    y = qg.w4a16_gemm(x, w.qweight, w.qzeros, w.scales, w.g_idx, w.group_size, w.perm, act_order=False, config=small)
    check("w4a16_gemm reordered act-order", y, linear_ref(x, w), tol(x.dtype))


def w8a16_checks(gen):
    for K, N in ((256, 128), (200, 100)):
        f = rtn.quantize_fp8(torch.randn(N, K, generator=gen))
        for M in (1, 3, 17):
            x = torch.randn(M, K, generator=gen)
            ref = fp8_matmul_ref(x, f.weight, f.scale)
            for split in (1, 3):
                y = qg.w8a16_gemv(x, f.weight, f.scale, split_k=split, block_k=64, block_n=32)
                check(f"w8a16_gemv K={K} N={N} M={M} split={split}", y, ref, tol(x.dtype))
            y = qg.w8a16_gemv(x, f.weight, f.scale)
            check(f"w8a16_gemv tuned K={K} N={N} M={M}", y, ref, tol(x.dtype))
            xh = x.half()
            y = qg.w8a16_gemv(xh, f.weight, f.scale, split_k=2, block_k=64)
            check(f"w8a16_gemv fp16 K={K} N={N} M={M}", y, fp8_matmul_ref(xh, f.weight, f.scale), tol(xh.dtype))
    counters_rearmed()


def rowquant_checks(gen):
    """quantize_rows_fp8 bit for bit against its torch twin: several short rows per program, one
    long row per program with masked tails, the two-pass path of rows too long for registers, and
    silu_mul fused in (against fused.silu_mul's output, quantized by the twin)."""
    from salaserve.kernels.fused import silu_mul

    def same(name, got, want):
        ok = torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        print(f"{'ok ' if ok else 'BAD'} {name}", flush=True)
        if not ok:
            sys.exit(1)

    for M, K in ((5, 384), (37, 200), (3, 3 * qg.ROWQUANT_ONE_PASS_MAX // 2)):
        x = torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 10
        x[1] = 0  # an all-zero row takes the 1e-12 floor
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            same(f"quantize_rows_fp8 M={M} K={K} {dtype}", qg.quantize_rows_fp8(xd), qg.fp8_quantize_rows_ref(xd))
            gate_up = torch.cat([xd, xd.flip(0) * 0.5], dim=1)
            same(f"quantize_rows_fp8(silu=True) M={M} K={K} {dtype}", qg.quantize_rows_fp8(gate_up, silu=True),
                 qg.fp8_quantize_rows_ref(silu_mul(gate_up)))
    refused("quantize_rows_fp8 of a strided x", qg.quantize_rows_fp8, torch.randn(4, 64)[:, ::2])
    refused("quantize_rows_fp8(silu=True) of an odd width", lambda x: qg.quantize_rows_fp8(x, silu=True),
            torch.randn(4, 63))


def dispatch_checks(gen):
    W = torch.randn(96, 256, generator=gen)
    variants = {
        "bf16": formats.QuantizedLinearWeights.from_dense(W),
        "fp8": rtn.quantize_fp8(W),
        "w4a16": rtn.quantize_w4a16_rtn(W, 64),
        "w4a16-g128": rtn.quantize_w4a16_rtn(W, 128),  # decode M <= 4: the FMA kernel
        "w4a16-act-order": random_w4a16(256, 96, 64, True, gen),
    }
    for name, w in variants.items():
        for lead in ((1,), (2, 3), (qg.GEMV_MAX_M + 5,)):
            x = torch.randn(*lead, 256, generator=gen)
            y = qg.quant_linear(x, w, backend="triton")
            assert y.shape == (*lead, 96), y.shape
            ref = linear_ref(x.reshape(-1, 256), w)
            check(f"quant_linear[{name}] x{tuple(x.shape)}", y, ref.reshape(y.shape), tol(x.dtype))
    # bf16 activations with fp8 weights at decode sizes, w8a16 (no calibrated GEMV: the tensor-core
    # path even at M = 1), then as if the start-up calibration had picked the fp8 FMA GEMV: within
    # one bf16 ulp of the exact result, at most 2^-7 relative (the interpreter truncates fp32 -> bf16
    # where the GPU rounds)
    from salaserve.kernels import gemv as G
    from salaserve.kernels.quant_gemm import fp8 as fp8_module

    f = variants["fp8"]
    gemv_calls = []
    real = G.gemv_fp8
    G.gemv_fp8 = lambda *a, **k: gemv_calls.append(a[0].shape[0]) or real(*a, **k)
    for route in ("w8a16", "gemv"):
        if route == "gemv":
            for m in (1, 2, 4, 8):
                fp8_module.PICKS.put("cpu", m, (f.out_features, f.in_features), G.GemvConfig(16, 64, 1, split_k=2))
        for M in (1, 5, qg.GEMV_MAX_M + 5):
            x = torch.randn(M, 256, generator=gen).to(torch.bfloat16)
            y = qg.quant_linear(x, f, backend="triton")
            check(f"quant_linear[fp8, {route}] bf16 x{tuple(x.shape)}", y, linear_ref(x, f), 2 ** -7)
    # the decode sizes went through the GEMV once calibrated, the prefill size never
    assert sorted(set(gemv_calls)) == [1, 5], gemv_calls
    print("ok  fp8 decode sizes through gemv_fp8:", sorted(set(gemv_calls)))
    counters_rearmed()


if __name__ == "__main__":
    gen = torch.Generator().manual_seed(int(os.environ.get("QUANT_CHECK_SEED", "0")))
    {"w4a16_gemv": w4a16_gemv_checks, "w4a16_gemm": w4a16_gemm_checks, "w8a16": w8a16_checks,
     "w4a16_fma": w4a16_fma_checks, "w4a16_dp2a": w4a16_dp2a_checks, "w4a16_wgmma": w4a16_wgmma_checks, "w4a16_dense": w4a16_dense_checks, "dispatch": dispatch_checks,
     "rowquant": rowquant_checks}[sys.argv[1]](gen)
    print("all ok")
