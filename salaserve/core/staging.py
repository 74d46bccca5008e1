"""One host-to-device copy of a step's metadata arrays.

`to_device` packs a step's small int64 / int32 / bool arrays into one pinned host buffer (every
field 16-byte aligned), copies it once and hands back views of the device copy. On the CPU the
arrays are shared as they are.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


class _PinnedRing:
    """Pinned host buffers reused across steps (allocating pinned memory per step cost more than
    the copy itself). A buffer is written again only after the copy that read it has finished
    (an event recorded behind it): builds may run ahead of the GPU, e.g. prefill chunks."""

    def __init__(self, slots: int = 8):
        self.bufs: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            self.bufs[i] = torch.empty(max(2 * nbytes, 1 << 16), dtype=torch.uint8, pin_memory=True)
        return i, self.bufs[i][:nbytes]

    def copied(self, i: int) -> None:
        if self.events[i] is None:
            self.events[i] = torch.cuda.Event()
        self.events[i].record()


_RING = _PinnedRing()


STAGED_ALIGN = 16  # bytes


def staged_layout(arrays: list[np.ndarray]) -> tuple[list[tuple[int, int]], int]:
    """Where each array goes in one byte buffer: (start byte, element count) per array, every start
    a multiple of 16. Triton specialises a pointer argument by whether it is 16-byte aligned: packed
    back to back, a field's alignment would follow the step's token and sequence counts, and a step
    with new parities would compile new kernels. Returns (the places, total bytes)."""
    layout, nbytes = [], 0
    for a in arrays:
        if a.dtype not in _DTYPES:
            raise TypeError(f"to_device takes int64, int32 and bool arrays, got {a.dtype}")
        layout.append((nbytes, a.size))
        nbytes += -(-a.size * a.dtype.itemsize // STAGED_ALIGN) * STAGED_ALIGN
    return layout, max(nbytes, STAGED_ALIGN)


def pack_staged(arrays: list[np.ndarray], layout: list[tuple[int, int]], raw: np.ndarray) -> None:
    """Write the arrays into the uint8 buffer `raw` at their places in `layout`."""
    for a, (start, n) in zip(arrays, layout):
        raw[start:start + n * a.dtype.itemsize].view(a.dtype)[:] = a.reshape(-1)


def staged_views(buf: torch.Tensor, arrays: list[np.ndarray], layout: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The arrays as views of the uint8 tensor `buf` (a copy of the packed buffer), in their shapes."""
    return [buf[start:start + n * a.dtype.itemsize].view(_DTYPES[a.dtype]).view(a.shape)
            for a, (start, n) in zip(arrays, layout)]


def to_device(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """The arrays (int64, int32 or bool) as tensors on `device`. On a GPU through one pinned host
    buffer and one copy: a step's metadata is ~10 small arrays, and a copy each cost more host
    time than the rest of the batch build; each tensor is a view of the one device buffer. On
    the CPU the arrays are shared as they are."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    layout, nbytes = staged_layout(arrays)
    slot, host = _RING.take(nbytes)
    pack_staged(arrays, layout, host.numpy())
    buf = host.to(dev, non_blocking=True)
    _RING.copied(slot)
    return staged_views(buf, arrays, layout)
