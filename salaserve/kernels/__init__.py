"""Kernel backends: every op the serving model calls, behind one interface.

`torch`: plain PyTorch (CPU and GPU), the ground truth. `triton`: fused GPU kernels with the same
methods; it falls back to the torch implementation for anything it does not override. The triton
backend keeps the engine's KernelOptions (kernels/options.py) for its start-up work.
"""

from __future__ import annotations

import torch

from salaserve.kernels.options import INTERPRET, KernelOptions


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return name


def get_backend(name: str, device: torch.device, options: KernelOptions | None = None):
    """The backend `name` ("auto" resolved for `device`); options: the triton backend's kernel
    choices (default KernelOptions())."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from salaserve.kernels.torch_ops import TorchBackend

        return TorchBackend()
    if name == "triton":
        # on CPU only under the Triton interpreter (tests of the kernels' integration)
        if device.type != "cuda" and not INTERPRET:
            raise ValueError("the triton backend needs a CUDA device; use backend='torch' on CPU")
        from salaserve.kernels.triton_backend import TritonBackend

        return TritonBackend(options)
    raise ValueError(f"unknown kernel backend {name!r} (expected 'torch', 'triton' or 'auto')")
