"""Fusing the linears that read the same input (q/k/v/gate, gate/up) when some are quantized.

Plain tensors concatenate as before. Quantized parts concatenate with
`QuantizedLinearWeights.concat` when they can: same format and what the format asks (Format.fusable:
for int4, the same group size and channel order, g_idx / act-order permutation). When they cannot, the parts are grouped into runs
that can and kept as a `SplitLinear`, which the backend runs as one matmul per run and
concatenates. Two cases need that:
  - a GPTQModel checkpoint of MiniCPM-SALA leaves o_gate / z_proj in bf16 next to int4 q/k/v;
  - act-order checkpoints whose q/k/v got different permutations (their Hessians are the same
    input's, so GPTQ gives them one order, but a checkpoint may come from elsewhere).
We keep such parts unfused rather than dequantize them: dequantizing would quietly give back the
memory and bandwidth the checkpoint was made to save; the split costs one extra launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from salaserve.quant.formats import QuantizedLinearWeights

Weight = Union[torch.Tensor, QuantizedLinearWeights]


@dataclass
class SplitLinear:
    """A fused linear kept as parts along the output dim: y = cat([x @ W_i^T for each part])."""

    parts: tuple

    @property
    def out_features(self) -> int:
        return sum(_out_features(p) for p in self.parts)


def _out_features(w) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.out_features


def _fusable(a: Weight, b: Weight) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.fusable_with(b)  # the same format and K, and the format takes them together


def _concat(run: list) -> Weight:
    if isinstance(run[0], torch.Tensor):
        return torch.cat(run)
    return run[0] if len(run) == 1 else QuantizedLinearWeights.concat(run)


def fuse_linear(parts: Sequence[Weight]):
    """One weight for parts that read the same input, concatenated along the output dim:
    a tensor, a QuantizedLinearWeights, or a SplitLinear of consecutive fusable runs."""
    runs: list[list] = []
    for p in parts:
        if runs and _fusable(runs[-1][-1], p):
            runs[-1].append(p)
        else:
            runs.append([p])
    fused = [_concat(r) for r in runs]
    return fused[0] if len(fused) == 1 else SplitLinear(tuple(fused))


def linear_weights(params) -> list:
    """Every linear weight of a fused parameter dict (SalaModel.p: lm_head, then each layer's qkvg,
    o_proj, gate_up and down), the parts of SplitLinear ones included."""
    ws = [params["lm_head"]]
    for layer in params["layers"]:
        ws += [layer[n] for n in ("qkvg", "o_proj", "gate_up", "down")]
    return [p for w in ws for p in getattr(w, "parts", [w])]
