"""The bf16 format: a plain float weight [N, K] in the container (a linear a quantized checkpoint
keeps unquantized, when it must travel as QuantizedLinearWeights). Its matmul is F.linear in x's
dtype, as a plain tensor's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from salaserve.quant.formats.base import Format
from salaserve.quant.formats.container import QuantizedLinearWeights


class Bf16Format(Format):
    name = "bf16"

    def dequantize(self, w, dtype):
        return w.weight.to(dtype)

    def reference_linear(self, x, w):
        return F.linear(x, w.weight.to(x.dtype))

    def concat(self, parts):
        return QuantizedLinearWeights.from_dense(torch.cat([p.weight for p in parts], 0))


BF16 = Bf16Format()
