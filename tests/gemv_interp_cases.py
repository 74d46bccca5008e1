"""salaserve.kernels.gemv under the Triton interpreter, on CPU.

TRITON_INTERPRET must be set before triton is first imported: tests/test_kernels_gemv.py runs this
file in a subprocess with TRITON_INTERPRET=1 (the file name keeps it out of normal collection).
By hand:

    TRITON_INTERPRET=1 python -m pytest tests/gemv_interp_cases.py

fp32 cases against fp64 torch at ~1e-5 over small shapes and every path (FMA at M = 1, FMA over
several rows, tensor-core dot at M <= 16 and at M = 17..128 with BLOCK_M = the M bucket), with
split-K 1..4 (including splits that come out empty). bf16
cases check the roundings of the fused prologues and epilogue exactly: the kernels round on the
bits (round_to), so the interpreter's truncating fp32->bf16 cast never decides a result.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_kernels_gemv.py)", allow_module_level=True)

from kernel_checks import assert_within_ulps  # noqa: E402

from salaserve.kernels import gemv as G  # noqa: E402
from salaserve.kernels.gemv import launch as GL  # noqa: E402
from salaserve.kernels.torch_ops import TorchBackend  # noqa: E402
from salaserve.model import reference as spec  # noqa: E402

EPS = 1e-6
TB = TorchBackend()
bf16 = torch.bfloat16

# small tiles so that the small test shapes take several K tiles and several N tiles; split-K
# 1, 2, 4 on every path (K = 64 with split 4 leaves splits empty)
FMA_M1 = [G.GemvConfig(16, 64, 1), G.GemvConfig(8, 128, 1, split_k=2), G.GemvConfig(32, 32, 1, split_k=4)]
FMA_MN = [G.GemvConfig(8, 64, 1), G.GemvConfig(16, 32, 1, split_k=2), G.GemvConfig(4, 128, 1, split_k=4)]
DOT = [G.GemvConfig(32, 64, 4, dot=True), G.GemvConfig(16, 32, 4, dot=True, split_k=2),
       G.GemvConfig(64, 16, 4, dot=True, split_k=4)]


# the large-M dot path (BLOCK_M = M's bucket, 32..128) with explicit splits 1, 2, 4, as its
# calibration candidates have; small tiles so that the test shapes take several N and K tiles
DOT_WIDE = [G.GemvConfig(32, 64, 4, dot=True, split_k=1), G.GemvConfig(64, 32, 4, dot=True, split_k=2),
            G.GemvConfig(32, 32, 4, dot=True, split_k=4)]


def _configs(M):
    return (FMA_M1 if M == 1 else FMA_MN) + DOT


def _some_configs(M):
    """One split and one unsplit config per path (the fused-op tests)."""
    fma = FMA_M1 if M == 1 else FMA_MN
    return [fma[0], fma[1], DOT[0], DOT[1]]


def _data(M, N, K, dtype, seed=0, x_cols=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, x_cols or K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    return x, w


def _close(ours, ref, tol=2e-5):
    err = float((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
    assert err < tol, err


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K", [(64, 64), (96, 128), (256, 512), (64, 96)])
def test_gemv_fp32(M, N, K):
    x, w = _data(M, N, K, torch.float32, seed=M * 1000 + N + K)
    ref = x.double() @ w.double().t()
    for cfg in _configs(M):
        y = G.gemv(x, w, config=cfg)
        assert y.shape == (M, N) and y.dtype == torch.float32
        _close(y, ref)


def test_gemv_strided_x_and_out():
    """x rows strided (a view into a wider tensor); out a strided view."""
    M, N, K = 3, 64, 128
    big = torch.randn(M, 2 * K)
    x = big[:, K:]
    w = torch.randn(N, K) * K ** -0.5
    out_big = torch.zeros(M, N + 8)
    out = out_big[:, 8:]
    for cfg in FMA_MN[:1] + DOT[:1]:
        G.gemv(x, w, out=out, config=cfg)
        _close(out, x.double() @ w.double().t())
    assert torch.equal(out_big[:, :8], torch.zeros(M, 8))


def test_split_k_counters_rearmed():
    """Every split-K launch leaves its counters at zero (no memset between launches) and results
    are deterministic."""
    x, w = _data(2, 96, 512, torch.float32, seed=5)
    cfg = G.GemvConfig(16, 32, 1, split_k=4)
    a = G.gemv(x, w, config=cfg)
    b = G.gemv(x, w, config=cfg)
    assert torch.equal(a, b)
    _, cnt = GL._workspace(x.device, 0, 0)
    assert int(cnt.abs().sum()) == 0


def test_auto_split():
    dev = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert G.auto_split(4096, 4096, G.GemvConfig(64, 128, dot=True), dev) == 8
    assert G.auto_split(4096, 16384, G.GemvConfig(64, 128, dot=True), dev) == 16
    assert G.auto_split(32768, 4096, G.GemvConfig(4, 1024), dev) == 1
    assert G.auto_split(4096, 4096, G.GemvConfig(4, 1024), dev) == 1
    assert G.auto_split(4096, 4096, G.GemvConfig(64, 1024, dot=True), dev) == 4  # whole K tiles
    assert G.auto_split(8704, 4096, G.GemvConfig(64, 128, dot=True), dev) == 4


@pytest.mark.parametrize("M", [1, 4])
def test_gemv_bf16_rounding(M):
    """bf16 output = fp32 sum rounded to nearest even: at most one ulp from the fp64 result."""
    x, w = _data(M, 64, 256, bf16, seed=11)
    ref = (x.double() @ w.double().t()).to(bf16)
    for cfg in _configs(M):
        assert_within_ulps(G.gemv(x, w, config=cfg), ref, max_ulps=1, max_frac=0.05)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("res_dtype", [bf16, torch.float32])
def test_residual_epilogue_exact(M, res_dtype):
    """gemv_residual == residual + gemv(x, w) * scale with torch's two roundings, bit for bit."""
    N, K = 96, 128
    x, w = _data(M, N, K, bf16, seed=M)
    r = torch.randn(M, N, generator=torch.Generator().manual_seed(7)).to(res_dtype)
    scale = 1.4 / 32 ** 0.5
    for cfg in _configs(M):
        y = G.gemv(x, w, config=cfg)
        ours = G.gemv_residual(x, w, r, scale, config=cfg)
        assert ours.dtype == torch.promote_types(res_dtype, bf16)
        assert torch.equal(ours, r + y * scale), cfg
        r2 = r.clone()  # in place: out is the residual itself
        G.gemv_residual(x, w, r2, scale, out=r2, config=cfg)
        assert torch.equal(r2, ours)


