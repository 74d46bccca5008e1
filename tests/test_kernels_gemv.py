"""Decode GEMV kernels (salaserve.kernels.gemv).

CPU (default run):
- every path (FMA M = 1, FMA M > 1, tensor-core dot), split-K 1..4, the fused prologues and the
  residual epilogue against torch under the Triton interpreter, in a subprocess
  (tests/gemv_interp_cases.py: TRITON_INTERPRET must be set before triton is imported);
- an sm_90 ahead-of-time compile of every candidate config (and the fused / PDL variants): no
  register spills, W read with 16-byte loads (FMA) or 16-byte cp.async (dot), and no shared-memory
  traffic or shuffles inside the FMA paths' main loops (x must come in W's thread mapping); the
  large-M dot configs (M buckets 32..128) with their splits: wgmma, shared memory <= 227 KB;
- the large-M configs and dispatch rules (candidates, splits, the prologues' M limit).
GPU (`pytest -m gpu`): the model's real shapes at M in 1..16 and 128 against cuBLAS / fp32
references with a written bf16 tolerance, the fused ops, CUDA-graph capture with and without PDL,
calibration.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_checks import assert_within_ulps

from salaserve.kernels.gemv import GemvTuning
from salaserve.kernels.tuning import Stopwatch, isolated_tables, m_bucket

TESTS = Path(__file__).resolve().parent


def test_gemv_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), str(TESTS), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", str(TESTS / "gemv_interp_cases.py")],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"interpreter cases failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# sm_90 ahead-of-time compiles
# ---------------------------------------------------------------------------------------------


def _aot_cases():
    from salaserve.kernels import gemv as G

    cases = {}
    for bucket, cfgs in G.FMA_CONFIGS.items():
        for cfg in cfgs:
            cases[f"m{bucket}-{cfg}"] = (cfg, bucket, {})
    for cfg in G.DOT_CONFIGS:
        cases[f"m16-{cfg}"] = (cfg, 16, {})
    fma1, fma4, dot = G.FMA_CONFIGS[1][0], G.FMA_CONFIGS[4][0], G.DOT_CONFIGS[0]
    for name, cfg, bm in (("fma1", fma1, 1), ("fma4", fma4, 4), ("dot", dot, 16)):
        cases[f"{name}-rmsnorm"] = (cfg, bm, dict(PROLOGUE=1))
        cases[f"{name}-silu-residual-split4"] = (cfg, bm, dict(PROLOGUE=2, RESIDUAL=True, SPLIT_K=4))
        cases[f"{name}-pdl-split2"] = (cfg, bm, dict(PDL=True, SPLIT_K=2))
        cases[f"{name}-uneven-k"] = (cfg, bm, dict(EVEN_K=False))
        if cfg.block_n % 2 == 0:  # the silu_mul epilogue pairs gate and up rows in a tile
            cases[f"{name}-silu-out-split4"] = (cfg, bm, dict(SILU_OUT=True, SPLIT_K=4, PDL=True))
    cases["m1-fma n2-silu-out"] = (G.FMA_CONFIGS[1][1], 1, dict(SILU_OUT=True, PDL=True))
    for bucket, cfgs in G.DOT_LARGE_M_CONFIGS.items():  # M 17..128: as launched (its split, PDL on)
        for cfg in cfgs:
            cases[f"m{bucket}-{cfg}"] = (cfg, bucket, dict(SPLIT_K=cfg.split_k, PDL=True))
            if bucket == 128:  # the residual epilogue; a ragged K (the JIT sees K % 16 == 0)
                cases[f"m128-{cfg}-residual"] = (cfg, 128, dict(SPLIT_K=cfg.split_k, PDL=True, RESIDUAL=True))
                cases[f"m128-{cfg}-uneven-k"] = (cfg, 128, dict(SPLIT_K=cfg.split_k, PDL=True, EVEN_K=False,
                                                                divisible=("K",)))
    for bucket, cfgs in G.FP8_FMA_CONFIGS.items():  # fp8 weights with their scales (gemv_fp8)
        for cfg in cfgs:
            cases[f"fp8-m{bucket}-{cfg}"] = (cfg, bucket, dict(W_SCALE=True, X_WORDS=True, PDL=True, SPLIT_K=2))
    for bucket, cfgs in G.FP8_STREAM_CONFIGS.items():  # fp8 behind the cp.async pipeline, as launched (its split)
        for cfg in cfgs:
            stream = dict(W_SCALE=True, X_WORDS=True, PDL=True, FP8_STREAM=True, STAGES=cfg.num_stages)
            cases[f"fp8-stream-m{bucket}-{cfg}"] = (cfg, bucket, dict(stream, SPLIT_K=cfg.split_k))
            if cfg.block_n % 2 == 0 and bucket == 1:
                cases[f"fp8-stream-m1-{cfg}-silu-out"] = (cfg, 1, dict(stream, SILU_OUT=True, SPLIT_K=1))
    return cases


def _ttgir_loop(ttgir: str) -> str:
    """The body of the first scf.for in a TTGIR listing (up to its closing brace)."""
    start = ttgir.index("scf.for")
    depth = 0
    for i in range(ttgir.index("{", start), len(ttgir)):
        depth += {"{": 1, "}": -1}.get(ttgir[i], 0)
        if depth == 0:
            return ttgir[start:i]
    raise AssertionError("unterminated scf.for")


def _loops(ptx: str) -> list[str]:
    """Bodies of the PTX loops: every basic block LLVM's comments put in a loop (its header block,
    marked 'Loop Header', and the blocks marked 'in Loop: Header=BB..'), wherever the layout
    places them (a rotated loop's latch can come before its header)."""
    blocks = re.split(r"^(?=\$L__BB\d+_\d+:|// %bb\.\d+:)", ptx, flags=re.M)
    bodies: dict[str, list[str]] = {}
    for block in blocks:
        head = "".join(block.split("\n", 2)[:2])  # the label's line and the comment line under it
        if "Loop Header" in head:
            label = re.match(r"\$L__(BB\d+_\d+):", head)
            if label:
                bodies.setdefault(label.group(1), []).append(block)
        elif (member := re.search(r"in Loop: Header=(BB\d+_\d+)", head)):
            bodies.setdefault(member.group(1), []).append(block)
    return ["".join(b) for b in bodies.values()]


@pytest.mark.parametrize("name", sorted(_aot_cases()))
def test_gemv_compiles_for_sm90(name):
    import triton.language as tl

    from kernel_checks import compile_sm90_without_spills
    from salaserve.kernels.gemv.kernel import _gemv_kernel

    cfg, block_m, extra = _aot_cases()[name]
    extra = dict(extra)
    divisible = extra.pop("divisible", ())
    bf = "*bf16"
    ptrs = dict(x_ptr=bf, w_ptr="*fp8e4nv" if extra.get("W_SCALE") else bf, out_ptr=bf, res_ptr=bf, nw_ptr=bf,
                ws_ptr="*fp32", cnt_ptr="*i32", w_scale_ptr="*fp32")
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1, EVEN_K=True,
                      DOT=cfg.dot, PROLOGUE=0, RESIDUAL=False, X_DT=tl.bfloat16, XN_DT=tl.bfloat16,
                      Y_DT=tl.bfloat16, OUT_DT=tl.bfloat16, PDL=False, DOT_FP32=False, SILU_OUT=False, W_SCALE=False,
                      FP8_ASM=True, X_WORDS=False, FP8_STREAM=False, STAGES=1)
    constexprs.update(extra)
    kernel = compile_sm90_without_spills(_gemv_kernel, ptrs, constexprs, cfg.num_warps,
                                         num_stages=cfg.num_stages, fp_fusion=True, divisible=divisible)
    ptx = kernel.asm["ptx"]
    if extra.get("PDL"):
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    if cfg.dot:
        assert kernel.metadata.shared <= 227 * 1024, f"{kernel.metadata.shared} bytes of shared memory"
    if block_m > 16:
        assert "wgmma" in ptx, "large-M dot path without wgmma"
    if extra.get("EVEN_K") is False and "K" not in divisible:
        return  # K masks with K's divisibility unknown here (the JIT knows K % 16 == 0): scalar loads
    if cfg.dot:
        # W streamed into shared memory by 16-byte async copies (Triton's pipeliner)
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), "no 16-byte cp.async"
        assert "wgmma" in ptx or "mma.sync" in ptx
    elif extra.get("FP8_STREAM"):  # fp8 through the cp.async pipeline: 16-byte copies, cvt-converted codes
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), "no 16-byte cp.async"
        main = [b for b in _loops(ptx) if "fma.rn.f32" in b]
        assert main, "no FMA main loop found"
        for body in main:
            assert "cp.async" in body, "the loop issues no copies for later steps (not pipelined)"
            assert "ld.global" not in body, "W or x read straight from global memory inside the loop"
            assert "cvt.rn.f16x2.e4m3x2" in body and "prmt" not in body, "fp8 codes not converted by the asm"
        # W and x come back from the pipeline's shared memory in the math's layout: no conversion
        # (a shared-memory round trip with barriers) per step; the int4 kernel's stream form had 25
        # and ran 3-5x slower
        loop = _ttgir_loop(kernel.asm["ttgir"])
        assert loop.count("ttg.local_load") == 2 and "ttg.convert_layout" not in loop
    elif extra.get("W_SCALE"):  # fp8: 16-byte vectors of 16 weights per thread and row, cvt-converted
        assert cfg.block_k % (512 * cfg.num_warps) == 0
        # the rows are walked one at a time: the first tile's load and the loop's prefetch
        assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) >= 2, "W not read in 16-byte vectors"
        main = [b for b in _loops(ptx) if "fma.rn.f32" in b and "ld.global" in b]
        assert main, "no FMA main loop found"
        for body in main:
            assert "cvt.rn.f16x2.e4m3x2" in body and "prmt" not in body, "fp8 codes not converted by the asm"
            if block_m == 1:  # x's tile in the words' mapping: no vector trips through shared memory
                # (the scalar ld/st.shared at a row's end are its cross-warp sum, once per row)
                for op in ("ld.shared.v", "st.shared.v"):
                    assert op not in body, f"{op} inside the fp8 main loop at one row (x not in W's mapping)"
    else:
        assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) >= cfg.block_n, "W not read in 16-byte vectors"
        main = [b for b in _loops(ptx) if "fma.rn.f32" in b and "ld.global" in b]
        assert main, "no FMA main loop found"
        for body in main:
            for op in ("bar.sync", "ld.shared", "st.shared", "shfl.sync"):
                assert op not in body, f"{op} inside an FMA main loop (x not in W's thread mapping)"


