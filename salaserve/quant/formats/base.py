"""What a quantized weight format is: the `Format` interface every format module implements, and the
`QuantScheme` a model is loaded with.

A Format describes one way a linear layer's weight W [N, K] is stored (QuantizedLinearWeights with
`format` = its name) from checkpoint to matmul:

  name, quant_method      its name (QuantizedLinearWeights.format, --quantization) and the
                          quantization_config.quant_method of checkpoints that store it (None: the
                          format is made on load only)
  stored_aliases          other --quantization names that select it for a checkpoint storing it
                          (and refuse an unquantized one), e.g. "gptq" for w4a16
  dequantize, reference_linear   the ground truth: W, and x @ W^T from it
  fusable, concat         fusing linears that read the same input (q/k/v/gate, gate/up)
  quantize                the on-load quantizer (an unquantized checkpoint with --quantization NAME)
  slice_out, slice_in      a tensor-parallel rank's output rows / input columns of W
  parse_config, stores, checkpoint_shapes, found_shape, check_dtype, check_tensors,
  from_checkpoint, checkpoint_tensors    reading and writing checkpoints

The kernels that serve a format at speed are not here: kernels/quant_gemm/dispatch.py maps format
names to them (LINEAR_KERNELS); a format without kernels runs its reference_linear everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from salaserve.quant.formats.container import QuantizedLinearWeights

DEFAULT_GROUP_SIZE = 128
GPTQ_V1 = "gptq"  # the zero-point convention of qzeros on disk (formats/w4a16.py)
FLOAT_DTYPES = ("BF16", "F16", "F32")  # safetensors names of the float dtypes


class QuantConfigError(ValueError):
    """A quantization config salaserve cannot serve; the message names the field."""


class CheckpointError(ValueError):
    """A quantized checkpoint's tensors cannot be read as their format says."""


def config_bool(qc: dict, key: str, default: bool) -> bool:
    """quantization_config[key] as a JSON boolean (QuantConfigError for anything else)."""
    v = qc.get(key, default)
    if not isinstance(v, bool):
        raise QuantConfigError(f"quantization_config.{key} must be true or false, got {v!r}")
    return v


@dataclass(frozen=True)
class QuantScheme:
    """How a model's linears are quantized: the format, its parameters (int4: the group size,
    symmetry, act-order and the zero-point convention on disk), whether lm_head is quantized, and
    whether the checkpoint stores the quantized tensors or the engine quantizes on load."""

    format: str  # a registered Format's name ("w4a16", "fp8", ...)
    group_size: int = DEFAULT_GROUP_SIZE  # -1: one group per output channel (whole K)
    sym: bool = True
    desc_act: bool = False  # act-order: g_idx is a permutation of the groups
    checkpoint_format: str = GPTQ_V1  # zero-point convention of qzeros on disk
    lm_head: bool = False
    stored: bool = True  # False: the checkpoint is bf16 and the engine quantizes on load


class Format:
    """One quantized weight format (see the module docstring). Subclasses set the names and override
    what applies; the defaults serve a weight-only format stored as `weight` [N, K] plus a per-row
    `scale` [N] (concatenated along N) that is made on load only."""

    name: str = ""
    quant_method: Optional[str] = None
    stored_aliases: tuple[str, ...] = ()

    # ---- the math ----------------------------------------------------------------------------
    def dequantize(self, w: "QuantizedLinearWeights", dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in the original input-channel order."""
        raise NotImplementedError(f"format {self.name!r} has no dequantize")

    def reference_linear(self, x: torch.Tensor, w: "QuantizedLinearWeights") -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N] in x.dtype: fp32 products of the exactly dequantized weights."""
        return (x.float() @ self.dequantize(w, torch.float32).t()).to(x.dtype)

    def fusable(self, a: "QuantizedLinearWeights", b: "QuantizedLinearWeights") -> bool:
        """Whether b may be concatenated after a (both of this format, the same in_features)."""
        return True

    def concat(self, parts: list) -> "QuantizedLinearWeights":
        """One weight of parts stacked along the output dim (fusable ones)."""
        return type(parts[0])(self.name, parts[0].in_features, sum(p.out_features for p in parts),
                              weight=torch.cat([p.weight for p in parts]),
                              scale=torch.cat([p.scale for p in parts]))

    # ---- tensor parallelism (parallel/shard.py) ---------------------------------------------
    def slice_out(self, w: "QuantizedLinearWeights", lo: int, hi: int) -> "QuantizedLinearWeights":
        """Output channels [lo, hi) of W (a column-parallel shard): the rows and their scales."""
        return dataclasses.replace(w, out_features=hi - lo, weight=w.weight[lo:hi].contiguous(),
                                   scale=None if w.scale is None else w.scale[lo:hi].contiguous(),
                                   wgmma=None, prefill=None)

    def slice_in(self, w: "QuantizedLinearWeights", lo: int, hi: int) -> "QuantizedLinearWeights":
        """Input channels [lo, hi) of W (a row-parallel shard); a per-output-channel scale applies
        to every column, so each rank keeps all of it."""
        return dataclasses.replace(w, in_features=hi - lo, weight=w.weight[:, lo:hi].contiguous(),
                                   wgmma=None, prefill=None)

    # ---- on load -----------------------------------------------------------------------------
    def quantize(self, weight: torch.Tensor, scheme: QuantScheme) -> "QuantizedLinearWeights":
        """W [N, K] of an unquantized checkpoint -> this format (--quantization NAME)."""
        raise NotImplementedError(f"format {self.name!r} cannot quantize on load")

    # ---- checkpoints -------------------------------------------------------------------------
    def parse_config(self, qc: dict, lm_head: bool) -> QuantScheme:
        """A checkpoint's quantization_config (quant_method == self.quant_method) -> its scheme;
        QuantConfigError for anything this format cannot read."""
        raise QuantConfigError(f"format {self.name!r} is made on load only; no checkpoint stores it")

    def stores(self, base: str, dtypes: dict[str, str]) -> bool:
        """Whether a checkpoint (safetensors names -> dtype names) stores linear `base` (HF name
        without `.weight`) in this format; else it is a plain float weight there."""
        return False

    def checkpoint_shapes(self, base: str, n: int, k: int, scheme: QuantScheme) -> dict[str, tuple[int, ...]]:
        """The tensors (name -> shape) a checkpoint holds for linear `base` of W [n, k]."""
        raise NotImplementedError

    def found_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A stored tensor's shape as checkpoint_shapes states it (e.g. a column [N, 1] read as [N])."""
        return shape

    def check_dtype(self, part: str, dtype: str) -> Optional[str]:
        """None if tensor `<base>.<part>` may be stored as `dtype`, else what it should be."""
        return None if dtype in FLOAT_DTYPES else "a float type"

    def check_tensors(self, tensors: dict[str, torch.Tensor], base: str) -> list[str]:
        """Problems with the values of linear `base`'s tensors, one phrase each (for one error message)."""
        return []

    def from_checkpoint(self, tensors: dict[str, torch.Tensor], base: str, scheme: QuantScheme):
        """The QuantizedLinearWeights of linear `base` from its checkpoint tensors."""
        raise NotImplementedError

    def checkpoint_tensors(self, w: "QuantizedLinearWeights", base: str, scheme: QuantScheme) -> dict:
        """w's tensors under their checkpoint names (what from_checkpoint reads back)."""
        raise NotImplementedError(f"format {self.name!r} has no checkpoint form")
