"""The tensor-parallel process group: who this rank is and the collectives the model needs.

One TPGroup per engine process. With one rank it is SINGLE: every collective returns its input
and no torch.distributed group exists, so the default path costs nothing. With N ranks it wraps
a torch.distributed group: NCCL on CUDA (one GPU per rank), gloo on the CPU. The options come as
arguments (backend, world size, rank, a tcp:// init method with its free port, a timeout);
nothing here reads the environment.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    backend: str | None = None  # "nccl" | "gloo"; None for one rank
    group: object = None  # the torch.distributed ProcessGroup; None for one rank

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place (the same values on every rank afterwards)."""
        if self.size > 1:
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank's t becomes rank src's, in place."""
        if self.size > 1:
            torch.distributed.broadcast(t, src=src, group=self.group)
        return t

    def min_int(self, value: int, device) -> int:
        """The smallest of the ranks' values (e.g. the KV pages every rank has room for)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def destroy(self) -> None:
        """Leave torch.distributed (the whole group, with any sub-groups split from it). A sub-group
        (split_group) does nothing here: it goes with its parent."""
        if (self.size > 1 and torch.distributed.is_initialized()
                and self.group is torch.distributed.group.WORLD):
            torch.distributed.destroy_process_group()
            self.group = None


SINGLE = TPGroup()


def split_group(group: TPGroup, parts: int) -> TPGroup:
    """This rank's sub-group when group's ranks are cut into `parts` runs of consecutive ranks (the
    ranks that replicate one KV head: shard.kv_replicas). Collective: every rank of group must call
    it, since torch.distributed.new_group is called by all ranks for every run, in the same order.
    Its all_reduce is what the sub-group is for (broadcast's src would be a global rank)."""
    if group.size % parts:
        raise ValueError(f"{group.size} ranks do not split into {parts} equal sub-groups")
    per = group.size // parts
    mine = None
    for p in range(parts):
        ranks = list(range(p * per, (p + 1) * per))
        handle = torch.distributed.new_group(ranks, backend=group.backend)
        if group.rank in ranks:
            mine = TPGroup(group.rank - p * per, per, group.backend, handle)
    return mine


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_init_method(host: str = "127.0.0.1") -> str:
    """A tcp:// address on a port free right now, for the ranks' rendezvous (rank 0 listens)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def init_group(rank: int, size: int, backend: str, init_method: str, timeout_s: float) -> TPGroup:
    """Join the ranks' group (blocks until all `size` ranks arrive, at most timeout_s). Collectives
    that wait longer than timeout_s for a rank raise instead of hanging."""
    if size == 1:
        return SINGLE
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside [0, {size})")
    if torch.distributed.is_initialized():  # the group is the process's default one
        raise RuntimeError("a tensor-parallel engine is already running in this process (one per process): "
                           "shut it down first (LLM.shutdown / Engine.shutdown)")
    torch.distributed.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                                         timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, size, backend, torch.distributed.group.WORLD)
