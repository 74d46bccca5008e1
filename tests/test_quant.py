"""Quantization: GPTQ int4 packing, FP8, the weight container, RTN, GPTQ, reference matmuls, and
the Triton kernels (under the interpreter, in a subprocess)."""

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from salaserve.quant import formats, rtn
from salaserve.quant.formats import QuantizedLinearWeights
from salaserve.quant.gptq import HessianAccumulator, gptq_quantize
from salaserve.quant.matmul import fp8_matmul_ref, linear_ref, w4a16_matmul_ref

REPO = Path(__file__).resolve().parents[1]
FRESH_SEEDS = [random.SystemRandom().randrange(2**31) for _ in range(3)]  # new every run; printed on failure


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("seed", FRESH_SEEDS)
def test_int4_pack_roundtrip(seed):
    g = gen(seed)
    K, N = 8 * int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g))
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    qw = formats.pack_int4(q)
    assert qw.dtype == torch.int32 and qw.shape == (K // 8, N), f"seed {seed}"
    assert torch.equal(formats.unpack_int4(qw), q), f"seed {seed}"


def test_int4_bit_layout():
    # k = 8 * row + j sits in bits 4j..4j+3: codes 0..7 down one column give 0x76543210
    q = torch.arange(8, dtype=torch.uint8).repeat(2, 1).t().contiguous()  # [8, 2]
    assert formats.pack_int4(q).tolist() == [[0x76543210, 0x76543210]]
    # a code of 15 in the top nibble makes the int32 negative, as in real checkpoints
    q = torch.zeros(8, 1, dtype=torch.uint8)
    q[7] = 15
    assert formats.pack_int4(q).item() == -(2**28)


@pytest.mark.parametrize("seed", FRESH_SEEDS)
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_zeros_pack_roundtrip(seed, fmt):
    g = gen(seed)
    G, N = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 70, (1,), generator=g))
    z = torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8)  # includes 0, which v1 cannot hold per nibble
    qz = formats.pack_zeros(z, fmt)
    assert qz.shape == (G, (N + 7) // 8), f"seed {seed}"
    assert torch.equal(formats.unpack_zeros(qz, N, fmt), z), f"seed {seed}"
    other = "gptq_v2" if fmt == "gptq" else "gptq"
    assert torch.equal(formats.unpack_zeros(formats.convert_qzeros(qz, fmt, other), N, other), z), f"seed {seed}"


def test_zeros_v1_matches_autogptq_convention():
    # symmetric: zero 8 is stored as 7 per nibble in v1 (0x77777777), as 8 in v2
    z = torch.full((2, 16), 8, dtype=torch.uint8)
    assert formats.pack_zeros(z, "gptq").unique().tolist() == [0x77777777]
    assert formats.pack_zeros(z, "gptq_v2").unique().tolist() == [0x88888888 - 2**32]
    # for zeros 1..15 the v1 int32 is exactly AutoGPTQ's per-nibble (zero - 1) packing
    g = gen(1)
    z = torch.randint(1, 16, (3, 32), generator=g)
    autogptq = sum(((z[:, j::8] - 1) << (4 * j)) for j in range(8))
    assert torch.equal(formats.pack_zeros(z, "gptq"), formats.to_int32(autogptq))


def test_dequantize_gptq_independent_formula():
    g = gen(2)
    K, N, gs = 64, 24, 16
    w = rtn.quantize_w4a16_rtn(torch.randn(N, K, generator=g), gs, sym=False)
    ck = w.to_checkpoint("gptq")
    W = formats.dequantize_gptq(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], gs, "gptq")
    # bit by bit, the way an AutoGPTQ kernel reads v1 files (zero = nibble + 1) for non-zero zeros
    qw, qz = ck["qweight"].to(torch.int64) & 0xFFFFFFFF, ck["qzeros"].to(torch.int64) & 0xFFFFFFFF
    for k in range(0, K, 7):
        for n in range(0, N, 5):
            q = (qw[k // 8, n] >> (4 * (k % 8))) & 0xF
            grp = int(ck["g_idx"][k])
            z = (qz[grp, n // 8] >> (4 * (n % 8))) & 0xF
            z_true = formats.unpack_zeros(w.qzeros, N, "gptq_v2")[grp, n]
            if z_true != 0:
                assert z + 1 == z_true
            expect = (q.item() - int(z_true)) * ck["scales"][grp, n].float()
            assert torch.isclose(W[n, k], expect), (k, n)


# ---------------------------------------------------------------- RTN and FP8


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, 128, -1])
def test_rtn_error_bound(sym, gs):
    g = gen(3)
    N, K = 48, 256
    W = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3
    w = rtn.quantize_w4a16_rtn(W, gs, sym=sym)
    err = (w.dequantize() - W).abs()  # [N, K]
    s = w.scales.float()[w.g_idx.long()].t()  # scale of each element
    # at most half a step; 1% slack: the scale is rounded to fp16 before the codes are chosen,
    # so the clamped top code can miss by 0.5 step + 7.5 ulp(fp16) of the scale
    assert (err <= 0.5 * s * 1.01 + 1e-7).all(), (err / s).max()
    zeros = formats.unpack_zeros(w.qzeros, N, "gptq_v2")
    if sym:
        assert (zeros == 8).all()


def test_fp8_roundtrip():
    g = gen(4)
    W = torch.randn(40, 96, generator=g) * torch.logspace(-3, 1, 40)[:, None]
    W[3] = 0  # an all-zero channel must not produce NaNs
    w8, scale = formats.quantize_fp8_per_channel(W)
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (40,)
    assert torch.allclose(scale[torch.arange(40) != 3], W.abs().amax(1)[torch.arange(40) != 3] / 448)
    Wd = formats.dequantize_fp8(w8, scale)
    assert torch.isfinite(Wd).all() and (Wd[3] == 0).all()
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values, plus subnormal floor
    assert ((Wd - W).abs() <= W.abs() / 16 + scale[:, None] * 2**-9).all()


# ---------------------------------------------------------------- container and fusion


def _fields_equal(a: QuantizedLinearWeights, b: QuantizedLinearWeights):
    for name in ("weight", "scale", "qweight", "qzeros", "scales", "g_idx"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                                                      y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), name
    assert (a.format, a.in_features, a.out_features, a.group_size) == (b.format, b.in_features, b.out_features, b.group_size)


@pytest.mark.parametrize("sizes", [(64, 32, 32), (12, 20, 8)])  # the second: N not a multiple of 8
def test_concat_equals_quantizing_concat(sizes):
    g = gen(5)
    parts = [torch.randn(n, 128, generator=g) for n in sizes]
    cat = torch.cat(parts, 0)
    # RTN and per-channel fp8 are per output channel, so quantize(cat) == cat(quantize)
    _fields_equal(QuantizedLinearWeights.concat([rtn.quantize_w4a16_rtn(p, 32, sym=False) for p in parts]),
                  rtn.quantize_w4a16_rtn(cat, 32, sym=False))
    _fields_equal(QuantizedLinearWeights.concat([rtn.quantize_fp8(p) for p in parts]), rtn.quantize_fp8(cat))
    dense = QuantizedLinearWeights.concat([QuantizedLinearWeights.from_dense(p) for p in parts])
    assert torch.equal(dense.weight, cat)


def test_concat_rejects_mismatched_g_idx():
    g = gen(6)
    a = rtn.quantize_w4a16_rtn(torch.randn(16, 64, generator=g), 32)
    b = rtn.quantize_w4a16_rtn(torch.randn(16, 64, generator=g), 32)
    b.g_idx = b.g_idx[torch.randperm(64, generator=g)].contiguous()
    with pytest.raises(ValueError, match="g_idx"):
        QuantizedLinearWeights.concat([a, b])
    with pytest.raises(ValueError, match="group size"):
        QuantizedLinearWeights.concat([a, rtn.quantize_w4a16_rtn(torch.randn(16, 64, generator=g), 16)])
    with pytest.raises(ValueError, match="format"):
        QuantizedLinearWeights.concat([a, rtn.quantize_fp8(torch.randn(16, 64, generator=g))])


def test_checkpoint_roundtrip_and_reorder():
    g = gen(7)
    W = torch.randn(32, 128, generator=g)
    H = HessianAccumulator(128)
    H.add(torch.randn(512, 128, generator=g) * torch.linspace(0.1, 3, 128))
    w = gptq_quantize(W, H.hessian, group_size=32, act_order=True)
    assert not w.g_idx_trivial
    ck = w.to_checkpoint("gptq")
    back = QuantizedLinearWeights.from_gptq(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 32, "gptq")
    _fields_equal(back, w)
    r = formats.reorder_act_order(w)
    assert r.g_idx_trivial and r.perm is not None
    assert torch.equal(r.dequantize(), w.dequantize())
    cfg = formats.gptq_quantize_config(32, desc_act=True)
    assert cfg["checkpoint_format"] == "gptq" and cfg["bits"] == 4


# ---------------------------------------------------------------- reference matmuls


def test_w4a16_matmul_ref_equals_dequantize_then_matmul():
    g = gen(8)
    W = torch.randn(40, 128, generator=g)
    w = rtn.quantize_w4a16_rtn(W, 64, sym=False)
    ck = w.to_checkpoint()
    x = torch.randn(5, 128, generator=g)
    # independent dequantization through numpy-style bit ops on uint32
    qw = ck["qweight"].to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(qw >> (4 * j)) & 0xF for j in range(8)], 1).reshape(128, 40)
    z = formats.unpack_zeros(ck["qzeros"], 40, "gptq").long()
    grp = torch.arange(128) // 64
    Wd = ((q - z[grp]) * ck["scales"].float()[grp]).t()
    y = w4a16_matmul_ref(x, ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 64)
    torch.testing.assert_close(y, x @ Wd.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, linear_ref(x, w), rtol=1e-5, atol=1e-5)
    assert y.dtype == x.dtype
    xb = x.bfloat16()
    assert w4a16_matmul_ref(xb, ck["qweight"], ck["qzeros"], ck["scales"], None, 64).dtype == torch.bfloat16


