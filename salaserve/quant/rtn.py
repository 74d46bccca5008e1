"""Round-to-nearest quantization: the int4 grid shared with GPTQ, RTN w4a16, and fp8.

The int4 grid follows GPTQ's quantizer so both produce the same kind of checkpoint:
  asymmetric: scale = (max(x, 0) - min(x, 0)) / 15, zero = round(-min / scale)
  symmetric:  scale = 2 * amax / 15, zero = 8
  code q = clamp(round(x / scale) + zero, 0, 15), value = (q - zero) * scale
Scales are rounded to their storage dtype (fp16, as GPTQ checkpoints keep them) *before* the codes
are chosen, so the codes are the best ones for the scales actually stored.
"""

from __future__ import annotations

# the quantizers live with their formats (quant/formats/): this module names them for their users
from salaserve.quant.formats.fp8 import quantize_fp8
from salaserve.quant.formats.w4a16 import MAXQ, find_params, quantize_codes, quantize_w4a16_rtn

__all__ = ["MAXQ", "find_params", "quantize_codes", "quantize_fp8", "quantize_w4a16_rtn"]
