"""A dense linear module around a weight that already exists.

`nn.Linear` allocates and randomly initializes its own weight; a model being loaded (or a
quantized linear dequantized, or one rank's slice) already holds the tensor, so the module is
built on the meta device and handed that tensor, never copying or initializing a second one. Which
module executes a stored quantized linear is the serving runtime's choice (`runtime/loader.py`).
"""

from __future__ import annotations

import torch
from torch import nn


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An `nn.Linear` holding `weight` [out, in] and `bias` themselves (frozen), without allocating."""
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin
