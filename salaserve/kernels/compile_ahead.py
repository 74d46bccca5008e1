"""The start-up calibration's Triton compiles, many at once in threads instead of one by one.

    precompile(fn() for each candidate)       compiles what each fn would launch, runs none of it
    launch_kernel(kernel, grid, *args, **kw)  kernel[grid](*args, **kw); inside precompile, its compile only

Why: the calibration times every candidate (config x split-K, each a separate Triton
specialisation), and with an empty kernel cache their compiles, one after another, were most of a
quantized engine's first start-up (w4a16: 389 s cold one at a time, 188 s in threads). Triton's compiler releases the GIL: two threads compiled 8 dp2a variants for sm_90
in 7.5 s against 14.5 s serially on a 2-core machine. `triton.runtime._async_compile.
AsyncCompileMode` hands each compile to an executor. So precompile runs each candidate's launch
once with `launch_kernel` in compile-only mode (`kernel.warmup`), the compiles go to a thread pool,
and on leaving it every kernel sits in its JIT cache: the timing loop that follows compiles nothing.

The calibrated kernels' launches go through `launch_kernel`. A compile that fails inside precompile
fails again, with its error, at the candidate's real launch. Without AsyncCompileMode (a Triton
that lacks it), without a GPU, under the interpreter, or with KernelOptions.parallel_compile off
(`--no-parallel-compile`), precompile does nothing and the compiles happen one by one at the first
launches.
"""

from __future__ import annotations

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