def test_fp8_calibration_candidates():
    """The fp8 calibration's candidates: the FMA configs of the M bucket, and the stream configs
    (explicit splits) at 1-2 rows only."""
    from salaserve.kernels import gemv as G
    from salaserve.kernels.quant_gemm import fp8 as F8
    from salaserve.quant import rtn

    w = rtn.quantize_fp8(torch.randn(64, 128))
    assert F8.fp8_candidates(1, w) == G.FP8_FMA_CONFIGS[1] + G.FP8_STREAM_CONFIGS[1]
    assert F8.fp8_candidates(2, w) == G.FP8_FMA_CONFIGS[2] + G.FP8_STREAM_CONFIGS[2]
    assert F8.fp8_candidates(8, w) == G.FP8_FMA_CONFIGS[8]
    assert all(c.stream and c.split_k for cs in G.FP8_STREAM_CONFIGS.values() for c in cs)


def test_large_m_configs_and_limits():
    """M 17..128: dot configs with explicit small splits per bucket, a split-1 one in each (the
    wide N), the uncalibrated default among them; splits that cannot pay off at an N are not
    calibrated; the plain GEMV takes M <= DOT_MAX_M, the fused prologues M <= GEMV_MAX_M."""
    from salaserve.kernels import gemv as G
    from salaserve.kernels.gemv import launch as GL

    dev = torch.device("cpu")  # 132 SMs assumed off-GPU
    assert G.DOT_MAX_M == 128 and G.GEMV_MAX_M == 16
    assert set(G.DOT_LARGE_M_CONFIGS) == {32, 64, 128}
    for M in (17, 20, 32, 33, 64, 65, 100, 128):
        b = m_bucket(M)
        cands = G.candidate_configs(M)
        assert cands == G.DOT_LARGE_M_CONFIGS[b] and 4 <= len(cands) <= 6
        assert all(c.dot and c.split_k in (1, 2, 4) for c in cands)
        assert any(c.split_k == 1 for c in cands)
        assert G.default_config(M, 4096, 4096) in cands
    assert G.candidate_configs(16) == G.DOT_CONFIGS  # small M unchanged
    # N = 4096 (32 or 64 column tiles) keeps every split; N = 32768 none
    assert all(G.split_useful(c, 4096, dev) for c in G.DOT_LARGE_M_CONFIGS[128])
    assert [c.split_k for c in G.DOT_LARGE_M_CONFIGS[128] if G.split_useful(c, 32768, dev)] == [1, 1]
    assert all(G.split_useful(c, 73448, dev) for c in G.DOT_CONFIGS)  # automatic splits untouched
    # the workspace's first allocation covers the largest calibrated split at M = 128
    largest = max(c.split_k * 128 * 4096 for c in G.DOT_LARGE_M_CONFIGS[128] if G.split_useful(c, 4096, dev))
    assert largest <= GL._WS_MIN_FLOATS
    x = torch.randn(32, 128)
    w = torch.randn(64, 128)
    with pytest.raises(ValueError, match="prologues"):
        G.gemv_rmsnorm(x, torch.ones(128), 1e-6, w)
    with pytest.raises(ValueError, match="prologues"):
        G.gemv_silu_mul(torch.randn(32, 256), w)
    with pytest.raises(ValueError, match="1 <= M <= 128"):
        G.gemv(torch.randn(129, 128), w)