def test_fp8_matmul_ref():
    g = gen(9)
    W = torch.randn(24, 64, generator=g)
    w8, s = formats.quantize_fp8_per_channel(W)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(fp8_matmul_ref(x, w8, s), x @ (w8.float() * s[:, None]).t())


def test_quant_linear_cpu_falls_back_to_reference():
    from salaserve.kernels.quant_gemm import quant_linear

    g = gen(10)
    W = torch.randn(24, 64, generator=g)
    x = torch.randn(2, 3, 64, generator=g)
    for w in (QuantizedLinearWeights.from_dense(W), rtn.quantize_fp8(W), rtn.quantize_w4a16_rtn(W, 32)):
        y = quant_linear(x, w)
        assert y.shape == (2, 3, 24)
        torch.testing.assert_close(y, x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert quant_linear(x[:0], w).shape == (0, 3, 24)


def test_fp8_prefill_copy_of_int4_weights():
    """The fp8 twin of int4 weights: the dequantized int4 values within e4m3's rounding, the
    original channel order kept (act-order weights reordered by a perm), and what quant_linear
    takes above the int4 decode kernels' rows only: weight-only up to the GEMV sizes, above them
    as w8a8 (activations per token in e4m3)."""
    from salaserve.kernels.quant_gemm import GEMV_MAX_M, quant_linear
    from salaserve.kernels.quant_gemm.dispatch import FP8_COPY_ABOVE_ROWS

    g = gen(11)
    W = torch.randn(48, 256, generator=g)
    for w in (rtn.quantize_w4a16_rtn(W, 64), formats.reorder_act_order(_act_order_w4(W, g))):
        w.prefill = formats.fp8_prefill_copy(w)
        ref = w.dequantize()
        got = w.prefill.dequantize()
        assert w.prefill.format == "fp8" and got.shape == ref.shape
        assert ((got - ref).abs() <= ref.abs() / 16 + w.prefill.scale[:, None] * 2**-9).all()
        decode = torch.randn(FP8_COPY_ABOVE_ROWS, 256, generator=g)
        torch.testing.assert_close(quant_linear(decode, w), decode @ ref.t(), rtol=1e-5, atol=1e-5)
        for rows in (FP8_COPY_ABOVE_ROWS + 1, GEMV_MAX_M):  # the copy, weight-only
            mid = torch.randn(rows, 256, generator=g)
            torch.testing.assert_close(quant_linear(mid, w), mid @ got.t(), rtol=1e-5, atol=1e-5)
        large = torch.randn(GEMV_MAX_M + 1, 256, generator=g)
        x8, sx = formats.fp8.quantize_rows_e4m3(large)  # the copy serves prefill sizes as w8a8
        assert torch.equal(quant_linear(large, w), ((x8.float() * sx) @ got.t()).bfloat16().float())
    with pytest.raises(ValueError, match="w4a16"):
        formats.fp8_prefill_copy(rtn.quantize_fp8(W))


def _act_order_w4(W, g):
    """int4 weights of W quantized by GPTQ with act-order (a g_idx that is not the trivial one)."""
    acc = HessianAccumulator(W.shape[1])
    acc.add(torch.randn(64, W.shape[1], generator=g))
    return gptq_quantize(W, acc.hessian, group_size=64, act_order=True)


# ---------------------------------------------------------------- GPTQ


def test_hessian_accumulator_is_batch_invariant():
    g = gen(11)
    X = torch.randn(300, 32, generator=g)
    acc = HessianAccumulator(32)
    for chunk in (X[:7], X[7:100], X[100:].reshape(4, 50, 32)):
        acc.add(chunk)
    assert acc.nsamples == 300
    torch.testing.assert_close(acc.hessian, 2 * X.t() @ X / 300, rtol=1e-5, atol=1e-5)


def _correlated_inputs(K, n, g):
    """LLM-like activations: a few strong latent directions, uneven channel scales, outliers."""
    rank = K // 8
    mix = torch.randn(rank, K, generator=g)
    chan = torch.exp(torch.randn(K, generator=g))  # log-normal channel magnitudes
    chan[torch.randint(0, K, (4,), generator=g)] *= 8  # outlier channels

    def draw(m):
        return (torch.randn(m, rank, generator=g) @ mix + 0.3 * torch.randn(m, K, generator=g)) * chan

    return draw(n), draw(n)


@pytest.mark.parametrize("variant", [
    dict(act_order=False), dict(act_order=True), dict(act_order=True, static_groups=True), dict(sym=False),
])
def test_gptq_beats_rtn(variant):
    g = gen(12)
    N, K, gs = 64, 256, 64
    sym = variant.get("sym", True)
    wins, ratios = 0, []
    for _ in range(5):
        W = torch.randn(N, K, generator=g)
        calib, held_out = _correlated_inputs(K, 2048, g)
        acc = HessianAccumulator(K)
        for chunk in calib.split(512):
            acc.add(chunk)
        wq = gptq_quantize(W, acc.hessian, group_size=gs, **variant)
        wr = rtn.quantize_w4a16_rtn(W, gs, sym=sym)
        ref = held_out @ W.t()
        e_gptq = (held_out @ wq.dequantize().t() - ref).norm()
        e_rtn = (held_out @ wr.dequantize().t() - ref).norm()
        ratios.append(round((e_gptq / e_rtn).item(), 3))
        wins += int(e_gptq < e_rtn)
        if variant.get("act_order") and not variant.get("static_groups"):
            assert not wq.g_idx_trivial
        else:
            assert wq.g_idx_trivial
    assert wins >= 4, f"GPTQ/RTN output error ratios {ratios}"


def test_gptq_dead_inputs_and_codes_valid():
    g = gen(13)
    W = torch.randn(16, 64, generator=g)
    X = torch.randn(256, 64, generator=g)
    X[:, 5] = 0  # a channel that never fires
    acc = HessianAccumulator(64)
    acc.add(X)
    w = gptq_quantize(W, acc.hessian, group_size=32, act_order=True)
    Wd = w.dequantize()
    assert torch.isfinite(Wd).all()
    # the dead channel's weights are pinned to 0 (reachable exactly: the grid always contains 0
    # for symmetric int4 with zero 8)
    assert (Wd[:, 5] == 0).all()


# ---------------------------------------------------------------- Triton kernels (interpreter)


@pytest.mark.parametrize("group", ["w4a16_gemv", "w4a16_gemm", "w4a16_fma", "w4a16_dp2a", "w4a16_wgmma", "w4a16_dense",
                                   "w8a16", "rowquant", "dispatch"])
def test_triton_kernels_match_reference_in_interpreter(group):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "quant_kernel_checks.py"), group],
        # a slow 2-core machine takes minutes for the largest groups; pytest's own limit is 900
        cwd=REPO, env=env, capture_output=True, text=True, timeout=800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all ok" in proc.stdout


def _w4_fma_cases():
    from salaserve.kernels import quant_gemm as qg

    # whole tiles (EVEN) as at the model's shapes; the masked variant for each bucket's first config
    return [(bucket, cfg, even) for bucket, cfgs in qg.W4_FMA_CONFIGS.items() for cfg in cfgs
            for even in ((True, False) if cfg == cfgs[0] else (True,))]


@pytest.mark.parametrize("bucket,cfg,even", _w4_fma_cases())
def test_w4a16_fma_kernel_compiles_for_sm90(bucket, cfg, even):
    """Every decode FMA config compiles for the H200 without register spills and reads qweight in
    16-byte vectors (N, K multiples of 16 as at the model's shapes; also with the masks of ragged ones)."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.w4_fma import _w4_gemv_fma_kernel

    block_n, block_r, warps, prefetch = cfg
    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", perm_ptr="*i32",
                out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
    constexprs = dict(GROUP_SIZE=128, X_PERM=False, X_PAIRS=True, BLOCK_M=bucket, BLOCK_N=block_n, BLOCK_R=block_r,
                      SPLIT_K=4, **qg.w4_fma_layout(block_n, block_r, warps), EVEN=even, PREFETCH=prefetch, PDL=False)
    kernel = compile_sm90_without_spills(_w4_gemv_fma_kernel, ptrs, constexprs, warps, fp_fusion=True,
                                         divisible=("N", "K"))
    assert "ld.global.v4.b32" in kernel.asm["ptx"]


def _w4_dp2a_cases():
    from salaserve.kernels import quant_gemm as qg

    return ([(bucket, cfg, even, False) for bucket, cfgs in qg.W4_DP2A_CONFIGS.items() for cfg in cfgs
             for even in ((True, False) if cfg == cfgs[0] else (True,))]
            + [(bucket, cfg, True, True) for bucket, cfgs in qg.W4_DP2A_ROUNDED_CONFIGS.items() for cfg in cfgs])


@pytest.mark.parametrize("bucket,cfg,even,given", _w4_dp2a_cases())
def test_w4a16_dp2a_kernel_compiles_for_sm90(bucket, cfg, even, given):
    """Every dp2a decode config (bf16 x, or x rounded by its producer: given) compiles for the H200
    without register spills, reads qweight in 16-byte vectors, and its loop does the dot products on
    dp2a (4 per packed word) with no int->float conversion per word: the x conversion of the
    in-loop configs, the scratch of X_PREP. The maxima behind x's scales propagate NaN (the GPU's
    plain max drops it; the interpreter's does not, so the interpreter check cannot see this)."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.w4_dp2a import _w4_gemv_dp2a_kernel

    block_n, block_r, warps, slabs, prefetch, prep = cfg
    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", out_ptr="*bf16",
                ws_ptr="*fp32", cnt_ptr="*i32", xq_ptr="*i32", xs_ptr="*fp32")
    constexprs = dict(GROUP_SIZE=128, BLOCK_M=bucket, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=4,
                      **qg.w4_dp2a_layout(block_n, block_r, warps, slabs), EVEN=even, ASM=True, PREFETCH=prefetch,
                      X_PREP=prep and not given, PREP_TILES=8, X_GIVEN=given, PDL=True, SZ_AHEAD=False, SILU_OUT=False, Y_DT=None)
    kernel = compile_sm90_without_spills(_w4_gemv_dp2a_kernel, ptrs, constexprs, warps, fp_fusion=True,
                                         divisible=("N", "K"))
    ptx = kernel.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "griddepcontrol.wait" in ptx
    assert "max.f32" not in ptx  # x's scales carry a NaN in x to the output (given: its producer's max)
    assert ("max.NaN.f32" in ptx) != given
    # a column's int32 sum becomes a float once per tile: 4 * SLABS dp2a per conversion
    dp2a, cvt = ptx.count("dp2a.lo.s32.u32") + ptx.count("dp2a.hi.s32.u32"), ptx.count("cvt.rn.f32.s32")
    assert dp2a >= 4 * slabs * cvt > 0, (dp2a, cvt)


