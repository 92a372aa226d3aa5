"""Runtime linear modules, one per stored format, chosen at load time (the runtime module swap).

On CPU, weight-only integer schemes are dequantized once at load (the fastest CPU execution and
bit-identical to what transformers decompresses). Schemes with quantized activations (W8A8, FP8)
register their own modules in `ACTIVATION_LINEARS`, which execute the integer / fp8 arithmetic a
GPU kernel does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lmfoundry.quantizers.base import QuantizedWeight
from lmfoundry.quantizers.scheme import Scheme

# format -> factory(qweight, bias, scheme, dtype) -> nn.Module; filled by the W8A8/FP8 modules.
ACTIVATION_LINEARS: dict[str, Callable[[QuantizedWeight, torch.Tensor | None, Scheme, torch.dtype], nn.Module]] = {}


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
        factory = ACTIVATION_LINEARS.get(scheme.format)
        if factory is None:
            _register_builtin()
            factory = ACTIVATION_LINEARS.get(scheme.format)
        if factory is not None:
            return factory(qw, bias, scheme, dtype)
        # no activation-quantized execution available: weight dequantization only
    return dense_linear(qw.dequantize(dtype), bias.to(dtype) if bias is not None else None)


def _register_builtin() -> None:
    """Import the modules that register activation-quantized linears (if present)."""
    import importlib

    for name in ("lmfoundry.runtime.int8_linear", "lmfoundry.runtime.fp8_linear"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
