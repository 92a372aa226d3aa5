"""W8A8 execution in the reference executor: INT8 (`int-quantized`) and FP8 e4m3
(`float-quantized`) linears with quantized activations.

The arithmetic is the kernels' own reference, not a copy of it:

    x_q, s_x = quantize_reference(x)        lmfoundry.kernels.w8a8_reference: per token absmax / qmax
                                            (int8 127, fp8 448 with vLLM's floor 1/(448*512)), or
                                            the calibrated static scale; int8 codes in [-128, 127]
    y        = scaled_mm_reference(...)     exact dot products (int32 by torch._int_mm; float64 for
                                            e4m3), then acc * s_x * s_w (+ bias) in fp32

so a CPU result equals what the compiled W8A8 / FP8 GEMM computes up to its accumulation order.
Weights are symmetric per output channel (or per tensor); asymmetric 8-bit weights, zero points
or g_idx have no kernel and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.kernels.w8a8_reference import QMAX, QUANT_FP8, QUANT_INT8, quantize_reference, scaled_mm_reference
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import Scheme

CODE_DTYPE = {QUANT_INT8: torch.int8, QUANT_FP8: torch.float8_e4m3fn}
KIND = {"int-quantized": (QUANT_INT8, "int", "W8A8-INT8"), "float-quantized": (QUANT_FP8, "float", "FP8 W8A8")}


class ActivationQuantizedLinear(nn.Module):
    """A linear stored as int8 or e4m3 codes with fp32 scales, run with quantized activations."""

    # buffers (registered in __init__)
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None, dtype: torch.dtype, quant: int) -> None:
        super().__init__()
        self.quant = quant
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.to(CODE_DTYPE[quant]).contiguous())
        ws = weight_scale.float().reshape(-1)
        if ws.numel() not in (1, self.out_features):
            raise UserError(f"weight_scale of {ws.numel()} entries for {self.out_features} channels")
        self.register_buffer("weight_scale", ws.contiguous())  # [N] per channel or [1] per tensor
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        # divisor of dynamic per-token scales: the kernels' (127 / 448); 127.5 reproduces
        # compressed-tensors' int8 fake quantization (transformers) bit for bit
        self.act_qmax = QMAX[quant]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        xq, xs = quantize_reference(x.reshape(-1, self.in_features), self.quant, self.input_scale, self.act_qmax)
        y = scaled_mm_reference(xq, self.weight, xs, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        act = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        kind = "int8" if self.quant == QUANT_INT8 else "fp8"
        return f"in={self.in_features}, out={self.out_features}, {kind} weights, {kind} {act} activations"


def build_activation_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype,
                            input_scale: torch.Tensor | None = None) -> ActivationQuantizedLinear:
    """The runtime module of a stored W8A8-INT8 or FP8 linear (its scheme's format says which)."""
    quant, kind, label = KIND[scheme.format]
    w, a = scheme.weights, scheme.input_activations
    if input_scale is None:  # decode_linear may attach the checkpoint's input_scale to the weight
        input_scale = getattr(qw, "input_scale", None)
    if w.type != kind or w.num_bits != 8 or not w.symmetric or w.strategy not in ("channel", "tensor"):
        raise UserError(f"{label} execution needs symmetric 8-bit {kind} per-channel/tensor weights, "
                        f"got {w.describe()}")
    if qw.q.dtype != CODE_DTYPE[quant]:
        raise UserError(f"{scheme.format} weight has dtype {qw.q.dtype}, expected {CODE_DTYPE[quant]}")
    if qw.zero_point is not None or qw.g_idx is not None:
        raise UserError(f"{label} execution does not support weight zero points or g_idx")
    if a is None or a.type != kind or a.num_bits != 8 or not a.symmetric:
        raise UserError(f"{label} execution needs symmetric 8-bit {kind} activations, "
                        f"got {a.describe() if a else None}")
    if a.dynamic:
        if a.strategy != "token":
            raise UserError(f"dynamic {kind} activations must be per token, got {a.strategy}")
        input_scale = None
    else:
        if a.strategy != "tensor":
            raise UserError(f"static {kind} activations must be per tensor, got {a.strategy}")
        if input_scale is None:
            raise UserError(f"static {kind} activation scheme but the checkpoint has no input_scale for this linear")
    return ActivationQuantizedLinear(qw.q, qw.scale, bias, input_scale, dtype, quant)