def test_large_m_dispatch_rules():
    """A calibrated GEMV win at bucket 128 sends M 65..128 to the GEMV; uncalibrated M = 64 stays
    on cuBLAS; TritonBackend never fuses a prologue / residual GEMV above 16 rows."""
    from salaserve.kernels import gemv as G
    from salaserve.kernels.triton_backend import TritonBackend

    dev = torch.device("cpu")
    N, K = 4096, 4096
    with isolated_tables():
        assert not G.uses_gemv(64, N, K, dev) and not G.uses_gemv(128, N, K, dev)
        cfg = G.DOT_LARGE_M_CONFIGS[128][1]
        G.PICKS.put(dev, 128, (N, K), G.Choice(cfg, 8.5, 15.0))
        assert G.uses_gemv(128, N, K, dev) and G.uses_gemv(100, N, K, dev)
        assert G.choose_config(128, N, K, dev) == cfg
        assert not G.uses_gemv(64, N, K, dev)  # bucket 64 uncalibrated
        assert not G.uses_gemv(129, N, K, dev)
        x = torch.empty(128, K, dtype=torch.bfloat16)
        w = torch.empty(N, K, dtype=torch.bfloat16)
        assert not TritonBackend._gemv_fuses(x, w)


def test_calibrate_times_each_bucket_up_to_the_gemv_limit():
    """calibrate (the tuner's recipe, timings faked: no GPU here) times cuBLAS and then each candidate
    per bucket, nothing above DOT_MAX_M rows (the GEMV refuses them; linear keeps cuBLAS there), keeps
    the fastest candidate with cuBLAS's time, and skips the buckets already in the table."""
    from salaserve.kernels import gemv as G

    times = []

    def timer(run, calls):  # each run slower than the last: cuBLAS (first) fastest, then the first candidate
        times.append(calls)
        return float(len(times))

    N, K = 256, 512
    with isolated_tables():
        got = G.calibrate([(N, K)], "cpu", m_values=(3, 8, 16, 256), stopwatch=Stopwatch(timer))
        assert sorted(b for b, _, _ in got) == [4, 8, 16]
        cands = {m: GemvTuning().candidates(m, N, K, "cpu") for m in (4, 8, 16)}
        assert len(times) == sum(1 + len(c) for c in cands.values())  # cuBLAS + the candidates, per bucket
        for m in (4, 8, 16):
            choice = G.calibrated_choice(m, N, K, "cpu")
            assert choice.gemv == cands[m][0] and choice.gemv_us > choice.cublas_us and not choice.use_gemv
            assert not G.uses_gemv(m, N, K, "cpu")
        assert not G.uses_gemv(256, N, K, "cpu")
        times.clear()
        G.calibrate([(N, K)], "cpu", m_values=(8, 32), stopwatch=Stopwatch(timer))
        assert len(times) == 1 + len(GemvTuning().candidates(32, N, K, "cpu"))  # only the new bucket


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# MiniCPM-SALA (full preset): name -> (N, K)
REAL = {"qkvg": (8704, 4096), "qkvz": (16384, 4096), "o_proj": (4096, 4096), "gate_up": (32768, 4096),
        "down": (4096, 16384), "lm_head": (73448, 4096)}
