"""Quantized weight formats of a linear layer: one module per format, and their registry.

    get(name) -> Format                 the format of QuantizedLinearWeights.format
    register(fmt) / unregister(name)    add or remove a format (the built-in ones are registered below)
    quantization_choices()              the values --quantization accepts
    for_quantization(name), for_quant_method(method)   a --quantization value's / a checkpoint's format

Each format module holds its checkpoint tensors, packing, dequantization, reference matmul and
on-load quantizer as a `Format` (base.py); the container, QuantizedLinearWeights (container.py),
is the same for all. Built in: bf16.py (a plain weight in the container), fp8.py (e4m3, one scale
per output channel), w4a16.py (GPTQ int4). The Triton kernels that serve a format at speed are
listed in kernels/quant_gemm/dispatch.py (LINEAR_KERNELS); a format without kernels runs its
reference matmul.

Adding a format: its module (a Format subclass and an instance), its line in FORMATS below, and,
for GPU kernels, its line in LINEAR_KERNELS.
"""

from salaserve.quant.formats.base import CheckpointError, Format, GPTQ_V1, QuantConfigError, QuantScheme
from salaserve.quant.formats.container import QuantizedLinearWeights
from salaserve.quant.formats.registry import (for_quant_method, for_quantization, get, names, quantization_choices,
                                              register, unregister)
from salaserve.quant.formats import bf16, fp8, w4a16
from salaserve.quant.formats.fp8 import FP8_MAX, dequantize_fp8, fp8_prefill_copy, quantize_fp8_per_channel
from salaserve.quant.formats.w4a16 import (GPTQ_V2, convert_qzeros, dequantize_gptq, gptq_quantize_config,
                                           is_trivial_g_idx, pack_int4, pack_zeros, reorder_act_order, to_int32,
                                           trivial_g_idx, unpack_int4, unpack_zeros)

__all__ = [
    # the interface, the container, the registry
    "Format", "QuantScheme", "QuantConfigError", "CheckpointError", "QuantizedLinearWeights", "FORMATS",
    "get", "register", "unregister", "names", "quantization_choices", "for_quantization", "for_quant_method",
    # the built-in formats' helpers
    "FP8_MAX", "quantize_fp8_per_channel", "dequantize_fp8", "fp8_prefill_copy",
    "GPTQ_V1", "GPTQ_V2", "pack_int4", "unpack_int4", "pack_zeros", "unpack_zeros", "convert_qzeros", "to_int32",
    "trivial_g_idx", "is_trivial_g_idx", "dequantize_gptq", "reorder_act_order", "gptq_quantize_config",
]

FORMATS = (bf16.BF16, fp8.FP8, w4a16.W4A16)  # the built-in formats, registered in this order
for _fmt in FORMATS:
    register(_fmt)
