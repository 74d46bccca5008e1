"""compile_ahead: the calibration's Triton compiles in threads (the mechanics, on the CPU; the GPU
side is tests/test_gpu_quant.py::test_precompile_leaves_nothing_to_compile)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from salaserve.kernels import compile_ahead as ca


class _FakeKernel:
    """Records launches and compile-only launches (warmup) the way a JITFunction receives them."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("run", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))


class _FakeMode:
    """AsyncCompileMode's interface: entered around the launches, given the pool."""
    entered = []

    def __init__(self, pool, *, ignore_errors=False):
        assert isinstance(pool, ThreadPoolExecutor) and ignore_errors

    def __enter__(self):
        _FakeMode.entered.append(True)
        return self

    def __exit__(self, *exc):
        return False


def test_launch_runs_the_kernel_outside_precompile():
    k = _FakeKernel()
    ca.launch_kernel(k, (3, 2), 1, "a", BLOCK=4)
    assert k.calls == [("run", (3, 2), (1, "a"), {"BLOCK": 4})]


def test_precompile_turns_launches_into_compiles_only_while_it_runs(monkeypatch):
    monkeypatch.setattr(ca, "precompile_available", lambda: True)
    monkeypatch.setattr(ca, "_async_compile_mode", lambda: _FakeMode)
    _FakeMode.entered.clear()
    k = _FakeKernel()
    n = ca.precompile(lambda s=s: ca.launch_kernel(k, (s,), "x", SPLIT=s) for s in (1, 2, 4))
    assert n == 3 and _FakeMode.entered == [True]
    assert k.calls == [("warmup", (s,), ("x",), {"SPLIT": s}) for s in (1, 2, 4)]
    ca.launch_kernel(k, (8,), "x")  # after it: real launches again
    assert k.calls[-1] == ("run", (8,), ("x",), {})


def test_precompile_restores_launches_when_a_candidate_raises(monkeypatch):
    monkeypatch.setattr(ca, "precompile_available", lambda: True)
    monkeypatch.setattr(ca, "_async_compile_mode", lambda: _FakeMode)
    k = _FakeKernel()

    def bad():
        raise ValueError("refused config")

    with pytest.raises(ValueError, match="refused config"):
        ca.precompile([bad])
    ca.launch_kernel(k, (1,))
    assert k.calls == [("run", (1,), (), {})]


def test_precompile_does_nothing_without_a_gpu():
    """No CUDA here (or the interpreter): the fns are not even called, so nothing is launched."""
    if ca.precompile_available():
        pytest.skip("a GPU with AsyncCompileMode is present")
    called = []
    assert ca.precompile([lambda: called.append(1)]) == 0
    assert called == []
    assert ca.workers() >= 1


def test_w4_calibration_precompiles_every_candidate_of_every_bucket(monkeypatch):
    """calibrate_w4's one precompile batch holds exactly what it then times: per shape and M bucket
    each (kernel, config, split) candidate, plus the rounded-x kernel's at 1-2 rows."""
    import functools

    import torch

    from salaserve.kernels.quant_gemm import w4_decode
    from salaserve.quant import rtn

    w = rtn.quantize_w4a16_rtn(torch.randn(256, 512) * 512 ** -0.5, 128)
    work = [(w, [1, 2, 4])]
    launches = list(w4_decode._candidate_launches(work, "cpu"))
    want = sum(len(w4_decode._w4_candidates(m, w, "cpu")) for m in (1, 2, 4))
    want += sum(len(w4_decode.rounded_choices(m, w, "cpu")) for m in (1, 2)) if w4_decode.w4_rounded_usable(w) else 0
    assert len(launches) == want > 0
    assert all(isinstance(f, functools.partial) for f in launches)
    assert {f.func.__name__ for f in launches} <= {"w4a16_decode", "w4a16_decode_rounded"}
    assert {f.args[0].shape[0] for f in launches} == {1, 2, 4}  # x (or its int16 pairs) of each bucket


def test_gemv_calibration_precompiles_every_candidate_of_every_bucket(monkeypatch):
    """gemv.calibrate's precompile batch: one launch per (shape, bucket, candidate) it then times,
    each candidate with the split it runs at."""
    import functools

    from salaserve.kernels import gemv as G

    monkeypatch.setattr(G, "_sm_count", lambda device: 132)
    todo = {(512, 256): [1, 4], (256, 512): [], (384, 256): [16]}
    launches = list(G._candidate_launches(todo, "cpu"))
    want = [(N, K, Mb, c) for (N, K), bs in todo.items() for Mb in bs for c in G._calibration_candidates(Mb, N, K, "cpu")]
    assert len(launches) == len(want) > 0
    for f, (N, K, Mb, c) in zip(launches, want):
        assert isinstance(f, functools.partial) and f.func is G.gemv
        x, w, out = f.args
        assert x.shape == (Mb, K) and w.shape == (N, K) and out.shape == (Mb, N)
        assert f.keywords["config"] == c and c.split_k