def _identity(n, dtype):
    return torch.eye(n).to(dtype)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_rmsnorm_prologue_roundings(M):
    """With W = I the GEMV returns its normalised input exactly: it must equal
    reference.rms_norm (fp32 statistics in another summation order: at most one bf16 ulp on a
    few elements)."""
    K = 128
    g = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=g) * 3).to(bf16)
    nw = (1.0 + 0.3 * torch.randn(K, generator=g)).to(bf16)
    ref = spec.rms_norm(x, nw, EPS)
    for cfg in _some_configs(M):
        assert_within_ulps(G.gemv_rmsnorm(x, nw, EPS, _identity(K, bf16), config=cfg), ref, max_ulps=1,
                           max_frac=0.02)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_rmsnorm_prologue_fp32(M):
    N, K = 96, 512
    g = torch.Generator().manual_seed(M + 1)
    x = torch.randn(M, K, generator=g) * 2
    nw = 1.0 + 0.3 * torch.randn(K, generator=g)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    ref = spec.rms_norm(x.double(), nw.double(), EPS) @ w.double().t()
    for cfg in _some_configs(M):
        _close(G.gemv_rmsnorm(x, nw, EPS, w, config=cfg), ref)


@pytest.mark.parametrize("M", [1, 3, 8])
def test_silu_mul_prologue_roundings(M):
    """W = I returns silu_mul(gate_up) itself: equal to TorchBackend.silu_mul up to exp's last
    fp32 bit (one bf16 ulp on a few elements); with the residual epilogue, bit-exact against
    residual + y * scale."""
    K = 128
    g = torch.Generator().manual_seed(M + 2)
    gu = (torch.randn(M, 2 * K, generator=g) * 2).to(bf16)
    ref = TB.silu_mul(gu)
    r = torch.randn(M, K, generator=g).to(bf16)
    for cfg in _some_configs(M):
        y = G.gemv_silu_mul(gu, _identity(K, bf16), config=cfg)
        assert_within_ulps(y, ref, max_ulps=1, max_frac=0.02)
        ours = G.gemv_silu_mul(gu, _identity(K, bf16), residual=r, scale=0.25, config=cfg)
        assert torch.equal(ours, r + y * 0.25)


