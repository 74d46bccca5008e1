"""kernels/device_buffers.py: the per-device scratch the GEMVs share (CPU)."""

import torch

from salaserve.kernels import device_buffers as B


def test_buffers_are_reused_grown_together_and_outgrown_ones_kept_alive():
    cache = {}
    dev = torch.device("cpu")
    counters = B.Want(3, 0, torch.int32, zeroed=True)
    ws, cnt = B.persistent_buffers(cache, dev, (B.Want(10, 64, torch.float32), counters), "t")
    assert (ws.numel(), cnt.numel()) == (64, 3) and ws.dtype == torch.float32 and (cnt == 0).all()
    again = B.persistent_buffers(cache, dev, (B.Want(64, 64, torch.float32), B.Want(2, 0, torch.int32)), "t")
    assert again[0] is ws and again[1] is cnt  # big enough: the same tensors (a graph's pointers stay valid)
    grown = B.persistent_buffers(cache, dev, (B.Want(10, 64, torch.float32), counters._replace(numel=5)), "t")
    assert (grown[0].numel(), grown[1].numel()) == (64, 5)  # never smaller than before
    assert any(old[0] is ws and old[1] is cnt for old in B._RETIRED)
    assert all(a is b for a, b in zip(cache[str(dev)], grown)) and (grown[1] == 0).all()
