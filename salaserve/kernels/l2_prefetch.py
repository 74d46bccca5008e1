"""Asking L2 for bytes that a later kernel will read (sm_90+): a hint, with no effect on any value.

    plan = prefetch_plan([(tensor, first_byte, n_bytes), ...])   chunks of those byte ranges
    prefetch_l2(plan)                                             one fire-and-forget kernel

Why: at batch 1 the int4 GEMVs stream 8-67 MB each at ~76% of the copy bandwidth and pay a fixed
~3 us (first DRAM round trip, split-K tail), while the kernels between them (attention, norms,
silu_mul: ~0.5 ms of the step) leave DRAM idle. Bytes asked for while those run arrive in L2 before
the GEMV reads them (H200 L2: 50 MB).

Each lane of the kernel issues one `cp.async.bulk.prefetch.L2.global` (the TMA unit walks the
chunk; nothing comes back to the SM and nothing waits) or, with BULK off, one
`prefetch.global.L2` per 128-byte line of its chunk. Chunks are spread over many programs so that
many SMs issue them: one SM's request rate is far below DRAM's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LINE = 128  # bytes per prefetch.global.L2
ALIGN = 16  # cp.async.bulk: 16-byte aligned address and size


@dataclass(frozen=True)
class PrefetchPlan:
    """Chunks of device memory to ask L2 for: addresses and sizes (bytes), one chunk per lane."""
    addrs: torch.Tensor  # int64 [n]
    sizes: torch.Tensor  # int32 [n]
    nbytes: int  # the sum of sizes
    largest: int  # the largest chunk (known on the host: no sync at launch, so graphs can capture it)

    def __len__(self) -> int:
        return int(self.addrs.numel())


def prefetch_plan(ranges, chunk: int = 16 << 10, device=None) -> PrefetchPlan:
    """Chunks of at most `chunk` bytes covering each (tensor, first_byte, n_bytes) range of a tensor's
    storage (ranges outside the tensor's bytes are refused). Range ends are rounded out to 16 bytes,
    which stays inside the allocation (torch allocations are 512-byte aligned)."""
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk must be a positive multiple of {ALIGN} bytes, got {chunk}")
    addrs, sizes = [], []
    for t, first, n in ranges:
        total = t.numel() * t.element_size()
        if not t.is_contiguous():
            raise ValueError("prefetch ranges must be of contiguous tensors")
        if first < 0 or n < 0 or first + n > total:
            raise ValueError(f"byte range [{first}, {first + n}) outside the tensor's {total} bytes")
        if n == 0:
            continue
        lo = t.data_ptr() + first
        hi = t.data_ptr() + first + n
        lo -= lo % ALIGN
        hi += -hi % ALIGN
        for a in range(lo, hi, chunk):
            addrs.append(a)
            sizes.append(min(chunk, hi - a))
        device = device or t.device
    device = device or "cpu"
    return PrefetchPlan(torch.tensor(addrs, dtype=torch.int64, device=device),
                        torch.tensor(sizes, dtype=torch.int32, device=device), int(sum(sizes)), max(sizes, default=0))


def split_front_ranges(t: torch.Tensor, splits: int, rows_per_split: int, fraction: float) -> list[tuple]:
    """(t, first_byte, n_bytes) ranges of the first `fraction` of each split's rows of a row-major
    t whose rows a split-K GEMV divides into `splits` runs of rows_per_split (the last one short):
    what all of its programs read first, since they run at once and advance together."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    rows = t.shape[0]
    row_bytes = t.numel() * t.element_size() // rows
    out = []
    for s in range(splits):
        begin = s * rows_per_split
        if begin >= rows:
            break
        n = min(rows, begin + rows_per_split) - begin
        take = min(n, -(-int(n * fraction * 1024) // 1024))  # rounded up, so a fraction of 1 is every row
        if take:
            out.append((t, begin * row_bytes, take * row_bytes))
    return out


@triton.jit
def _l2_prefetch_kernel(addr_ptr, size_ptr, n, BLOCK: tl.constexpr, BULK: tl.constexpr, LINES: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    a = tl.load(addr_ptr + i, mask=ok, other=0)
    s = tl.load(size_ptr + i, mask=ok, other=0)
    if BULK:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", args=[a, s], dtype=tl.int32, is_pure=False, pack=1)
    else:
        line = tl.arange(0, LINES)[None, :] * 128
        on = (line < s[:, None]).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", args=[a[:, None] + line, on], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_supported(device) -> bool:
    """Whether prefetch_l2 issues anything on this device (sm_90+ CUDA, not the interpreter)."""
    d = torch.device(device)
    return (d.type == "cuda" and not _INTERPRET and torch.cuda.is_available()
            and torch.cuda.get_device_capability(d) >= (9, 0))


def prefetch_l2(plan: PrefetchPlan, lanes: int = 32, bulk: bool = True) -> None:
    """Ask L2 for the plan's chunks: one kernel of len(plan) / lanes programs, nothing waits for
    the bytes. A no-op where prefetch_supported is false (CPU, the interpreter, before sm_90)."""
    if len(plan) == 0 or not prefetch_supported(plan.addrs.device):
        return
    lines = 1
    if not bulk:
        lines = triton.next_power_of_2(max(1, -(-plan.largest // LINE)))
    _l2_prefetch_kernel[(triton.cdiv(len(plan), lanes),)](plan.addrs, plan.sizes, len(plan), BLOCK=lanes,
                                                          BULK=bulk, LINES=lines, num_warps=max(1, lanes // 32))