EPS = 1e-6
R = 1.4 / 32 ** 0.5  # the model's residual scale


def _inputs(M, N, K, seed=0, x_cols=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, x_cols or K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    return x, w


def assert_bf16_linear_close(y, x, w, what=""):
    """The written bf16 tolerance for y ~ x @ w^T computed with fp32 accumulation and one final
    rounding to bf16: |y - ref32| <= 2^-8 |ref32| (the bf16 rounding, unit roundoff 2^-8) plus
    1e-4 * sum_k |x_k w_nk| (any fp32 summation order: ~sqrt(K) * 2^-24 relative to that sum,
    so 1e-4 leaves a >10x margin at K = 16384). cuBLAS's own bf16 output meets it too."""
    ref = x.float() @ w.float().t()
    mag = x.float().abs() @ w.float().abs().t()
    bound = 2.0 ** -8 * ref.abs() + 1e-4 * mag
    err = (y.float() - ref).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {y.numel()} outside the bf16 bound; "
                           f"worst excess {float((err - bound).max())}")


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
def test_gemv_real_shapes(name, M):
    from salaserve.kernels import gemv as G

    N, K = REAL[name]
    x, w = _inputs(M, N, K, seed=M)
    assert_bf16_linear_close(x @ w.t(), x, w, "cuBLAS (tolerance sanity)")
    configs = [G.default_config(M, N, K)]
    if name in ("o_proj", "down") and M in (1, 8):  # split-K shapes: every candidate
        configs = list(G.candidate_configs(M))
    for cfg in configs:
        y = G.gemv(x, w, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert_bf16_linear_close(y, x, w, f"{name} M={M} {cfg}")
        assert torch.equal(G.gemv(x, w, config=cfg), y), "not deterministic"


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["o_proj", "down"])
def test_gemv_large_m_real_shapes(name):
    """Batch 128 on the tensor-core path, every bucket-128 candidate (explicit splits) against the
    written bf16 bound, deterministic; M = 100 (padded rows) with the default config; a split
    config captured in a CUDA graph replays the eager bits."""
    from salaserve.kernels import gemv as G

    N, K = REAL[name]
    M = 128
    x, w = _inputs(M, N, K, seed=128 + K)
    assert_bf16_linear_close(x @ w.t(), x, w, "cuBLAS (tolerance sanity)")
    for cfg in G.candidate_configs(M):
        y = G.gemv(x, w, config=cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert_bf16_linear_close(y, x, w, f"{name} M={M} {cfg}")
        assert torch.equal(G.gemv(x, w, config=cfg), y), "not deterministic"
    y100 = G.gemv(x[:100], w, config=G.default_config(100, N, K))
    assert_bf16_linear_close(y100, x[:100], w, f"{name} M=100")
    cfg = max(G.candidate_configs(M), key=lambda c: c.split_k)
    _assert_graph_replay_equals(lambda out: G.gemv(x, w, out=out, config=cfg), G.gemv(x, w, config=cfg))


def _assert_graph_replay_equals(run, eager):
    """run(out), captured in a CUDA graph and replayed twice (split-K counters re-armed in
    between), writes eager's bits into out."""
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 16])
def test_silu_out_real_shape(M):
    """gemv_silu_out at gate_up's shape (every candidate config with an even BLOCK_N, with and
    without PDL): within one bf16 ulp of silu_mul(gemv(x, w)) with the same config on <= 1% of
    elements (exp's last fp32 bit); deterministic; a CUDA-graph replay gives the eager bits."""
    from salaserve.kernels import fused
    from salaserve.kernels import gemv as G

    N, K = REAL["gate_up"]
    x, w = _inputs(M, N, K, seed=90 + M)
    configs = [c for c in G.candidate_configs(M) if c.block_n % 2 == 0]
    assert configs
    for cfg in configs:
        for pdl in (False, True):
            act = G.gemv_silu_out(x, w, config=cfg, pdl=pdl)
            assert act.shape == (M, N // 2) and act.dtype == torch.bfloat16
            assert_within_ulps(act, fused.silu_mul(G.gemv(x, w, config=cfg, pdl=pdl)), max_ulps=1, max_frac=0.01)
            assert torch.equal(G.gemv_silu_out(x, w, config=cfg, pdl=pdl), act), "not deterministic"
    cfg = configs[0]
    _assert_graph_replay_equals(lambda out: G.gemv_silu_out(x, w, out=out, config=cfg),
                                G.gemv_silu_out(x, w, config=cfg))


@gpu
@needs_cuda
def test_calibrate_large_m():
    """Calibration at M = 128 (o_proj's shape): a GEMV config among the bucket's candidates, and
    `linear` follows the measured winner."""
    from salaserve.kernels import gemv as G

    G.clear_calibration()
    try:
        table = G.calibrate([(4096, 4096)], "cuda", m_values=(128,))
        choice = table[(128, 4096, 4096)]
        assert choice.gemv in G.candidate_configs(128) and choice.gemv_us > 0 and choice.cublas_us > 0
        x, w = _inputs(128, 4096, 4096, seed=5)
        assert G.uses_gemv(128, 4096, 4096, x.device) == choice.use_gemv
        assert_bf16_linear_close(G.linear(x, w), x, w, "linear M=128")
    finally:
        G.clear_calibration()


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 4, 8])
def test_fused_ops_gpu(M):
    from salaserve.kernels import fused
    from salaserve.kernels import gemv as G
    from salaserve.model import reference as spec

    g = torch.Generator(device="cuda").manual_seed(M)
    h = torch.randn(M, 4096, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.3 * torch.randn(4096, device="cuda", generator=g)).bfloat16()
    for cfg in G.FMA_CONFIGS[m_bucket(M)][:1] + G.DOT_CONFIGS[:1]:
        # residual epilogue: bit-exact against torch's expression on the same GEMV output
        x, w = _inputs(M, 4096, 4096, seed=10 + M)
        y = G.gemv(x, w, config=cfg)
        assert torch.equal(G.gemv_residual(x, w, h, R, config=cfg), h + y * R)
        # RMSNorm prologue: W = I returns the normalised input (one ulp on few elements: stats order)
        eye = torch.eye(4096, device="cuda", dtype=torch.bfloat16)
        ours = G.gemv_rmsnorm(h, nw, EPS, eye, config=cfg)
        ref = spec.rms_norm(h, nw, EPS)
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
        assert (ours != ref).float().mean() <= 1e-3
        wq = _inputs(M, 8704, 4096, seed=20 + M)[1]
        assert_bf16_linear_close(G.gemv_rmsnorm(h, nw, EPS, wq, config=cfg), fused.rms_norm(h, nw, EPS), wq,
                                 "gemv_rmsnorm")
        # silu_mul prologue (+ residual): W = I returns silu_mul(gate_up)
        gu = (2 * torch.randn(M, 8192, device="cuda", generator=g)).bfloat16()
        act = G.gemv_silu_mul(gu, eye, config=cfg)
        ref = fused.silu_mul(gu)
        assert ((act.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all()
        assert (act != ref).float().mean() <= 1e-3
        assert torch.equal(G.gemv_silu_mul(gu, eye, residual=h, scale=R, config=cfg), h + act * R)


def _layer_chain(M, seed=0):
    """One decode layer's linears as the fused chain: qkv(rmsnorm) -> o(residual) ->
    gate_up(rmsnorm) -> down(silu_mul + residual). Returns (inputs, run(pdl) -> outputs)."""
    from salaserve.kernels import gemv as G

    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, device="cuda", generator=g)).to(bf)

    h = rnd(M, 4096)
    o = rnd(M, 4096)
    n1, n2 = (1 + 0.3 * torch.randn(4096, device="cuda", generator=g)).to(bf), rnd(4096, s=0.3) + 1
    wqkv, wo = rnd(16384, 4096, s=1 / 64), rnd(4096, 4096, s=1 / 64)
    wgu, wd = rnd(32768, 4096, s=1 / 64), rnd(4096, 16384, s=1 / 128)

    def run(pdl):
        qkv = G.gemv_rmsnorm(h, n1, EPS, wqkv, pdl=pdl)
        h1 = G.gemv_residual(o, wo, h, R, pdl=pdl)
        gu = G.gemv_rmsnorm(h1, n2, EPS, wgu, pdl=pdl)
        h2 = G.gemv_silu_mul(gu, wd, residual=h1, scale=R, pdl=pdl)
        return qkv, h1, gu, h2

    return (h, o), run


