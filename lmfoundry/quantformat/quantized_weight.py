"""One linear's quantized weight: the codes and qparams a quantizer produces, the checkpoint stores
and the model's runtime linears are built from.

It lives beside the scheme and the arithmetic rather than with the quantizer interface so that the
model can take a quantized weight without importing any quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs


@dataclass
class QuantizedWeight:
    """Codes plus qparams of one linear's weight, in compressed-tensors conventions."""

    q: torch.Tensor  # int8 codes (any bit width <= 8) or float8_e4m3fn, shape [out, in]
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    args: QuantArgs
    g_idx: torch.Tensor | None = None  # group of each input column (GPTQ act-order "dynamic")
    input_scale: torch.Tensor | None = None  # static activation scale (w8a8-static, fp8-static)
    metrics: dict[str, float] = field(default_factory=dict)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.g_idx is None:
            return qmath.dequantize(self.q, self.scale, self.zero_point, self.args, dtype)
        # per-column groups: gather each column's scale/zero point
        s = self.scale[:, self.g_idx]
        deq = self.q.to(s.dtype)
        if self.zero_point is not None:
            deq = deq - self.zero_point[:, self.g_idx].to(s.dtype)
        return (deq * s).to(dtype)