@pytest.mark.parametrize("M", [1, 8])
def test_silu_mul_prologue_fp32(M):
    N, K = 64, 256
    g = torch.Generator().manual_seed(M + 3)
    gu = torch.randn(M, 2 * K, generator=g)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    ref = TB.silu_mul(gu.double()) @ w.double().t()
    for cfg in _some_configs(M):
        _close(G.gemv_silu_mul(gu, w, config=cfg), ref)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("F", [48, 40])
def test_silu_out_epilogue_roundings(M, F):
    """gemv_silu_out == TorchBackend.silu_mul(gemv(x, w)) (the same config's linear output, then
    silu_mul's roundings), up to exp's last fp32 bit (one bf16 ulp on a few elements), on every
    path and split; F = 40 leaves a partial last tile."""
    K = 128
    x, w = _data(M, 2 * F, K, bf16, seed=80 + M + F)
    w = w * 4  # gates over a wider range than +-1 (silu's curve, not its linear part)
    for cfg in _configs(M) if M <= 8 else DOT:
        act = G.gemv_silu_out(x, w, config=cfg)
        assert act.shape == (M, F) and act.dtype == bf16
        assert_within_ulps(act, TB.silu_mul(G.gemv(x, w, config=cfg)), max_ulps=1, max_frac=0.02)


@pytest.mark.parametrize("M", [1, 4])
def test_silu_out_epilogue_fp32(M):
    F, K = 40, 256
    x, w = _data(M, 2 * F, K, torch.float32, seed=90 + M)
    ref = TB.silu_mul(x.double() @ w.double().t())
    for cfg in _configs(M):
        _close(G.gemv_silu_out(x, w, config=cfg), ref)
    with pytest.raises(ValueError, match="even"):
        G.gemv_silu_out(x, w[:-1])


def test_linear_dispatch():
    G.clear_calibration()
    x, w = _data(4, 64, 128, torch.float32, seed=3)
    ref = x.double() @ w.double().t()
    assert G.uses_gemv(4, 64, 128, x.device)
    _close(G.linear(x, w), ref)
    _close(G.linear(x.view(2, 2, 128), w).view(4, 64), ref)
    x20 = torch.randn(20, 128)
    assert not G.uses_gemv(20, 64, 128, x.device)
    assert torch.equal(G.linear(x20, w), x20 @ w.t())
    # a calibrated cuBLAS win is honoured
    cfg = G.GemvConfig(8, 64, 1)
    G.PICKS.put(x.device, 4, (64, 128), G.Choice(cfg, 2.0, 1.0))
    assert not G.uses_gemv(3, 64, 128, x.device)
    assert G.choose_config(3, 64, 128, x.device) == cfg  # the fused ops keep the measured config
    assert torch.equal(G.linear(x, w), x @ w.t())
    G.clear_calibration()


def test_bad_arguments():
    x, w = _data(G.DOT_MAX_M + 1, 64, 128, torch.float32)
    with pytest.raises(ValueError):
        G.gemv(x, w)
    with pytest.raises(ValueError):
        G.gemv(x[:2, :64], w)
    with pytest.raises(TypeError):
        G.gemv(x[:2].to(bf16), w)
    with pytest.raises(ValueError):  # FMA paths stop at M = 8
        G.gemv(x[:9], w, config=G.GemvConfig(4, 64, 1))
    with pytest.raises(ValueError, match="prologues"):  # the fused prologues stop at M = 16
        G.gemv_rmsnorm(x[:32], torch.ones(128), EPS, w, config=DOT[0])
    with pytest.raises(ValueError, match="prologues"):
        G.gemv_silu_mul(torch.randn(17, 256), w, config=DOT[0])


