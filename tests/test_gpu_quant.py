"""Quantized linear kernels on the GPU at the model's real shapes (pytest -m gpu; skipped without CUDA).

Each kernel against the dequantize-then-matmul reference (fp32, quant.matmul.linear_ref) on fresh
random inputs, bf16 activations. Tolerance: relative Frobenius error 4e-3. The reference is
rounded once to bf16 (2^-9 relative per element, ~2e-3 over a whole output), and the kernels add
fp32 summation-order differences (~1e-6). The dense prefill path rounds W to bf16 once as well
(2^-9 per weight, averaging down over K).
"""

from __future__ import annotations

import pytest
import torch

from salaserve.kernels.tuning import m_bucket
from salaserve.quant import rtn
from salaserve.quant.matmul import linear_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {"qkvg": (8704, 4096), "o_proj": (4096, 4096), "gate_up": (32768, 4096), "down": (4096, 16384)}
TOL = 4e-3


def _rel(y, ref):
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def _weights(fmt, N, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
    return rtn.quantize_fp8(w) if fmt == "fp8" else rtn.quantize_w4a16_rtn(w, 128)


@pytest.mark.sweep
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("M", [1, 2])
def test_w4a16_dp2a_every_config(name, M):
    """The dp2a decode GEMV (x rounded to int16 per thread and tile, or once per CTA with X_PREP),
    every config with the heuristic split, none, and the most the calibration offers, against
    dequantize-then-matmul, on two x in turn (the X_PREP scratch rewritten), the second with one
    channel 1000x the rest (the others then keep 2^-16 of it as their rounding step); then every
    config of the kernel on x rounded beforehand (round_x_int16, as x's producers write it)."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.quant_gemm.w4_decode import _w4_splits

    N, K = SHAPES[name]
    w = _weights("w4a16", N, K, M)
    plain = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    outlier = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    outlier[:, 7] *= 1000.0
    for x in (plain, outlier):
        ref = linear_ref(x, w)
        for cfg in Q.W4_DP2A_CONFIGS[M]:
            for split in (None, 1, max(_w4_splits(N, K, cfg[0], cfg[1], x.device))):
                assert _rel(Q.w4a16_gemv_dp2a(x, w, config=cfg, split_k=split), ref) < TOL, (cfg, split)
        xq, xs = Q.round_x_int16(x)  # as x's producer writes it (add + RMSNorm, silu_mul)
        for cfg in Q.W4_DP2A_ROUNDED_CONFIGS[M]:
            for split in (None, 1, max(_w4_splits(N, K, cfg[0], cfg[1], x.device))):
                assert _rel(Q.w4a16_gemv_dp2a_rounded(xq, xs, w, config=cfg, split_k=split), ref) < TOL, (cfg, split)


def _dp2a_calls(x, w):
    """((rounded, config, split), call) for every dp2a config at x's row count, on bf16 x and on x rounded
    beforehand (round_x_int16, as x's producers write it), at the heuristic split, none and the
    calibration's largest; call(**options) runs that GEMV with extra options (sz_ahead, silu_out)."""
    import functools

    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.quant_gemm.w4_decode import _w4_splits

    M, K = x.shape
    N = w.out_features
    xq, xs = Q.round_x_int16(x)
    for rounded, configs in ((False, Q.W4_DP2A_CONFIGS[M]), (True, Q.W4_DP2A_ROUNDED_CONFIGS[M])):
        for cfg in configs:
            for split in (None, 1, max(_w4_splits(N, K, cfg[0], cfg[1], x.device))):
                gemv = (functools.partial(Q.w4a16_gemv_dp2a_rounded, xq, xs) if rounded
                        else functools.partial(Q.w4a16_gemv_dp2a, x))
                yield (rounded, cfg, split), functools.partial(gemv, w, config=cfg, split_k=split)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_w4a16_dp2a_sz_ahead_changes_no_bit(name):
    """SZ_AHEAD (the group scales and zero points loaded with their weight tile, the first before the
    PDL wait) at one row: every config on bf16 x and on rounded x, at the heuristic split, none and
    the calibration's largest, equals the default loop bit for bit (and so dequantize-then-matmul
    within TOL), on two calls in turn."""
    N, K = SHAPES[name]
    w = _weights("w4a16", N, K, 7)
    for x in (torch.randn(1, K, device="cuda").to(torch.bfloat16) for _ in range(2)):
        ref = linear_ref(x, w)
        for case, gemv in _dp2a_calls(x, w):
            y0, y1 = gemv(sz_ahead=False), gemv(sz_ahead=True)
            assert torch.equal(y0, y1), case
            assert _rel(y1, ref) < TOL, case


@pytest.mark.parametrize("M", [1, 2])
def test_w4a16_dp2a_silu_out_equals_the_gemv_then_silu_mul(M):
    """silu_out (the int4 gate_up GEMV writing silu_mul of its output) at the model's gate_up shape: every
    dp2a config, on bf16 x and on rounded x, at the heuristic split, none and the calibration's largest,
    equals the GEMV followed by the silu_mul kernel bit for bit (the same bf16 output rounded the same
    way, fused.silu_mul's roundings), and silu_mul of dequantize-then-matmul within TOL."""
    from salaserve.kernels.fused import silu_mul

    N, K = SHAPES["gate_up"]
    w = _weights("w4a16", N, K, 11 + M)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    g, u = linear_ref(x, w).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    for case, gemv in _dp2a_calls(x, w):
        fused = gemv(silu_out=True)
        assert fused.shape == (M, N // 2)
        assert torch.equal(fused, silu_mul(gemv())), case
        assert _rel(fused, ref) < TOL, case


@pytest.mark.parametrize("fmt", ["fp8", "w4a16"])
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
def test_decode_kernels(fmt, name, M):
    """quant_linear as the engine calls it at decode sizes, and the alternatives it chose between:
    every w4a16 FMA config (M <= 4) and wgmma config, w8a16."""
    from salaserve.kernels import quant_gemm as Q

    N, K = SHAPES[name]
    w = _weights(fmt, N, K, M)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = linear_ref(x, w)
    if fmt == "w4a16":
        assert _rel(Q.quant_linear(x, w), ref) < TOL
    if fmt == "w4a16" and M <= Q.W4_FMA_MAX_M:
        for cfg in Q.W4_FMA_CONFIGS[1 << (M - 1).bit_length()]:
            assert _rel(Q.w4a16_gemv_fma(x, w, config=cfg), ref) < TOL, cfg
    if fmt == "w4a16":  # the wgmma kernel on the repacked copy: every config, the heuristic split and none
        packed = Q.repack_w4_for_wgmma(w)
        for cfg in Q.W4_WGMMA_CONFIGS:
            for split in (None, 1):
                assert _rel(Q.w4a16_gemv_wgmma(x, w, packed, config=cfg, split_k=split), ref) < TOL, (cfg, split)
    if fmt == "fp8":
        assert _rel(Q.quant_linear(x, w), ref) < TOL
        assert _rel(Q.w8a16_gemv(x, w.weight, w.scale), ref) < TOL


@pytest.mark.parametrize("fmt", ["fp8", "w4a16"])
def test_prefill_paths(fmt):
    from salaserve.kernels import quant_gemm as Q

    N, K = SHAPES["qkvg"]
    w = _weights(fmt, N, K, 3)
    x = torch.randn(1000, K, device="cuda").to(torch.bfloat16)
    ref = linear_ref(x, w)
    # fp8 w8a8 also quantizes the activations per token (e4m3: 2^-4 relative per element)
    assert _rel(Q.quant_linear(x, w), ref) < (3e-2 if fmt == "fp8" else TOL)


@pytest.mark.parametrize("K", [4096, 16384, 24576])
def test_row_quantizer_equals_torch(K):
    """quantize_rows_fp8 bit for bit against its torch twin at the model's widths (and a two-pass
    one), plain and with silu_mul fused in (against fused.silu_mul, then the twin)."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.fused import silu_mul

    x = (torch.randn(300, K, device="cuda") * torch.rand(300, 1, device="cuda") * 10).to(torch.bfloat16)
    x[7] = 0  # an all-zero row takes the 1e-12 floor
    for got, want in ((Q.quantize_rows_fp8(x), Q.fp8_quantize_rows_ref(x)),
                      (Q.quantize_rows_fp8(torch.cat([x, x.flip(0)], 1), silu=True),
                       Q.fp8_quantize_rows_ref(silu_mul(torch.cat([x, x.flip(0)], 1))))):
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def test_fp8_prefill_qkv_and_gate_up_quantize_inside_the_norm():
    """TritonBackend.add_rms_norm_linear at a prefill size with fp8 weights (the add + RMSNorm
    kernel writes fp8 codes and scales) equals add_rms_norm, then quant_linear, bit for bit; at
    decode sizes it is that very path."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.fused import add_rms_norm
    from salaserve.kernels.triton_backend import TritonBackend

    N, K = SHAPES["gate_up"]
    w = _weights("fp8", N, K, 6)
    norm_w = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    ops = TritonBackend()
    for M in (3, 300):
        h = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        u = (torch.randn(M, K, device="cuda") * 3).to(torch.bfloat16)
        h_ref, normed = add_rms_norm(h, u, 0.25, norm_w, 1e-6)
        h_got, y = ops.add_rms_norm_linear(h, u, 0.25, norm_w, 1e-6, w)
        assert torch.equal(h_got, h_ref)
        assert torch.equal(y, Q.quant_linear(normed, w))


def test_fp8_prefill_down_quantizes_inside_silu_mul():
    """TritonBackend.silu_mul_linear at a prefill size with fp8 weights (silu_mul fused into the
    activation quantization) equals silu_mul, then quant_linear, bit for bit; at decode sizes it is
    that very path."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.fused import silu_mul
    from salaserve.kernels.triton_backend import TritonBackend

    N, K = SHAPES["down"]
    w = _weights("fp8", N, K, 5)
    ops = TritonBackend()
    for M in (3, 300):
        gate_up = (torch.randn(M, 2 * K, device="cuda") * 2).to(torch.bfloat16)
        assert Q.fp8_scaled_mm_takes(M, w) == (M > Q.GEMV_MAX_M)
        assert torch.equal(ops.silu_mul_linear(gate_up, w), Q.quant_linear(silu_mul(gate_up), w))


def test_w4a16_calibration_picks_a_valid_config():
    """calibrate_w4 times the FMA and wgmma kernels' configs and splits at the real shape (the
    wgmma kernel's on the copy TritonBackend.prepare_weights attaches); quant_linear then runs the
    recorded choice and still equals the reference."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.triton_backend import TritonBackend

    N, K = SHAPES["qkvg"]
    w = _weights("w4a16", N, K, 11)
    TritonBackend().prepare_weights({"lm_head": None, "layers": [{"qkvg": w, "o_proj": None, "gate_up": None,
                                                                  "down": None}]}, "cuda")
    assert w.wgmma is not None
    assert any(c[0] == "wgmma" for c in Q.w4_candidates(16, w, "cuda"))
    res = Q.calibrate_w4([w], "cuda", m_values=(1, 2, 16))
    assert set(res) == {(1, N, K, w.group_size), (2, N, K, w.group_size), (16, N, K, w.group_size)}
    for m in (1, 2, 16):
        kernel, cfg, split = res[(m, N, K, w.group_size)]
        assert (kernel, cfg, split) in Q.w4_candidates(m, w, "cuda")
        x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
        assert Q.w4_decode_choice(x, w) == (kernel, cfg, split)
        assert _rel(Q.quant_linear(x, w), linear_ref(x, w)) < TOL


def test_precompile_leaves_nothing_to_compile():
    """compile_ahead.precompile compiles every candidate of an (M, shape) in threads without running
    them: afterwards the real launches find each kernel in its JIT cache (the cache does not grow)
    and still equal the reference. Shapes unseen elsewhere in the tests (N = 1536, K = 2048, two
    splits per config), so the compiles are new to this process."""
    from salaserve.kernels import compile_ahead as ca
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.quant_gemm.w4_dp2a import _w4_gemv_dp2a_kernel

    if not ca.precompile_available():
        pytest.skip("this Triton has no AsyncCompileMode")
    N, K = 1536, 2048
    w = _weights("w4a16", N, K, 12)
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    cands = [("dp2a", cfg, split) for cfg in Q.W4_DP2A_CONFIGS[1] for split in (3, 5)]
    cache = _w4_gemv_dp2a_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    assert ca.precompile(lambda c=c: Q.w4a16_decode(x, w, c) for c in cands) == len(cands)
    compiled = len(cache)
    assert compiled > before
    ref = linear_ref(x, w)
    for c in cands:
        assert _rel(Q.w4a16_decode(x, w, c), ref) < TOL, c
    assert len(cache) == compiled


@pytest.mark.sweep
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("M", [1, 2, 8])
def test_fp8_fma_gemv_every_config(name, M):
    """gemv.gemv_fp8 with every FP8_FMA_CONFIGS config of the M bucket against the
    dequantize-then-matmul reference at the real shapes."""
    from salaserve.kernels import gemv as G

    N, K = SHAPES[name]
    w = _weights("fp8", N, K, 20 + M)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ref = linear_ref(x, w)
    for cfg in G.FP8_FMA_CONFIGS[m_bucket(M)]:
        assert _rel(G.gemv_fp8(x, w.weight, w.scale, cfg), ref) < TOL, cfg


def _fp8_configs_at_real_shapes(M, configs, seed):
    """Each config at every real shape, with its own split and with none: against
    dequantize-then-matmul, and its silu_mul epilogue on gate_up against silu_mul of its own output."""
    import dataclasses

    from salaserve.kernels import gemv as G
    from salaserve.kernels.fused import silu_mul

    x_all = torch.randn(M, 16384, device="cuda").to(torch.bfloat16)
    for name, (N, K) in sorted(SHAPES.items()):
        w = _weights("fp8", N, K, seed)
        x = x_all[:, :K].contiguous()
        ref = linear_ref(x, w)
        for cfg in configs:
            for c in (cfg, dataclasses.replace(cfg, split_k=1)):
                assert _rel(G.gemv_fp8(x, w.weight, w.scale, c), ref) < TOL, (name, c)
                if name == "gate_up":
                    act = G.gemv_fp8(x, w.weight, w.scale, c, silu_out=True)
                    assert _rel(act, silu_mul(G.gemv_fp8(x, w.weight, w.scale, c))) < 1e-2, (name, c)


@pytest.mark.sweep
@pytest.mark.parametrize("M", [1, 2, 5])
def test_fp8_stream_gemv_every_config(M):
    """The cp.async-pipelined fp8 GEMV (FP8_STREAM_CONFIGS of the M bucket, their explicit splits;
    M = 5, which has none, with the 2-row ones)."""
    from salaserve.kernels import gemv as G

    _fp8_configs_at_real_shapes(M, G.FP8_STREAM_CONFIGS[min(m_bucket(M), 2)], 60 + M)


def test_fp8_gemv_calibration_records_a_choice():
    """calibrate_fp8_gemv times w8a16 and the fp8 FMA configs; quant_linear then follows the table
    and still equals the reference."""
    import dataclasses

    from salaserve.kernels import gemv as G
    from salaserve.kernels import quant_gemm as Q

    N, K = SHAPES["o_proj"]
    w = _weights("fp8", N, K, 13)
    res = Q.calibrate_fp8_gemv([w], "cuda", m_values=(1, 8))
    assert set(res) == {(1, N, K), (8, N, K)}
    for m in (1, 8):
        cfg = res[(m, N, K)]
        # a candidate: itself (an explicit split) or with its automatic split set
        cands = Q.fp8_candidates(m, w)
        assert cfg is None or cfg in cands or dataclasses.replace(cfg, split_k=0) in cands
    for m in (1, 8):
        x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
        assert _rel(Q.quant_linear(x, w), linear_ref(x, w)) < TOL
    assert Q.fp8_gemv_choice(1, w, "cuda") is res[(1, N, K)]


def test_fp8_gemv_calibration_times_the_silu_junction():
    """A [gate | up] shape given as a silu shape is timed at one row as the junction runs it; the
    choice recorded, whichever kernel won, computes silu_mul of the linear through the backend."""
    from salaserve.kernels import quant_gemm as Q
    from salaserve.kernels.torch_ops import TorchBackend
    from salaserve.kernels.triton_backend import TritonBackend

    N, K = 2 * 3072, 4096  # a shape no other test calibrates (the table keeps one choice per shape)
    w = _weights("fp8", N, K, 14)
    res = Q.calibrate_fp8_gemv([w], "cuda", m_values=(1,), silu_shapes={(N, K)})
    assert (1, N, K) in res
    g = torch.Generator(device="cuda").manual_seed(3)
    h = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
    o = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
    w_o = (torch.randn(K, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    nw = torch.ones(K, device="cuda", dtype=torch.bfloat16)
    _, act = TritonBackend().residual_norm_linear(h, o, w_o, 0.5, nw, 1e-6, w, silu_out=True)
    _, ref = TorchBackend().residual_norm_linear(h, o, w_o, 0.5, nw, 1e-6, w, silu_out=True)
    assert act.shape == (1, N // 2) and _rel(act, ref) < 2e-2
