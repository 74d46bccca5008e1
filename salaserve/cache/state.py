"""Lightning (simple-GLA) recurrent state slots: one slot per running request.

state: [num_slots, n_lightning_layers, heads, head_dim_k, head_dim_v], fp32 by default (HF keeps
the state in fp32; spec 4.4). 48 MiB per slot at full size: slots bound concurrency.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_slots: int, n_layers: int, heads: int, head_dim: int, dtype, device):
        if num_slots <= 0:
            raise ValueError(f"need at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self.state = torch.zeros(num_slots, n_layers, heads, head_dim, head_dim, dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        # called with each slot alloc() zeroes (tensor parallelism: rank 0 tells the other ranks,
        # whose pools are not allocated from)
        self.on_alloc = None

    @staticmethod
    def bytes_per_slot(n_layers, heads, head_dim, dtype) -> int:
        return n_layers * heads * head_dim * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.state[slot].zero_()  # a new sequence starts from S = 0
        if self.on_alloc is not None:
            self.on_alloc(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} freed twice or never allocated")
        self._free.append(slot)