@pytest.mark.parametrize("bucket,cfg,given", [(b, c, g) for b, c, even, g in _w4_dp2a_cases() if even and b == 1])
def test_w4a16_dp2a_sz_ahead_loads_scales_and_zeros_before_the_wait(bucket, cfg, given):
    """SZ_AHEAD (one-row launches): with PDL, the first tiles' group scales and zero points are loaded
    before griddepcontrol.wait together with the weight tiles (the scales of a thread's 4 columns as
    one 8-byte load, their zero words as 4-byte loads, per column vector and tile in flight), and
    nothing else is; without it only the weight tiles' 16-byte vectors are. No spills either way."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.w4_dp2a import _w4_gemv_dp2a_kernel

    block_n, block_r, warps, slabs, prefetch, prep = cfg
    layout = qg.w4_dp2a_layout(block_n, block_r, warps, slabs)
    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", out_ptr="*bf16",
                ws_ptr="*fp32", cnt_ptr="*i32", xq_ptr="*i32", xs_ptr="*fp32")
    for sz_ahead in (False, True):
        constexprs = dict(GROUP_SIZE=128, BLOCK_M=bucket, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=4, **layout,
                          EVEN=True, ASM=True, PREFETCH=prefetch, X_PREP=prep and not given, PREP_TILES=8,
                          X_GIVEN=given, PDL=True, SZ_AHEAD=sz_ahead, SILU_OUT=False,
                          Y_DT=None)
        ptx = compile_sm90_without_spills(_w4_gemv_dp2a_kernel, ptrs, constexprs, warps, fp_fusion=True,
                                          divisible=("N", "K")).asm["ptx"]
        body = ptx[ptx.index("griddepcontrol.launch_dependents"):]
        wait = body.index("griddepcontrol.wait")
        before = [ln.split("ld.global")[1].split()[0] for ln in body[:wait].splitlines() if "ld.global" in ln]
        tiles = prefetch * layout["VECS"]  # column vectors x tiles in flight
        assert before.count(".v4.b32") == slabs * tiles, before
        if sz_ahead:
            assert before.count(".v2.b32") == tiles and before.count(".b32") >= tiles, before
            assert len(before) == (slabs + 1) * tiles + before.count(".b32"), before
        else:
            assert len(before) == slabs * tiles, before


@pytest.mark.parametrize("bucket,cfg,given", [(b, c, g) for b, c, even, g in _w4_dp2a_cases() if even])
def test_w4a16_dp2a_silu_out_keeps_the_vector_loads(bucket, cfg, given):
    """SILU_OUT (the gate_up GEMV writing silu_mul of its output) compiles for sm_90 without spills and
    loads the weights exactly as the plain kernel does: its tile's gate and up halves are two column
    ranges, and the column map must not cost the 16-byte loads (a select there did: 32 -> 12)."""
    sys.path.insert(0, str(REPO / "tests"))
    import triton.language as tl
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.w4_dp2a import _w4_gemv_dp2a_kernel

    block_n, block_r, warps, slabs, prefetch, prep = cfg
    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", out_ptr="*bf16",
                ws_ptr="*fp32", cnt_ptr="*i32", xq_ptr="*i32", xs_ptr="*fp32")
    loads = []
    for silu in (False, True):
        constexprs = dict(GROUP_SIZE=128, BLOCK_M=bucket, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=4,
                          **qg.w4_dp2a_layout(block_n, block_r, warps, slabs), EVEN=True, ASM=True, PREFETCH=prefetch,
                          X_PREP=prep and not given, PREP_TILES=8, X_GIVEN=given, PDL=True, SZ_AHEAD=bucket == 1,
                          SILU_OUT=silu, Y_DT=tl.bfloat16 if silu else None)
        ptx = compile_sm90_without_spills(_w4_gemv_dp2a_kernel, ptrs, constexprs, warps, fp_fusion=True,
                                          divisible=("N", "K")).asm["ptx"]
        loads.append((ptx.count("ld.global.v4.b32"), ptx.count("ld.global")))
        assert ("ex2.approx" in ptx) == silu  # the silu's exp only in the epilogue
    assert loads[0] == loads[1], loads


@pytest.mark.parametrize("cfg", [c for c in __import__("salaserve.kernels.quant_gemm", fromlist=["x"]).W4_WGMMA_CONFIGS])
def test_w4a16_wgmma_kernel_compiles_for_sm90(cfg):
    """Every config of the wgmma decode GEMV compiles for the H200 without spills, as what makes
    it fast: warpgroup MMAs kept in flight (waits with one pending, not zero, inside the loop),
    the weight operand straight from the unpacking's registers (no bf16 weight tile in shared
    memory, no layout conversion but the no-op ones Triton's dot split adds), x^T and the
    packed words through cp.async, and the lop3 + bf16x2 sub/mul unpacking."""
    import re

    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels.quant_gemm.w4_wgmma import _w4_gemv_wgmma_kernel

    block_n, block_r, warps, stages = cfg
    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", zs_ptr="*i32", out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
    constexprs = dict(GROUP_SIZE=128, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=4, USE_ASM=True, DOT_FP32=False, PDL=True)
    kernel = compile_sm90_without_spills(_w4_gemv_wgmma_kernel, ptrs, constexprs, warps, num_stages=stages,
                                         fp_fusion=True, divisible=("N", "K"))
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    loop = ttgir[ttgir.index("scf.for"):]
    loop = loop[:loop.index("scf.yield")]
    assert "warp_group_dot_wait" in loop and "pendings = 0" not in loop and "pendings = 1" in loop
    bf16_buffers = set(re.findall(r"memdesc<([0-9x]+)xbf16", ttgir))
    # x^T's buffers ([stages x] K x 16, and the halves the dot split reads) only: a bf16 weight tile
    # would be [.., BLOCK_N x K]
    assert bf16_buffers and all(b.endswith("x16") for b in bf16_buffers), bf16_buffers
    for cvt in re.findall(r"ttg.convert_layout .*", loop):
        assert "dot_op<{opIdx = 0" in cvt, cvt  # the no-op splits of the dot's A operand only
    assert ttgir.count("async_copy_global_to_local") >= 3 and " tt.load " not in loop
    assert "mul.rn.bf16x2" in ptx and "sub.rn.bf16x2" in ptx and "griddepcontrol.wait" in ptx


def test_w4_wgmma_repacked_layout():
    """repack_w4_for_wgmma stores [N, K/8] words; in each block of 16 words (128 channels), word
    4 t + c holds channel 32 c + 16 s + 8 e + 2 t + h of the block at bits 4 (2 s + e) + 16 h (a
    lane's A-fragment pairs, its four words adjacent), and the zero/scale words hold bf16 (128 + z)
    and bf16(s) twice; refused for other formats and K not a multiple of 128."""
    from salaserve.kernels import quant_gemm as qg
    from salaserve.quant import formats, rtn

    gen = torch.Generator().manual_seed(5)
    w = rtn.quantize_w4a16_rtn(torch.randn(40, 256, generator=gen), 64, sym=False)
    packed = qg.repack_w4_for_wgmma(w)
    assert packed.qweight.shape == (40, 32) and packed.qweight.is_contiguous()
    q = formats.unpack_int4(w.qweight).long()  # [K, N]
    words = packed.qweight.t().long() & 0xFFFFFFFF  # [K/8, N]
    for block in range(2):
        for t in range(4):
            for c in range(4):
                for s in range(2):
                    for e in range(2):
                        for h in range(2):
                            got = (words[16 * block + 4 * t + c] >> (4 * (2 * s + e) + 16 * h)) & 0xF
                            assert torch.equal(got, q[128 * block + 32 * c + 16 * s + 8 * e + 2 * t + h])
    zs = packed.zs.long() & 0xFFFFFFFF
    assert packed.zs.shape == (4, 2, 40)
    assert torch.equal(zs >> 16, zs & 0xFFFF)  # both halves equal
    z = formats.unpack_zeros(w.qzeros, 40, formats.GPTQ_V2).float()
    as_bf16 = lambda v: (v & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()  # noqa: E731
    assert torch.equal(as_bf16(zs[:, 0]), z + 128)
    assert torch.equal(as_bf16(zs[:, 1]), w.scales.to(torch.bfloat16).float())
    with pytest.raises(ValueError):
        qg.repack_w4_for_wgmma(rtn.quantize_fp8(torch.randn(8, 64)))
    with pytest.raises(ValueError):
        qg.repack_w4_for_wgmma(rtn.quantize_w4a16_rtn(torch.randn(8, 96), 32))


def test_w4_dp2a_candidates_replace_fma_at_one_and_two_rows():
    """The w4 calibration times the dp2a configs at 1-2 rows instead of the FMA kernel's (faster at
    every shape); the FMA configs come back for act-order weights (x gathered through perm) and
    from 3 rows."""
    from salaserve.kernels.quant_gemm import w4_decode
    from salaserve.quant import formats, rtn

    w = rtn.quantize_w4a16_rtn(torch.randn(256, 1024), 128)
    for m in (1, 2):
        kinds = {c[0] for c in w4_decode.w4_candidates(m, w, "cpu")}
        assert kinds == {"dp2a"}, kinds
        assert {c[1] for c in w4_decode.w4_candidates(m, w, "cpu")} == set(w4_decode.W4_DP2A_CONFIGS[m])
    assert {c[0] for c in w4_decode.w4_candidates(4, w, "cpu")} == {"fma"}
    reordered = dataclasses.replace(w, perm=torch.arange(1024))
    assert {c[0] for c in w4_decode.w4_candidates(1, reordered, "cpu")} == {"fma"}


def test_w4_rounded_x_is_offered_where_the_dp2a_kernel_runs(monkeypatch):
    """The rounded-x dp2a kernel (x rounded by its producer) is timed for the weights the dp2a kernel
    takes, not for act-order ones; its picks are read at 1-2 rows only, by shape, and only from what
    the calibration recorded; w4a16_decode_rounded takes the dp2a_rounded kernel's choices only."""
    from salaserve.kernels.quant_gemm import w4_decode
    from salaserve.kernels.tuning import isolated_tables
    from salaserve.quant import rtn

    w = rtn.quantize_w4a16_rtn(torch.randn(256, 1024), 128)
    assert w4_decode.w4_rounded_usable(w)
    assert not w4_decode.w4_rounded_usable(dataclasses.replace(w, perm=torch.arange(1024)))
    with isolated_tables():
        assert w4_decode.w4_rounded_choice(1, w, "cpu") is None
        w4_decode.ROUNDED_PICKS.put("cpu", 2, w4_decode.w4_shape(w), ("dp2a_rounded", (64, 16, 2, 4, 1, False), 4))
        assert w4_decode.w4_rounded_choice(2, w, "cpu") == ("dp2a_rounded", (64, 16, 2, 4, 1, False), 4)
        assert w4_decode.w4_rounded_choice(1, w, "cpu") is None and w4_decode.w4_rounded_choice(3, w, "cpu") is None
    assert all(cfg[1] * 8 == w4_decode.X_TILE for cfgs in w4_decode.W4_DP2A_ROUNDED_CONFIGS.values() for cfg in cfgs)
    assert {c[0] for c in w4_decode.rounded_choices(1, w, "cpu")} == {"dp2a_rounded"}
    calls = []
    monkeypatch.setattr(w4_decode, "w4a16_gemv_dp2a_rounded", lambda *a, **k: calls.append(k["config"]))
    w4_decode.w4a16_decode_rounded(None, None, w, ("dp2a_rounded", w4_decode.W4_DP2A_ROUNDED_CONFIGS[1][0], 2))
    assert calls == [w4_decode.W4_DP2A_ROUNDED_CONFIGS[1][0]]
    with pytest.raises(ValueError):
        w4_decode.w4a16_decode_rounded(None, None, w, ("dp2a", w4_decode.W4_DP2A_CONFIGS[1][0], 2))


