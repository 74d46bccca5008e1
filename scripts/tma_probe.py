"""Which tensor-descriptor loads launch on this GPU's Triton (runs 117-119: every w4_tma launch faulted
with "misaligned address"). One probe per process (a CUDA fault is sticky):

    python scripts/tma_probe.py PROBE [--asm DIR]

Probes, each on an int32 [K / 8, N] tensor like the int4 weights, summing a [16, BLOCK_N] tile per
step over one K range and comparing with torch:
- `host1`: a host TensorDescriptor, one load, no loop;
- `host_loop`: the same in a pipelined loop (num_stages 4);
- `host_loop_x`: plus a plain per-row load of a second array in the loop (w4_tma's x words);
- `device_loop`: a descriptor made in the kernel (tl.make_tensor_descriptor, triton.set_allocator).
With --asm, the compiled kernel's ttgir and ptx are written there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

import os

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # the interpreter runs the probes on the CPU


@triton.jit
def _one_tile(desc, out_ptr, BLOCK_N: tl.constexpr):
    col0 = tl.program_id(0) * BLOCK_N
    w = desc.load([0, col0])
    tl.store(out_ptr + col0 + tl.arange(0, BLOCK_N), tl.sum(w, axis=0))


@triton.jit
def _loop(desc, x_ptr, out_ptr, K8, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, WITH_X: tl.constexpr):
    col0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, 16)
    acc = tl.zeros((16, BLOCK_N), tl.int32)
    for r0 in tl.range(0, K8, 16, num_stages=STAGES):
        w = desc.load([r0, col0])
        if WITH_X:
            w = w * tl.load(x_ptr + r0 + rows)[:, None]
        acc += w
    tl.store(out_ptr + col0 + tl.arange(0, BLOCK_N), tl.sum(acc, axis=0))


@triton.jit
def _device_loop(w_ptr, out_ptr, K8, N, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    desc = tl.make_tensor_descriptor(w_ptr, shape=[K8, N], strides=[N, 1], block_shape=[16, BLOCK_N])
    col0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((16, BLOCK_N), tl.int32)
    for r0 in tl.range(0, K8, 16, num_stages=STAGES):
        acc += desc.load([r0, col0])
    tl.store(out_ptr + col0 + tl.arange(0, BLOCK_N), tl.sum(acc, axis=0))


def main():
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser()
    ap.add_argument("probe", choices=["host1", "host_loop", "host_loop_x", "device_loop"])
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--asm", default=None)
    a = ap.parse_args()
    K8, N, bn = 512, 4096, a.block_n
    w = torch.randint(-100, 100, (K8, N), dtype=torch.int32, device=DEV)
    x = torch.randint(-3, 3, (K8,), dtype=torch.int32, device=DEV)
    out = torch.zeros(N, dtype=torch.int32, device=DEV)
    grid = (N // bn,)
    try:
        if a.probe == "host1":
            k = _one_tile[grid](TensorDescriptor.from_tensor(w, [16, bn]), out, BLOCK_N=bn, num_warps=4)
            ref = w[:16].sum(0)
        elif a.probe.startswith("host_loop"):
            with_x = a.probe == "host_loop_x"
            k = _loop[grid](TensorDescriptor.from_tensor(w, [16, bn]), x, out, K8, BLOCK_N=bn, STAGES=4,
                            WITH_X=with_x, num_warps=4)
            ref = (w * x[:, None]).sum(0) if with_x else w.sum(0)
        else:
            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEV))
            k = _device_loop[grid](w, out, K8, N, BLOCK_N=bn, STAGES=4, num_warps=4)
            ref = w.sum(0)
        torch.cuda.synchronize() if DEV == "cuda" else None
        print(f"probe {a.probe} bn={bn}: {'ok' if torch.equal(out, ref) else 'WRONG'}", flush=True)
        if a.asm:
            for ext in ("ttgir", "ptx"):
                Path(a.asm, f"{a.probe}-{bn}.{ext}").write_text(k.asm[ext])
    except Exception as e:  # noqa: BLE001 - a probe reports whatever fails
        print(f"probe {a.probe} bn={bn}: FAIL {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
