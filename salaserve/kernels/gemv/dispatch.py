"""The calibration's picks (PICKS, filled by gemv/tuning.py) and what they decide: the GEMV config a
launch without one takes, the fused ops' included (`choose_config`), and whether `linear` runs the
GEMV or cuBLAS for a plain linear (`uses_gemv`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from salaserve.kernels.gemv.configs import DOT_MAX_M, GemvConfig, default_config
from salaserve.kernels.tuning import PickTable


@dataclass(frozen=True)
class Choice:
    """Calibration of one (M bucket, N, K); times in us per call (CUDA graph, back to back).
    gemv: the fastest GEMV config (used by the fused ops either way); use_gemv: whether `linear`
    takes it (it beat cuBLAS)."""

    gemv: GemvConfig
    gemv_us: float
    cublas_us: float

    @property
    def use_gemv(self) -> bool:
        return self.gemv_us < self.cublas_us


def _choice_encode(c: Choice) -> dict:
    return dict(gemv=dataclasses.asdict(c.gemv), gemv_us=c.gemv_us, cublas_us=c.cublas_us)


def _choice_decode(d: dict) -> Choice:
    return Choice(GemvConfig(**d["gemv"]), float(d["gemv_us"]), float(d["cublas_us"]))


# (device, M bucket, N, K) -> Choice, filled by `calibrate`
PICKS = PickTable("gemv", _choice_encode, _choice_decode)


def calibrated_choice(M: int, N: int, K: int, device) -> Choice | None:
    """The calibration's Choice for M rows (its bucket) at [N, K], or None."""
    return PICKS.get(device, M, (N, K))


def choose_config(M: int, N: int, K: int, device: torch.device) -> GemvConfig:
    """The calibrated GEMV config for this shape (kept even where cuBLAS won: the fused ops still
    need one), else the default."""
    c = PICKS.get(device, M, (N, K))
    return c.gemv if c is not None else default_config(M, N, K)


def uses_gemv(M: int, N: int, K: int, device: torch.device) -> bool:
    """Whether `linear` takes the GEMV for this shape: the calibrated winner (1 <= M <= DOT_MAX_M),
    or (uncalibrated) 1 <= M <= 8 (the GEMV reads the weights once for any M; at M = 1 a plain
    Triton GEMV beat cuBLAS on all four anchor shapes)."""
    if not 1 <= M <= DOT_MAX_M:
        return False
    c = PICKS.get(device, M, (N, K))
    if c is not None:
        return c.use_gemv
    return M <= 8


def clear_calibration() -> None:
    PICKS.clear()