def test_int4_mlps_take_silu_mul_in_the_gate_up_epilogue_at_one_row():
    """One-row int4 MLPs whose every gate_up the dp2a GEMV's silu_out takes apply silu_mul in the gate_up
    junction; with one gate_up it cannot take (an act-order perm, F not a multiple of 4), silu_mul stays
    before down, where its kernel writes down's x rounded; bf16 MLPs never keep it there. The silu_out
    route asks the GPU: None for CPU x."""
    from salaserve.kernels import triton_backend as tb
    from salaserve.kernels.quant_gemm import w4_decode
    from salaserve.quant import rtn

    def layer(f=256, perm=False):
        gate_up = rtn.quantize_w4a16_rtn(torch.randn(2 * f, 512), 128)
        if perm:
            gate_up = dataclasses.replace(gate_up, perm=torch.arange(512))
        return {"gate_up": gate_up, "down": rtn.quantize_w4a16_rtn(torch.randn(512, f), 128)}

    int4 = [layer(), layer()]
    assert w4_decode.w4_silu_out_usable(int4[0]["gate_up"])
    assert not tb.TritonBackend.keeps_silu_before_down(int4)
    assert tb.TritonBackend.keeps_silu_before_down([layer(), layer(perm=True)])
    assert not w4_decode.w4_silu_out_usable(rtn.quantize_w4a16_rtn(torch.randn(2 * 130, 512), 128))  # F = 130
    assert not tb.TritonBackend.keeps_silu_before_down([{"gate_up": torch.randn(512, 512), "down": torch.randn(512, 256)}])
    assert tb.TritonBackend._w4_silu_choice(torch.randn(1, 512).to(torch.bfloat16), int4[0]["gate_up"]) is None