# ---- large M (17..128): the tensor-core path with BLOCK_M = the M bucket


@pytest.mark.parametrize("M", [20, 64, 128])
@pytest.mark.parametrize("N,K", [(96, 384), (64, 200)])
def test_gemv_dot_large_m_fp32(M, N, K):
    """fp32 against fp64 (K = 200: the last K tile and split ragged), splits 1, 2, 4; every split
    launch leaves its counters re-armed."""
    x, w = _data(M, N, K, torch.float32, seed=7000 + M * 10 + K)
    ref = x.double() @ w.double().t()
    for cfg in DOT_WIDE:
        y = G.gemv(x, w, config=cfg)
        assert y.shape == (M, N) and y.dtype == torch.float32
        _close(y, ref)
    ws, cnt = GL._workspace(x.device, 0, 0)
    assert ws.numel() >= 4 * M * N and int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("M", [20, 64, 128])
def test_gemv_dot_large_m_bf16(M):
    """bf16: fp32 sums rounded once, at most one ulp from the fp64 result; the residual epilogue
    bit-exact against torch's expression on the same GEMV output."""
    N, K = 96, 384
    x, w = _data(M, N, K, bf16, seed=8000 + M)
    ref = (x.double() @ w.double().t()).to(bf16)
    r = torch.randn(M, N, generator=torch.Generator().manual_seed(M + 9)).to(bf16)
    for cfg in DOT_WIDE:
        y = G.gemv(x, w, config=cfg)
        assert_within_ulps(y, ref, max_ulps=1, max_frac=0.05)
        assert torch.equal(G.gemv_residual(x, w, r, 0.25, config=cfg), r + y * 0.25), cfg


