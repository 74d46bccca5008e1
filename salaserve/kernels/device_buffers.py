"""Scratch buffers the kernels keep per device (the GEMVs' split-K partials and tile counters, the
dp2a GEMV's x scratch). Kernels on one stream run in order, so one set per device is shared by
all launches. A CUDA graph keeps the pointers it captured: buffers grow only outside capture, and
outgrown ones stay alive for the graphs that captured them."""

from __future__ import annotations

from typing import NamedTuple

import torch

_RETIRED: list[tuple[torch.Tensor, ...]] = []  # outgrown sets, kept for graphs captured with them


class Want(NamedTuple):
    numel: int  # what this launch needs
    minimum: int  # the size a buffer starts at (room for every launch the model makes)
    dtype: torch.dtype
    zeroed: bool = False  # allocated as zeros (counters the kernels re-arm themselves)


def persistent_buffers(cache: dict, device: torch.device, wants: tuple[Want, ...],
                       what: str) -> tuple[torch.Tensor, ...]:
    """cache[str(device)]: one 1-D buffer per Want, each at least its numel long. When one is too
    short, all are made again at max(numel, minimum, their old size) (growth during CUDA-graph
    capture is refused with an error naming `what`)."""
    key = str(device)
    have = cache.get(key)
    if have is not None and all(b.numel() >= w.numel for b, w in zip(have, wants)):
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} must grow during CUDA-graph capture: run this shape once (or calibrate) "
                           "before capturing")
    if have is not None:
        _RETIRED.append(have)
    old = have or (None,) * len(wants)
    bufs = tuple((torch.zeros if w.zeroed else torch.empty)(
        max(w.numel, w.minimum, 1, 0 if b is None else b.numel()), dtype=w.dtype, device=device)
        for b, w in zip(old, wants))
    cache[key] = bufs
    return bufs