@gpu
@needs_cuda
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_capture(M, pdl):
    """The fused chain captured in a CUDA graph replays bit-identically to eager runs, also after
    the inputs change, and PDL changes no bit."""
    (h, o), run = _layer_chain(M)
    eager = run(False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(pdl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(pdl)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)
    h.copy_(torch.randn_like(h, dtype=torch.float32).bfloat16())
    o.mul_(-0.5)
    eager = run(False)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


def _unfused_chain(seed=0):
    """The batch-1 engine's chain (the GEMVs do not fuse at one row): gemv -> add_rms_norm ->
    gemv -> silu_mul -> gemv -> add_rms_norm -> gemv, and rms_norm / sigmoid_mul on the side.
    Returns run() -> outputs, under whatever PDL switch is set."""
    from salaserve.kernels import fused
    from salaserve.kernels import gemv as G

    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, device="cuda", generator=g)).to(bf)

    h, a = rnd(1, 4096), rnd(1, 4096)
    n1, n2 = rnd(4096, s=0.3) + 1, rnd(4096, s=0.3) + 1
    wo, wgu, wd, wq = rnd(4096, 4096, s=1 / 64), rnd(32768, 4096, s=1 / 64), rnd(4096, 16384, s=1 / 128), \
        rnd(8704, 4096, s=1 / 64)

    def run():
        h1, x1 = fused.add_rms_norm(h, G.gemv(a, wo), R, n1, EPS)
        act = fused.silu_mul(G.gemv(x1, wgu))
        h2, x2 = fused.add_rms_norm(h1, G.gemv(act, wd), R, n2, EPS)
        q = G.gemv(x2, wq)
        return h1, x1, act, h2, x2, q, fused.rms_norm(q[:, :4096], n1, EPS), fused.sigmoid_mul(q[:, :4096], q[:, 4096:8192])

    return run


