"""The kernel choices of one engine, as one value passed down, and the Triton interpreter flag.

    KernelOptions.from_engine_args(args)   built once by the model runner from EngineArgs
    get_backend(name, device, options)     the backend keeps it; prepare_weights, prepare and the
                                           start-up calibration (kernels/tuning.py) read it there

The kernels themselves take no switches: every dispatch runs the variant the start-up calibration
measured fastest for its shape. What is left are trade-offs a user makes:

  w4_wgmma          int4 weights on the GPU: a repacked copy of each linear (qweight's bytes again)
                    for the wgmma decode GEMV at 4-16 rows; False gives that memory to KV pages
                    (the FMA kernel up to 4 rows and the tl.dot GEMV above)
  w4a16_prefill     int4 weights at prefill sizes: "fp8" (an fp8 copy, w8a8 on fp8 tensor cores,
                    sm_89+) or "bf16" (the int4 weights dequantized for a bf16 GEMM)
  plan_cache_dir    where the calibration's picks are kept across restarts (kernels/plan_cache.py);
                    None: no plans, every start-up calibrates
  parallel_compile  the calibration's candidates and the warm-up's autotune configs compile in a
                    thread pool before they are timed (kernels/compile_ahead.py); False: one
                    compile at a time, at first launch

This module imports nothing but the standard library, so the torch backend and the engine can
build options without importing Triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Triton's own interpreter switch (TRITON_INTERPRET=1, set before triton is first imported): the
# Triton kernels then run on CPU tensors (the CPU tests), and the launchers take their
# interpreter-safe branches (no inline PTX, no PDL, fp32 dots). The one environment read of
# salaserve/kernels; every kernel module reads this constant.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

DEFAULT_PLAN_CACHE_DIR = "~/.cache/salaserve/plans"
W4A16_PREFILL_CHOICES = ("fp8", "bf16")


@dataclass(frozen=True)
class KernelOptions:
    """The kernel trade-offs of one engine (see the module docstring)."""

    w4_wgmma: bool = True
    w4a16_prefill: str = "fp8"
    plan_cache_dir: Optional[str] = DEFAULT_PLAN_CACHE_DIR
    parallel_compile: bool = True

    def __post_init__(self):
        if self.w4a16_prefill not in W4A16_PREFILL_CHOICES:
            raise ValueError(f"w4a16_prefill must be one of {W4A16_PREFILL_CHOICES}, got {self.w4a16_prefill!r}")

    @classmethod
    def from_engine_args(cls, args) -> "KernelOptions":
        """The options an EngineArgs asks for."""
        return cls(w4_wgmma=args.w4_wgmma, w4a16_prefill=args.w4a16_prefill, plan_cache_dir=args.plan_cache_dir,
                   parallel_compile=args.parallel_compile)

    def plan_dir(self) -> Optional[Path]:
        """The plans' directory (user home expanded), or None with plans off."""
        return None if self.plan_cache_dir is None else Path(self.plan_cache_dir).expanduser()

    def pick_switches(self) -> dict:
        """The options that change which candidates the calibration offers, so that picks made under
        other values may be stale: part of the plan cache's fingerprint."""
        return {"w4_wgmma": self.w4_wgmma}
