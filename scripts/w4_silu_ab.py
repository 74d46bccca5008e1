"""The dp2a GEMV's silu_mul epilogue against the same kernel plus the silu_mul kernel, at gate_up's shape,
one row (GPU only).

    python scripts/w4_silu_ab.py

calibrate_w4 picks gate_up's one-row config and split; then, in CUDA graphs over L2-busting weight
copies (calibrate_w4's timing): the plain kernel, the plain kernel followed by fused.silu_mul (what a
step runs without the epilogue), and the kernel with SILU_OUT. The epilogue's output is first checked
against silu_mul of the plain output (rel err < 1e-3: the same sums and roundings but exp's last bit).
"""

from __future__ import annotations

import dataclasses

import torch

from salaserve.config import preset_config
from salaserve.kernels import fused
from salaserve.kernels import quant_gemm as Q
from salaserve.kernels.timing import graph_time_us, l2_busting_count
from salaserve.quant import rtn


def main():
    cfg = preset_config("full")
    N, K = 2 * cfg.intermediate_size, cfg.hidden_size
    w = rtn.quantize_w4a16_rtn(torch.randn(N, K, device="cuda") * K ** -0.5, 128)
    n = l2_busting_count(w.qweight.nbytes)
    copies = [dataclasses.replace(w, qweight=torch.randint_like(w.qweight, -2**31, 2**31 - 1)) for _ in range(n)]
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    Q.calibrate_w4([w], "cuda", m_values=(1,))
    kind, config, split = Q.w4_decode_choice(x, w)
    assert kind == "dp2a", kind
    want = fused.silu_mul(Q.w4a16_gemv_dp2a(x, w, config=config, split_k=split)).float()
    got = Q.w4a16_gemv_dp2a(x, w, config=config, split_k=split, silu_out=True).float()
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-3, rel

    def plain(i):
        return Q.w4a16_gemv_dp2a(x, copies[i % n], config=config, split_k=split)

    t_plain = graph_time_us(plain, calls=max(8, n))
    t_two = graph_time_us(lambda i: fused.silu_mul(plain(i)), calls=max(8, n))
    t_epi = graph_time_us(lambda i: Q.w4a16_gemv_dp2a(x, copies[i % n], config=config, split_k=split, silu_out=True),
                          calls=max(8, n))
    print(f"gate_up {N}x{K}, one row, dp2a {config} split {split}: epilogue rel err {rel:.1e}")
    print(f"  plain {t_plain:.1f} us | plain + silu_mul kernel {t_two:.1f} us | with the epilogue {t_epi:.1f} us")


if __name__ == "__main__":
    main()
