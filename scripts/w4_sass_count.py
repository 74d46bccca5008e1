"""Instructions per nibble in the sm_90 SASS of the w4 decode GEMV's main loop (no GPU needed).

    .venv/bin/python scripts/w4_sass_count.py [BLOCK_N,BLOCK_R,WARPS,PREFETCH ...] [--m 1] [--dump]

Compiles `_w4_gemv_fma_kernel` ahead of time for sm_90 as the launcher would at the model's shapes
(bf16 x as int32 pairs, group 128, split-K 4, N and K whole tiles), disassembles the cubin with
triton's bundled nvdisasm, takes the backward branch with the largest body as the main loop and
prints its instruction count per nibble (nibbles per thread per tile = BLOCK_R * 8 * BLOCK_N
/ (32 * warps), times the tiles of an unrolled iteration, told by its fma count), the registers
and the loop's per-opcode counts (--dump: its SASS).
Default configs: W4_FMA_CONFIGS[M].
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import triton  # noqa: E402
from kernel_checks import compile_sm90, cubin_resources  # noqa: E402

from salaserve.kernels import quant_gemm as qg  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
PTRS = dict(x_ptr="*bf16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", perm_ptr="*i32",
            out_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32")
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_kernel(cfg, block_m: int = 1, pdl: bool = False):
    block_n, block_r, warps, prefetch = cfg
    constexprs = dict(GROUP_SIZE=128, X_PERM=False, X_PAIRS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                      SPLIT_K=4, **qg.w4_fma_layout(block_n, block_r, warps), EVEN=True, PREFETCH=prefetch, PDL=pdl)
    return compile_sm90(qg._w4_gemv_fma_kernel, PTRS, constexprs, warps, fp_fusion=True, divisible=("N", "K"))


def sass(kernel) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, predicate and operands) of every instruction in the cubin,
    branch targets rewritten from labels to addresses."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(NVDISASM), "-c", f.name], capture_output=True, text=True, check=True).stdout
    insns, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            insns.append((addr, m.group(3), ((m.group(2) or "") + m.group(4)).strip()))
    return [(a, op, re.sub(r"`\((\.L_x_\d+)\)", lambda t: hex(labels.get(t.group(1), -1)), rest))
            for a, op, rest in insns]


def main_loop(insns):
    """The instructions of the backward branch with the largest body, [target, branch]."""
    best = None
    for addr, op, rest in insns:
        m = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            if best is None or addr - lo > best[1] - best[0]:
                best = (lo, addr)
    if best is None:
        raise SystemExit("no backward branch: no loop found")
    return [i for i in insns if best[0] <= i[0] <= best[1]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", help="BLOCK_N,BLOCK_R,WARPS,PREFETCH")
    ap.add_argument("--m", type=int, default=1, help="BLOCK_M (1, 2 or 4)")
    ap.add_argument("--dump", action="store_true", help="print the loop's SASS")
    args = ap.parse_args()
    cfgs = [tuple(int(v) for v in c.split(",")) for c in args.configs] or list(qg.W4_FMA_CONFIGS[args.m])
    for cfg in cfgs:
        kernel = compile_kernel(cfg, args.m)
        loop = main_loop(sass(kernel))
        block_n, block_r, warps, _ = cfg
        nibbles = block_r * 8 * block_n // (32 * warps)
        # an unrolled loop holds several tiles: one fma per nibble and x row, plus 12-25% for the groups
        tiles = max(1, int(sum(op.startswith("FFMA") for _, op, _ in loop) / (nibbles * args.m)))
        res = cubin_resources(kernel) or {}
        print(f"{cfg} M={args.m}: {len(loop)} loop instructions / ({tiles} x {nibbles}) nibbles per thread = "
              f"{len(loop) / (tiles * nibbles):.2f} per nibble; regs {res.get('REG')}, stack {res.get('STACK', 0)}")
        ops = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
        if args.dump:
            for addr, op, rest in loop:
                print(f"   {addr:05x} {op} {rest}")


if __name__ == "__main__":
    main()
