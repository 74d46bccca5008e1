"""compile_ahead: the calibration's Triton compiles in threads (the mechanics, on the CPU; the GPU
side is tests/test_gpu_quant.py::test_precompile_leaves_nothing_to_compile)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from salaserve.kernels import compile_ahead as ca
from salaserve.kernels.tuning import Stopwatch, isolated_tables, tune


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


class _Recorder(Stopwatch):
    """A stopwatch that times nothing (no GPU here): it records the picks of the trials it is handed,
    per call of `fastest`, and returns the first trial."""

    def __init__(self):
        super().__init__(timer=lambda run, calls: 1.0)
        self.timed = []

    def fastest(self, trials, calls, label="", against=""):
        trials = list(trials)
        self.timed.append([t.pick for t in trials])
        return (trials[0], 1.0) if trials else None


def test_w4_calibration_precompiles_exactly_what_it_times():
    """The int4 family's precompile batch holds exactly what the tuner then times: per shape and M
    bucket each (kernel, config, split) candidate, plus the rounded-x kernel's at 1-2 rows."""
    from salaserve.kernels.quant_gemm import w4_decode
    from salaserve.quant import rtn

    w = rtn.quantize_w4a16_rtn(torch.randn(256, 512) * 512 ** -0.5, 128)
    family, rec = w4_decode.W4DecodeTuning(), _Recorder()
    with isolated_tables():
        tune(family, [w], "cpu", (1, 2, 4), stopwatch=rec)
    launched = []
    for m in (1, 2, 4):
        fns = family.launches(w, m, "cpu")
        assert all(isinstance(f, functools.partial) for f in fns)
        assert {f.func.__name__ for f in fns} <= {"w4a16_decode", "w4a16_decode_rounded"}
        assert {f.args[0].shape[0] for f in fns} == {m}  # x (or its int16 pairs) of the bucket
        plain = [f.args[2] for f in fns if f.func is w4_decode.w4a16_decode]
        rounded = [f.args[3] for f in fns if f.func is w4_decode.w4a16_decode_rounded]
        launched += [plain] + ([rounded] if rounded else [])
        assert bool(rounded) == (m <= 2 and w4_decode.w4_rounded_usable(w))
    assert rec.timed == launched and all(launched)


def test_gemv_calibration_precompiles_exactly_what_it_times():
    """The bf16 GEMV family's precompile batch: one launch per (shape, bucket, candidate) the tuner
    then times, each candidate with the split it runs at."""
    from salaserve.kernels import gemv as G

    family, rec = G.GemvTuning(), _Recorder()
    shapes, buckets = [(512, 256), (384, 256)], (1, 4, 16)
    with isolated_tables():
        tune(family, shapes, "cpu", buckets, stopwatch=rec)
    launched = []
    for N, K in shapes:
        for m in buckets:
            fns = family.launches((N, K), m, "cpu")
            for f in fns:
                assert isinstance(f, functools.partial) and f.func is G.gemv
                x, w, out = f.args
                assert x.shape == (m, K) and w.shape == (N, K) and out.shape == (m, N)
                assert f.keywords["config"].split_k
            launched.append([f.keywords["config"] for f in fns])
    assert rec.timed == launched and all(launched)


def _autotuned(kernel):
    """A real Triton Autotuner (two configs, keyed on n) over `kernel`, as fla's chunk kernels are."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(x_ptr, n, BLOCK: tl.constexpr):
        pass

    tuner = triton.autotune([triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 32}, num_warps=4)],
                            key=["n"])(_copy)
    tuner.fn = kernel  # the launches go to the recorder instead of the JIT
    return tuner


def _search(tuner, *args, **kwargs):
    """What Autotuner.run does on a key it has not seen, up to the timing: nargs, then prune_configs."""
    tuner.nargs = dict(zip(tuner.arg_names, args))
    return tuner.prune_configs({"grid": (4,), "warmup": False, **kwargs})


def test_parallel_autotune_compiles_every_config_of_a_new_search_before_its_timing(monkeypatch):
    monkeypatch.setattr(ca, "precompile_available", lambda: True)
    monkeypatch.setattr(ca, "_async_compile_mode", lambda: _FakeMode)
    _FakeMode.entered.clear()
    k = _FakeKernel()
    tuner = _autotuned(k)
    with ca.parallel_autotune():
        configs = _search(tuner, "x", 1000)
    assert [c.kwargs["BLOCK"] for c in configs] == [16, 32]  # Triton's own configs, unchanged
    assert _FakeMode.entered == [True]
    assert [(kind, grid, args) for kind, grid, args, _ in k.calls] == [("warmup", (4,), ("x", 1000))] * 2
    for (_, _, _, kw), config in zip(k.calls, configs):  # each config's meta-parameters, no 'warmup'
        assert kw == config.all_kwargs() and "warmup" not in kw


def test_autotune_searches_compile_one_by_one_outside_parallel_autotune_or_when_off(monkeypatch):
    monkeypatch.setattr(ca, "precompile_available", lambda: True)
    monkeypatch.setattr(ca, "_async_compile_mode", lambda: _FakeMode)
    k = _FakeKernel()
    tuner = _autotuned(k)
    with ca.parallel_autotune(enabled=True):
        pass
    assert len(_search(tuner, "x", 8)) == 2  # after the context: the hook stays, but idle
    with ca.parallel_autotune(enabled=False):
        _search(tuner, "x", 8)
    assert k.calls == []


def test_parallel_autotune_leaves_a_failing_compile_to_the_timing_loop(monkeypatch):
    monkeypatch.setattr(ca, "precompile_available", lambda: True)
    monkeypatch.setattr(ca, "_async_compile_mode", lambda: _FakeMode)

    class _Refusing(_FakeKernel):
        def warmup(self, *args, grid, **kwargs):
            raise RuntimeError("out of shared memory")

    tuner = _autotuned(_Refusing())
    with ca.parallel_autotune():
        assert len(_search(tuner, "x", 8)) == 2  # the search goes on; its timing reports the error