def test_w4_gemv_compiles_with_and_without_pdl():
    """The w4 decode GEMV takes part in programmatic dependent launch like gemv/'s: with PDL
    its sm_90 code signals the next launch and waits on the previous grid; without, neither."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.w4_fma import _w4_gemv_fma_kernel

    ptrs = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", perm_ptr="*i32",
                out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
    consts = dict(GROUP_SIZE=128, X_PERM=False, X_PAIRS=True, BLOCK_M=1, BLOCK_N=128, BLOCK_R=16, SPLIT_K=4,
                  **qg.w4_fma_layout(128, 16, 4), EVEN=True, PREFETCH=1)
    for pdl in (False, True):
        ptx = compile_sm90_without_spills(_w4_gemv_fma_kernel, ptrs, dict(consts, PDL=pdl), 4, fp_fusion=True,
                                          divisible=("N", "K")).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl


def test_backend_finds_every_linear_weight_for_calibration():
    """TritonBackend.prepare calibrates the int4 kernels on every linear, the parts of split
    (mixed-format) projections included."""
    from salaserve.quant.fuse import linear_weights
    from salaserve.quant.fuse import SplitLinear

    w = {n: rtn.quantize_w4a16_rtn(torch.randn(16, 128), 128) for n in ("a", "b", "o", "gu", "d")}
    head = torch.randn(8, 128)
    params = {"lm_head": head, "layers": [{"qkvg": SplitLinear([w["a"], w["b"]]), "o_proj": w["o"],
                                           "gate_up": w["gu"], "down": w["d"]}]}
    found = linear_weights(params)
    assert len(found) == 6 and found[0] is head
    assert all(any(f is x for f in found) for x in w.values())


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("K", [4096, 16384, 3 * 16384 // 2])
def test_row_quantizer_compiles_for_sm90_without_spills(K, silu):
    """quantize_rows_fp8 at the model's widths as launched (rows held in registers for the one-pass
    shapes; the two-pass loop above ROWQUANT_ONE_PASS_MAX), plain and with silu_mul fused in: no
    spills on sm_90, and one division per row, not per element."""
    sys.path.insert(0, str(REPO / "tests"))
    from kernel_checks import compile_sm90_without_spills
    import triton.language as tl
    from salaserve.kernels import quant_gemm as qg
    from salaserve.kernels.quant_gemm.rowquant import _quantize_rows_fp8_kernel

    consts = dict(qg.rowquant_constexprs(K), FP8_MAX_C=448.0, SILU=silu, DT=tl.bfloat16, INTERPRET=False)
    kernel = compile_sm90_without_spills(_quantize_rows_fp8_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv",
                                         s_ptr="*fp32"), consts, qg.rowquant_warps(K, silu), divisible=("K",))
    assert kernel.asm["ptx"].count("div.rn.f32") <= consts["ROWS"]