def test_large_m_dispatch():
    """Above M = 16: `linear` (and TritonBackend.linear) take the GEMV only where calibration
    measured it faster; the fused prologue GEMVs are never chosen there."""
    from salaserve.kernels.triton_backend import TritonBackend

    G.clear_calibration()
    dev = torch.device("cpu")
    N, K = 96, 128
    x, w = _data(128, N, K, bf16, seed=21)
    nw = (1 + 0.2 * torch.randn(K, generator=torch.Generator().manual_seed(22))).to(bf16)
    assert not G.uses_gemv(64, N, K, dev) and not G.uses_gemv(128, N, K, dev)  # uncalibrated: cuBLAS
    assert not TritonBackend._gemv_fuses(x, w)
    cfg = DOT_WIDE[2]
    G.PICKS.put(dev, 128, (N, K), G.Choice(cfg, 1.0, 2.0))  # the GEMV won at bucket 128
    G.PICKS.put(dev, 8, (N, K), G.Choice(DOT[0], 1.0, 2.0))
    try:
        assert G.uses_gemv(128, N, K, dev) and G.uses_gemv(65, N, K, dev)
        assert not G.uses_gemv(64, N, K, dev) and not G.uses_gemv(G.DOT_MAX_M + 1, N, K, dev)
        assert G.choose_config(100, N, K, dev) == cfg
        assert TritonBackend._gemv_fuses(x[:8], w)  # the same weight fuses at 8 rows...
        assert not TritonBackend._gemv_fuses(x, w)  # ...but not at 128
        assert not TritonBackend._gemv_fuses(x[:17], w)
        tb = TritonBackend()
        launches = []
        launch = GL._launch
        GL._launch = lambda *a, **kw: (launches.append((a[0].shape[0], kw.get("prologue", 0))), launch(*a, **kw))[1]
        try:
            y = tb.linear(x, w)
            y_norm = tb.norm_linear(x, nw, EPS, w)
            y_64 = tb.linear(x[:64], w)
        finally:
            GL._launch = launch
        # the plain GEMV at 128 rows (twice: the norm ran separately), cuBLAS at 64 (cuBLAS won)
        assert launches == [(128, 0), (128, 0)]
        assert torch.equal(y, G.gemv(x, w, config=cfg))
        assert_within_ulps(y, (x.double() @ w.double().t()).to(bf16), max_ulps=1, max_frac=0.05)
        assert torch.equal(y_norm, G.gemv(TB.rms_norm(x, nw, EPS), w, config=cfg))
        assert torch.equal(y_64, x[:64] @ w.t())
    finally:
        G.clear_calibration()


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("last", [False, True])
def test_backend_junction_ops_match_torch(silu, last):
    """TritonBackend's fused layer junctions (residual epilogue, silu_mul and RMSNorm prologues on
    the GEMVs) against TorchBackend's composition of the separate ops, bf16, decode-sized M."""
    from salaserve.kernels.triton_backend import TritonBackend

    gen = torch.Generator().manual_seed(int(silu) * 2 + int(last))
    M, K, N, N2 = 3, 64, 96, 48
    h = torch.randn(M, N, generator=gen).to(bf16)
    x = torch.randn(M, 2 * K if silu else K, generator=gen).to(bf16)
    w_out = (0.1 * torch.randn(N, K, generator=gen)).to(bf16)
    nw = (1 + 0.2 * torch.randn(N, generator=gen)).to(bf16)
    w_in = (0.1 * torch.randn(N2, N, generator=gen)).to(bf16)
    norm, nxt = (None, None) if last else (nw, w_in)
    tb = TritonBackend()
    launches = []
    launch = GL._launch
    GL._launch = lambda *a, **kw: (launches.append(kw.get("prologue")), launch(*a, **kw))[1]
    try:
        h_ours, y_ours = tb.residual_norm_linear(h, x, w_out, 0.7, norm, EPS, nxt, silu=silu)
    finally:
        GL._launch = launch
    assert len(launches) == (1 if last else 2)  # the fused GEMVs ran, not the fallback
    h_ref, y_ref = TB.residual_norm_linear(h, x, w_out, 0.7, norm, EPS, nxt, silu=silu)
    # the GEMV sums in another order than torch's matmul: an ulp here and there
    assert_within_ulps(h_ours, h_ref, max_ulps=1, max_frac=0.05)
    if last:
        assert y_ours is None and y_ref is None
    else:
        assert (y_ours.float() - y_ref.float()).norm() / y_ref.float().norm() < 2e-2
    first = tb.norm_linear(h, nw, EPS, w_in)
    ref = TB.norm_linear(h, nw, EPS, w_in)
    assert (first.float() - ref.float()).norm() / ref.float().norm() < 2e-2


@pytest.mark.parametrize("enabled", [True, False])
def test_backend_silu_epilogue_at_one_row(enabled):
    """One-row steps take silu_mul in the gate_up junction (silu_after_gate_up), and the gate_up
    GEMV writes it (gemv_silu_out); the down junction then gets the activation. Equal to
    TorchBackend's composition; 2 rows keep silu_mul before down; where silu_mul stays before down
    at one row too (_silu_before_down: int4 MLPs whose gate_up the dp2a epilogue cannot take), the
    silu_mul kernel runs after a plain gate_up GEMV."""
    from salaserve.kernels.triton_backend import TritonBackend

    gen = torch.Generator().manual_seed(95)
    H, F, N2 = 64, 48, 32
    h = torch.randn(1, H, generator=gen).to(bf16)
    o = torch.randn(1, H, generator=gen).to(bf16)
    w_o = (0.1 * torch.randn(H, H, generator=gen)).to(bf16)
    nw = (1 + 0.2 * torch.randn(H, generator=gen)).to(bf16)
    w_gu = (0.3 * torch.randn(2 * F, H, generator=gen)).to(bf16)
    w_down = (0.1 * torch.randn(H, F, generator=gen)).to(bf16)
    w_next = (0.1 * torch.randn(N2, H, generator=gen)).to(bf16)
    tb = TritonBackend()
    tb._silu_before_down = not enabled
    assert tb.silu_after_gate_up(1) == enabled and not tb.silu_after_gate_up(2)
    assert not TB.silu_after_gate_up(1)
    launches = []
    launch = GL._launch
    GL._launch = lambda *a, **kw: (launches.append(kw.get("silu_out", False)), launch(*a, **kw))[1]
    try:
        first = tb.silu_after_gate_up(1)
        h1, act = tb.residual_norm_linear(h, o, w_o, 0.7, nw, EPS, w_gu, silu_out=first)
        h2, proj = tb.residual_norm_linear(h1, act, w_down, 0.7, nw, EPS, w_next, silu=not first)
    finally:
        GL._launch = launch
    assert launches == [False, enabled, False, False]  # o_proj, gate_up, down, next
    r1, ract = TB.residual_norm_linear(h, o, w_o, 0.7, nw, EPS, w_gu, silu_out=True)
    r2, rproj = TB.residual_norm_linear(r1, ract, w_down, 0.7, nw, EPS, w_next)
    assert_within_ulps(h1, r1, max_ulps=1, max_frac=0.05)
    if enabled:  # the activation itself came out of the first junction
        assert act.shape == (1, F) and (act.float() - ract.float()).norm() / ract.float().norm() < 2e-2
    else:  # the gate_up output, activated by the down junction
        assert act.shape == (1, 2 * F)
    assert (proj.float() - rproj.float()).norm() / rproj.float().norm() < 2e-2
    assert (h2.float() - r2.float()).norm() / r2.float().norm() < 2e-2