@gpu
@needs_cuda
def test_row_kernels_with_pdl_in_a_graph_change_no_bit():
    """PDL (set_pdl) also launches fused.py's row kernels with PDL: the batch-1 chain of
    GEMVs and row kernels, captured and replayed with PDL on, equals the eager chain without it,
    bit for bit (where the GPU cannot launch with PDL, both runs are plain)."""
    from salaserve.kernels import _triton_utils as U

    run = _unfused_chain()
    before = U._PDL
    try:
        U.set_pdl(False)
        eager = run()
        U.set_pdl(True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    finally:
        U.set_pdl(before)
    for x, y in zip(outs, eager):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_mul_kernel", "_sigmoid_mul_kernel"])
def test_row_kernels_compile_with_and_without_pdl(name):
    """fused.py's row kernels for sm_90: with PDL (the default) they signal and wait on the grid
    dependency, and without it (set_pdl(False)) their code has neither."""
    import triton.language as tl
    from kernel_checks import compile_sm90_without_spills

    from salaserve.kernels import fused

    fn = getattr(fused, name)
    consts = {"_rms_norm_kernel": dict(BLOCK=4096, X_DT=tl.bfloat16, OUT_DT=tl.bfloat16),
              "_add_rms_norm_kernel": dict(BLOCK=4096, U_DT=tl.bfloat16, H_DT=tl.bfloat16, OUT_DT=tl.bfloat16),
              "_silu_mul_kernel": dict(BLOCK=1024, DT=tl.bfloat16),
              "_sigmoid_mul_kernel": dict(BLOCK=1024, G_DT=tl.bfloat16, OUT_DT=tl.bfloat16)}[name]
    ptrs = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    for pdl in (False, True):
        ptx = compile_sm90_without_spills(fn, ptrs, dict(consts, PDL=pdl), 4).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl


@pytest.mark.parametrize("name", ["_add_rms_norm_kernel", "_silu_mul_kernel"])
def test_row_kernels_compile_with_int16_out(name):
    """The producers of the int4 dp2a GEMV's rounded x (INT16_OUT) compile for sm_90 without spills,
    with NaN-propagating tile maxima (the GPU's plain max drops a NaN) and the int16 pairs packed by
    prmt."""
    import triton.language as tl
    from kernel_checks import compile_sm90_without_spills

    from salaserve.kernels import fused

    fn = getattr(fused, name)
    consts = {"_add_rms_norm_kernel": dict(BLOCK=4096, U_DT=tl.bfloat16, H_DT=tl.bfloat16, OUT_DT=tl.bfloat16,
                                           FP8_OUT=False),
              "_silu_mul_kernel": dict(BLOCK=1024, DT=tl.bfloat16)}[name]
    ptrs = {n: "*bf16" for n in fn.arg_names if n.endswith("_ptr")}
    ptrs.update(out_ptr="*i32", s_ptr="*fp32")
    consts.update(INTERPRET=False)
    warps = 8 if name == "_add_rms_norm_kernel" else 4
    ptx = compile_sm90_without_spills(fn, ptrs, dict(consts, PDL=True, INT16_OUT=True), warps).asm["ptx"]
    assert "max.NaN.f32" in ptx and "max.f32" not in ptx
    assert "prmt.b32" in ptx


@gpu
@needs_cuda
def test_calibrate_and_linear():
    from salaserve.kernels import gemv as G

    G.clear_calibration()
    table = G.calibrate([(4096, 4096)], "cuda", m_values=(1, 2))
    assert set(table) == {(1, 4096, 4096), (2, 4096, 4096)}
    for (m, n, k), choice in table.items():
        assert choice.gemv_us > 0 and choice.cublas_us > 0
        assert G.uses_gemv(m, n, k, torch.device("cuda")) == (choice.gemv_us < choice.cublas_us)
        assert G.choose_config(m, n, k, torch.device("cuda")) == choice.gemv
    x, w = _inputs(1, 4096, 4096)
    y = G.linear(x, w)
    assert_bf16_linear_close(y, x, w, "linear")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = G.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    if G.uses_gemv(1, 4096, 4096, x.device):
        assert torch.equal(yg, y)
    else:  # cuBLAS may pick another algorithm under capture
        assert_bf16_linear_close(yg, x, w, "linear (cuBLAS) in a graph")
    G.clear_calibration()


def test_model_linear_shapes():
    from salaserve.config import preset_config
    from salaserve.kernels import gemv as G

    shapes = G.model_linear_shapes(preset_config("full"))
    assert {(n, N, K, c) for n, N, K, c in shapes} == {
        ("qkvg", 8704, 4096, 8), ("qkvz", 16384, 4096, 24), ("o_proj", 4096, 4096, 8), ("o_proj_l", 4096, 4096, 24),
        ("gate_up", 32768, 4096, 32), ("down", 4096, 16384, 32), ("lm_head", 73448, 4096, 1)}
    assert abs(sum(N * K * 2 * c for _, N, K, c in shapes) / 1e9 - 18.35) < 0.01  # anchors.md
