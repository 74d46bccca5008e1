"""The start-up calibration's Triton compiles, many at once in threads instead of one by one.

    precompile(fn() for each candidate)       compiles what each fn would launch, runs none of it
    launch_kernel(kernel, grid, *args, **kw)  kernel[grid](*args, **kw); inside precompile, its compile only
    with parallel_autotune():                 an autotuned kernel's search (fla's chunk kernels) compiles
                                              all its configs at once in threads before timing them

Why: the calibration times every candidate (config x split-K, each a separate Triton
specialisation), and with an empty kernel cache their compiles, one after another, were most of a
quantized engine's first start-up (w4a16: 389 s cold one at a time, 188 s in threads). Triton's compiler releases the GIL: two threads compiled 8 dp2a variants for sm_90
in 7.5 s against 14.5 s serially on a 2-core machine. `triton.runtime._async_compile.
AsyncCompileMode` hands each compile to an executor. So precompile runs each candidate's launch
once with `launch_kernel` in compile-only mode (`kernel.warmup`), the compiles go to a thread pool,
and on leaving it every kernel sits in its JIT cache: the timing loop that follows compiles nothing.

The calibrated kernels' launches go through `launch_kernel`. A compile that fails inside precompile
fails again, with its error, at the candidate's real launch.

The warm-up's autotune searches (fla's Lightning kernels: up to 48 configs a search) would compile
one config at a time as Triton times them. Inside `parallel_autotune`, a search's first step
compiles every config in the thread pool, and the timing that follows only runs them.

Without AsyncCompileMode (a Triton that lacks it), without a GPU, under the interpreter, or with
KernelOptions.parallel_compile off (`--no-parallel-compile`), precompile and parallel_autotune do
nothing and the compiles happen one by one at the first launches.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch

from salaserve.kernels.options import INTERPRET

log = logging.getLogger(__name__)

_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("salaserve_compile_only", default=False)


def launch_kernel(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs); inside precompile, only the compile of that specialisation
    (submitted to precompile's threads), nothing runs."""
    if _COMPILE_ONLY.get():
        return kernel.warmup(*args, grid=grid, **kwargs)
    return kernel[grid](*args, **kwargs)


def _async_compile_mode():
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def precompile_available() -> bool:
    """Whether precompile can compile in parallel here (a CUDA GPU, no interpreter, and a Triton with
    AsyncCompileMode)."""
    return not INTERPRET and torch.cuda.is_available() and _async_compile_mode() is not None


def workers() -> int:
    """Compile threads: the machine's cores, at most 32."""
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def precompile(launches: Iterable[Callable[[], object]], parallel: bool = True) -> int:
    """Call each fn with `launch_kernel` in compile-only mode, the compiles spread over worker threads;
    returns when all have finished (their kernels in the JIT caches). Each fn should make exactly
    the launches its candidate's timing will make (the same call with the same arguments' shapes,
    dtypes and alignment): then those launches compile nothing. Returns how many fns ran (0 with
    `parallel` off or where precompile_available is false: nothing is done)."""
    if not (parallel and precompile_available()):
        return 0
    mode = _async_compile_mode()
    count = 0
    with ThreadPoolExecutor(workers(), thread_name_prefix="triton-compile") as pool:
        # ignore_errors: a failed compile surfaces at the real launch, where the serial path raised it
        with mode(pool, ignore_errors=True):
            token = _COMPILE_ONLY.set(True)
            try:
                for fn in launches:
                    fn()
                    count += 1
            finally:
                _COMPILE_ONLY.reset(token)
    return count


# the thread pool of the innermost parallel_autotune (None: searches compile one config at a time)
_AUTOTUNE_POOL: contextvars.ContextVar[ThreadPoolExecutor | None] = contextvars.ContextVar(
    "salaserve_autotune_pool", default=None)
_autotune_hooked = False


@contextlib.contextmanager
def parallel_autotune(enabled: bool = True):
    """While inside: each autotune search that starts (a key its autotuner has not seen) first
    compiles all its configs in a thread pool, then times them as usual (compiling nothing more).
    The searches' results are Triton's own; only where the compiles happen changes. A no-op where
    precompile_available is false or `enabled` is off."""
    if not (enabled and precompile_available() and _hook_autotuner()):
        yield
        return
    with ThreadPoolExecutor(workers(), thread_name_prefix="triton-autotune-compile") as pool:
        token = _AUTOTUNE_POOL.set(pool)
        try:
            yield
        finally:
            _AUTOTUNE_POOL.reset(token)


def _hook_autotuner() -> bool:
    """Wrap Autotuner.prune_configs (which Triton calls once per new key, before timing the configs
    it returns) so that, inside parallel_autotune, it compiles them first. Idempotent; chains an
    existing wrapper (the compile watch's). False where this Triton lacks what it needs."""
    global _autotune_hooked
    if _autotune_hooked:
        return True
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    if not hasattr(Autotuner, "prune_configs"):
        return False
    prune = Autotuner.prune_configs

    def prune_configs(tuner, kwargs, *args, **kw):
        configs = prune(tuner, kwargs, *args, **kw)
        pool = _AUTOTUNE_POOL.get()
        if pool is not None and len(configs) > 1:
            compile_configs(tuner, configs, kwargs, pool)
        return configs

    Autotuner.prune_configs = prune_configs
    _autotune_hooked = True
    return True


def compile_configs(tuner, configs, kwargs: dict, pool: ThreadPoolExecutor) -> None:
    """Compile `tuner`'s kernel for each config (the positional arguments of the launch being tuned,
    which Autotuner.run keeps in tuner.nargs) in `pool`; returns when all are built. Inside another
    AsyncCompileMode (precompile), or on any error, it leaves the compiles to the timing loop."""
    mode = _async_compile_mode()
    if mode is None or not getattr(tuner, "nargs", None):
        return
    from triton.runtime._async_compile import active_mode
    if active_mode.get() is not None:
        return
    args = list(tuner.nargs.values())
    launch = {k: v for k, v in kwargs.items() if k != "warmup"}
    try:
        with mode(pool, ignore_errors=True):
            for config in configs:
                tuner.fn.warmup(*args, **launch, **config.all_kwargs())
    except Exception as e:  # noqa: BLE001 -- the timing loop compiles (and reports) what this could not
        log.debug("parallel compile of %d autotune configs skipped: %s", len(configs), e)