# ---- fp8 weights (gemv_fp8): e4m3 codes with a per-output-channel fp32 scale

# rows per program walked in one (row, K tile) loop: 1, 2 and 4 rows, with and without splits
FP8_CONFIGS = [G.GemvConfig(4, 64, 1), G.GemvConfig(2, 128, 1, split_k=2), G.GemvConfig(1, 32, 1, split_k=4)]
# the cp.async-pipelined FMA path (FP8_STREAM_CONFIGS' structure): [BN, BK / 4] word tiles, one to
# three stages, splits 1, 2 and 4 (K = 96 with split 4 leaves splits empty); BLOCK_K 32 at K = 96:
# three loop steps per program
FP8_CONFIGS += [G.GemvConfig(8, 32, 1, 3, stream=True), G.GemvConfig(2, 64, 1, 2, split_k=2, stream=True),
                G.GemvConfig(4, 32, 1, 1, split_k=4, stream=True)]


def _fp8_weights(N, K, seed):
    from salaserve.quant.formats import quantize_fp8_per_channel

    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_per_channel(torch.randn(N, K, generator=g) * K ** -0.5)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K", [(64, 64), (42, 96), (40, 192)])  # a partial row tile, an uneven K split
def test_gemv_fp8_matches_reference(M, N, K):
    """fp8 weights against quant.matmul.fp8_matmul_ref (dequantize in fp32, then x @ W^T): fp32 x to
    ~1e-5, bf16 x within one bf16 ulp of the fp64 product of the same values."""
    from salaserve.quant.matmul import fp8_matmul_ref

    w8, scale = _fp8_weights(N, K, seed=N + K + M)
    g = torch.Generator().manual_seed(M)
    for dtype in (torch.float32, bf16):
        x = torch.randn(M, K, generator=g).to(dtype)
        exact = x.double() @ (w8.double() * scale.double()[:, None]).t()
        for cfg in FP8_CONFIGS:
            y = G.gemv_fp8(x, w8, scale, cfg)
            assert y.shape == (M, N) and y.dtype == dtype
            if dtype == torch.float32:
                _close(y, exact)
                _close(y, fp8_matmul_ref(x, w8, scale).double())
            else:
                assert_within_ulps(y, exact.to(bf16), max_ulps=1, max_frac=0.05)


