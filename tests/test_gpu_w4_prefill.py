"""int4 weights past 16 rows through their fp8 copy on the GPU (w8a16 up to 64 rows, w8a8 on cuBLAS
above): the linear and the backend's junctions against a torch reference of the same math
(per-token e4m3 activations at prefill sizes, the copy's dequantized weights, fp32 products), on
fresh random inputs at full-size shapes."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 tensor cores")]

REL = 2e-2  # bf16 output of an fp32-accumulated fp8 GEMM against the fp32 reference (rel. Frobenius norm)


def _w4(n, k, seed):
    from salaserve.quant import rtn
    from salaserve.quant.formats import fp8_prefill_copy

    g = torch.Generator().manual_seed(seed)
    w = rtn.quantize_w4a16_rtn(torch.randn(n, k, generator=g) * 0.02, 128).to("cuda")
    w.prefill = fp8_prefill_copy(w)
    return w


def _reference(x, w8):
    from salaserve.kernels.quant_gemm import fp8_quantize_rows_ref

    x8, sx = fp8_quantize_rows_ref(x)
    return (x8.float() * sx) @ w8.dequantize(torch.float32).t()


def _rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("m", [65, 512, 3000])
def test_quant_linear_takes_the_fp8_copy_at_prefill_sizes(m):
    from salaserve.kernels.quant_gemm import quant_linear

    w = _w4(4096, 4096, m)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    y = quant_linear(x, w)
    assert y.dtype == torch.bfloat16 and _rel(y, _reference(x, w.prefill)) < REL
    # and not the bf16 dequantization: the fp8 rounding of the weights shows
    bf16_path = x.float() @ w.dequantize(torch.float32).t()
    assert _rel(y, bf16_path) > 1e-3


@pytest.mark.parametrize("m", [17, 24, 64])
def test_quant_linear_takes_the_fp8_copy_past_the_int4_decode_rows(m):
    """Past the int4 decode kernels' 16 rows: the copy's w8a16 GEMV (activations exact)."""
    from salaserve.kernels.quant_gemm import quant_linear

    w = _w4(4096, 4096, m)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    y = quant_linear(x, w)
    assert y.dtype == torch.bfloat16 and _rel(y, x.float() @ w.prefill.dequantize(torch.float32).t()) < REL
    assert _rel(y, x.float() @ w.dequantize(torch.float32).t()) > 1e-3  # not the int4 values


def test_backend_junctions_take_the_fp8_copy():
    from salaserve.kernels.torch_ops import TorchBackend
    from salaserve.kernels.triton_backend import TritonBackend

    be = TritonBackend()
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.randn(700, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    u = torch.randn(700, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    w_in = _w4(2 * 1024, 4096, 1)
    h2, y = be.add_rms_norm_linear(h, u, 0.5, norm_w, 1e-6, w_in)
    ref_h, normed = TorchBackend().add_rms_norm(h, u, 0.5, norm_w, 1e-6)
    assert torch.equal(h2, ref_h)
    assert _rel(y, _reference(normed, w_in.prefill)) < REL
    w_down = _w4(4096, 1024, 2)
    gate_up = torch.randn(700, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    y = be.silu_mul_linear(gate_up, w_down)
    assert _rel(y, _reference(TorchBackend().silu_mul(gate_up), w_down.prefill)) < REL
