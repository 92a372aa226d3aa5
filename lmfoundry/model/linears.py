"""Runtime linear modules, one per stored format, chosen at load time (the runtime module swap).

On CPU, weight-only integer schemes are dequantized once at load (the fastest CPU execution and
bit-identical to what transformers decompresses). Schemes with quantized activations (W8A8-INT8,
FP8) run `ActivationQuantizedLinear`, which executes the integer / fp8 arithmetic of the kernels'
reference (`lmfoundry.model.quantized_linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantizers.base import QuantizedWeight
from lmfoundry.quantizers.scheme import Scheme


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def build_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype) -> nn.Module:
    """The module that executes a stored quantized linear."""
    if scheme.input_activations is not None:
        from lmfoundry.model.quantized_linear import KIND, build_activation_linear

        if scheme.format not in KIND:
            raise UserError(f"format {scheme.format!r} with quantized activations has no execution "
                            f"(known: {', '.join(KIND)})")
        return build_activation_linear(qw, bias, scheme, dtype)
    return dense_linear(qw.dequantize(dtype), bias.to(dtype) if bias is not None else None)