@pytest.mark.parametrize("M", [1, 3])
def test_gemv_fp8_silu_out_matches_reference(M):
    """fp8 [gate | up] weights with the silu_mul epilogue: equal to fused.silu_mul of gemv_fp8's
    own output (the same sums, the same roundings), for every even-BLOCK_N config; F not a
    multiple of the tile's columns (a partial last tile)."""
    F, K = 40, 128
    w8, scale = _fp8_weights(2 * F, K, seed=M)
    g = torch.Generator().manual_seed(10 + M)
    x = torch.randn(M, K, generator=g).to(bf16)
    for cfg in FP8_CONFIGS + [G.GemvConfig(8, 32, 1), G.GemvConfig(4, 64, 1, split_k=2)]:
        if cfg.block_n % 2:
            continue
        y = G.gemv_fp8(x, w8, scale, cfg, silu_out=True)
        full = G.gemv_fp8(x, w8, scale, cfg)
        gate, up = full.float().chunk(2, dim=-1)
        ref = ((gate * torch.sigmoid(gate)).to(bf16).float() * up).to(bf16)
        assert y.shape == (M, F) and y.dtype == bf16
        assert_within_ulps(y, ref, max_ulps=1, max_frac=0.02)


def test_backend_fp8_gate_up_takes_the_silu_epilogue(monkeypatch):
    """fp8 weights at one row (a calibrated even-BLOCK_N config): the
    gate_up junction writes silu_mul through gemv_fp8(silu_out=True), equal to TorchBackend's
    silu_mul of the fp8 linear; without a calibrated GEMV config the junction falls back."""
    from salaserve.kernels.quant_gemm import fp8
    from salaserve.kernels.triton_backend import TritonBackend
    from salaserve.kernels.tuning import isolated_tables
    from salaserve.quant import rtn

    gen = torch.Generator().manual_seed(97)
    H, F = 64, 40
    h = torch.randn(1, H, generator=gen).to(bf16)
    o = torch.randn(1, H, generator=gen).to(bf16)
    w_o = rtn.quantize_fp8(0.1 * torch.randn(H, H, generator=gen))
    nw = (1 + 0.2 * torch.randn(H, generator=gen)).to(bf16)
    w_gu = rtn.quantize_fp8(0.3 * torch.randn(2 * F, H, generator=gen))
    tb = TritonBackend()
    ref_h, ref_act = TB.residual_norm_linear(h, o, w_o, 0.7, nw, EPS, w_gu, silu_out=True)
    calls = []
    real = G.gemv_fp8
    monkeypatch.setattr(G, "gemv_fp8", lambda *a, **kw: calls.append(kw.get("silu_out", False)) or real(*a, **kw))
    for cfg, fused in ((G.GemvConfig(4, 64, 1), True), (G.GemvConfig(1, 64, 1), False), (None, False)):
        calls.clear()
        with isolated_tables():
            fp8.PICKS.put("cpu", 1, (w_gu.out_features, w_gu.in_features), cfg)
            fp8.PICKS.put("cpu", 1, (w_o.out_features, w_o.in_features), cfg)
            h1, act = tb.residual_norm_linear(h, o, w_o, 0.7, nw, EPS, w_gu, silu_out=True)
        assert (True in calls) == fused, (cfg, calls)
        assert act.shape == (1, F)
        assert_within_ulps(h1, ref_h, max_ulps=1, max_frac=0.05)
        assert (act.float() - ref_act.float()).norm() / ref_act.float().norm() < 2e-2


def test_gemv_fp8_refuses_bad_input():
    w8, scale = _fp8_weights(64, 64, seed=1)
    x = torch.randn(1, 64)
    with pytest.raises(TypeError, match="w_scale"):
        G.gemv_fp8(x, w8, scale.half(), FP8_CONFIGS[0])
    with pytest.raises(TypeError, match="w_scale"):
        G.gemv_fp8(x, w8.float(), scale, FP8_CONFIGS[0])
    with pytest.raises(ValueError, match="int32 words"):
        G.gemv_fp8(torch.randn(1, 62), w8[:, :62], scale, FP8_CONFIGS[0])
    # fp8 weights take no tensor-core config
    with pytest.raises(ValueError, match="not dot"):
        G.gemv_fp8(x, w8, scale, G.DOT_CONFIGS[0])
    # the stream path: fp8 weights only, up to 8 rows (its register accumulators)
    stream = next(c for c in FP8_CONFIGS if c.stream)
    with pytest.raises(ValueError, match="fp8 weights"):
        G.gemv(x.to(bf16), w8.float().to(bf16), config=stream)
    with pytest.raises(ValueError, match="M <= 8"):
        G.gemv_fp8(torch.randn(9, 64), w8, scale, stream)
