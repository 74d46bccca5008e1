"""The quantization format registry (salaserve/quant/formats/): a format defined in this file (int8
weights, one scale per output channel, reference matmul only) and registered at run time is
quantized on load, fused, and served by the engine on CPU, with nothing else of the package changed.
A format shipped with salaserve would be its module plus its line in formats.FORMATS (and, with GPU
kernels, one line in kernels/quant_gemm/dispatch.py's LINEAR_KERNELS)."""

import pytest
import torch

from salaserve.config import EngineArgs, ModelConfig
from salaserve.engine.llm import LLM
from salaserve.engine.runner import ModelRunner
from salaserve.core.sampling_params import SamplingParams
from salaserve.core.weights import WeightLoadError
from salaserve.model.loader import load_state_dict
from salaserve.model.reference import ReferenceModel
from salaserve.quant import formats
from salaserve.quant.formats import Format, QuantizedLinearWeights
from salaserve.quant.load import dequantize_state_dict
from salaserve.quant.quality import prompt_logits

CPU = dict(device="cpu", dtype="float32", backend="torch")


class Int8Format(Format):
    """int8 weight-only: W = q * scale[n], q in [-127, 127], scale = amax(|W[n]|) / 127."""

    name = "int8"

    def quantize(self, weight, scheme):
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedLinearWeights(self.name, w.shape[1], w.shape[0], weight=q, scale=scale)

    def dequantize(self, w, dtype):
        return (w.weight.float() * w.scale[:, None]).to(dtype)


@pytest.fixture
def int8():
    fmt = formats.register(Int8Format())
    yield fmt
    formats.unregister(fmt.name)


def test_a_format_defined_outside_the_package_quantizes_on_load_and_serves(tiny_model_dir, int8):
    assert "int8" in formats.quantization_choices()
    llm = LLM(tiny_model_dir, **CPU, max_running_requests=1, quantization="int8")
    p = llm.engine.runner.model.p
    qkvg, down = p["layers"][0]["qkvg"], p["layers"][0]["down"]
    assert isinstance(qkvg, QuantizedLinearWeights) and qkvg.format == "int8" and qkvg.weight.dtype == torch.int8
    cfg = ModelConfig.from_pretrained(tiny_model_dir)
    assert qkvg.out_features == 2 * cfg.q_size + 2 * cfg.kv_size  # q / k / v / o_gate fused by the default concat
    assert down.format == "int8" and isinstance(p["lm_head"], torch.Tensor)  # lm_head stays unquantized
    out = llm.generate("import os\n", SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert len(out.token_ids) == 6

    # the engine's logits are the reference model's on the same weights dequantized
    weights = load_state_dict(tiny_model_dir, cfg, torch.float32, quantization="int8")
    ref = ReferenceModel(cfg, dequantize_state_dict(weights, torch.float32))
    runner = ModelRunner(EngineArgs(model=tiny_model_dir, **CPU, max_running_requests=1, max_total_tokens=1024,
                                    quantization="int8"), tiny_model_dir)
    ids = list(range(3, 80))
    got, want = prompt_logits(runner, ids), ref.forward(ids, ref.new_state())
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    # and int8 rounding moved them, but little
    plain = ReferenceModel(cfg, load_state_dict(tiny_model_dir, cfg, torch.float32))
    base = plain.forward(ids, plain.new_state())
    rel = ((want - base).norm() / base.norm()).item()
    assert 0 < rel < 0.05, rel


def test_an_unregistered_format_is_refused(tiny_model_dir):
    with pytest.raises(WeightLoadError, match="quantization must be one of"):
        load_state_dict(tiny_model_dir, ModelConfig.from_pretrained(tiny_model_dir), torch.float32,
                        quantization="int8")
    with pytest.raises(ValueError, match="unknown weight format"):
        QuantizedLinearWeights("int8", 4, 4, weight=torch.zeros(4, 4, dtype=torch.int8))
