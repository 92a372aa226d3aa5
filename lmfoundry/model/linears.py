"""Runtime linear modules, one per stored format, chosen at load time (the runtime module swap).

Weight-only integer schemes (W4A16, W8A16) stay packed when the model runs in bfloat16: their codes
go to PyTorch's CPU int4pack / int8pack kernels (`lmfoundry.model.cpu_linears`), so the artifact
is as small in memory as on disk. In float32 (or float16) they are dequantized once at load: that
dense weight is bit-identical to what transformers decompresses, which is what parity tests and
`--dtype float32` runs want, and those kernels have no fast float32 path. Schemes with quantized
activations (W8A8-INT8, FP8) run `ActivationQuantizedLinear`, the integer / fp8 arithmetic of the
kernels' reference (`lmfoundry.model.quantized_linear`).
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import Scheme


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def packs_weights(dtype: torch.dtype) -> bool:
    """Whether weight-only quantized linears stay packed for a model running in `dtype`."""
    return dtype == torch.bfloat16


def build_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype,
                 fallbacks: list[str] | None = None) -> nn.Module:
    """The module that executes a stored quantized linear. A weight-only linear whose codes fit no
    packed kernel is dequantized, and the reason is appended to `fallbacks`."""
    if scheme.input_activations is not None:
        from lmfoundry.model.quantized_linear import KIND, build_activation_linear

        if scheme.format not in KIND:
            raise UserError(f"format {scheme.format!r} with quantized activations has no execution "
                            f"(known: {', '.join(KIND)})")
        return build_activation_linear(qw, bias, scheme, dtype)
    if packs_weights(dtype) and qw.q.device.type == "cpu":
        from lmfoundry.model.cpu_linears import packed_linear

        module = packed_linear(qw, bias)
        if not isinstance(module, str):
            return module
        if fallbacks is not None:
            fallbacks.append(module)
    return dense_linear(qw.dequantize(dtype), bias.to(dtype) if bias is not None else None)
