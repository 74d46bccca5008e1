"""The fp8-page decode split kernel compiled by this machine's Triton for sm_90, per variant (fp16 dots with
Triton's cast or DECODE_FP8_REG_CVT's inline-asm convert; 1 or 3 pipeline stages): PTX size, shared-memory
byte loads, ldmatrix (.trans), registers and spills (cuobjdump). Used by scripts/device_runs/gpu_session27_d.sh."""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import triton.language as tl  # noqa: E402
from test_kernels_attention import _compile_sm90  # noqa: E402

from salaserve.kernels import attention as A  # noqa: E402

bf, pool = "*bf16", "*fp8e4nv"
ptrs = dict(K_pool=pool, V_pool=pool, Q=bf, Out=bf, page_table="*i32", cu_seqlens_q="*i32", seq_lens="*i32",
            K_scale="*fp32", V_scale="*fp32", block_table="*i32", block_count="*i32", O_part="*fp32",
            LSE_part="*fp32")
for reg_cvt in (False, True):
    for stages in (1, 3):
        k, res = _compile_sm90(A._decode_split_kernel, ptrs, dict(
            GROUP=16, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=64, NUM_SPLITS=16, DOT_PREC=None, KV_FP8=True,
            COMPUTE_DT=tl.bfloat16, HKV=2, F16_DOTS=True, DOT_DT=tl.float16, REG_CVT=reg_cvt),
            num_warps=4, num_stages=stages)
        p = k.asm["ptx"]
        use = " ".join(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res) and
                       [f"{a}={b}" for a, b in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)])
        print(f"reg_cvt={int(reg_cvt)} stages={stages}: ptx {p.count(chr(10))} lines, ld.shared.b8 "
              f"{p.count('ld.shared.b8')}, ldmatrix {p.count('ldmatrix')} (.trans {p.count('.trans.')}), "
              f"cp.async {p.count('cp.async.c')}, bar.sync {p.count('bar.sync')}, {use}")
