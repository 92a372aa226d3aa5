"""W8A8-INT8 execution: int8 activations × int8 weights → int32, then the fp32 scale epilogue.

This is the arithmetic of the CUTLASS / Triton W8A8 kernels vLLM runs for compressed-tensors
`int-quantized` checkpoints, done with a real integer matmul (`torch._int_mm`) so a CPU result
equals what the kernel computes up to the order of two fp32 multiplications in the epilogue:

    x_q   = clamp(round(x / s_x), -128, 127)          s_x: per token (dynamic) or per tensor (static)
    acc   = x_q @ w_q^T                               exact int32
    y     = (float(acc) * s_x * s_w) + bias           fp32, cast to the model dtype

Dynamic per-token scales are absmax(row) / 127 in fp32. Weights are symmetric per output channel
(or per tensor); asymmetric int8 weights have no kernel and are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantizers.base import QuantizedWeight
from lmfoundry.quantizers.scheme import Scheme
from lmfoundry.runtime.linears import ACTIVATION_LINEARS

INT8_MAX = 127.0


def quantize_activation_int8(x: torch.Tensor, input_scale: torch.Tensor | None,
                             qmax: float = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], fp32 scales [M, 1] or [1, 1]). `input_scale` None = dynamic
    per token with scale absmax / `qmax` (127: vLLM's kernels; 127.5: compressed-tensors'
    emulation, which transformers runs)."""
    xf = x.float()
    if input_scale is None:
        absmax = xf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    else:
        scale = input_scale.float().reshape(1, 1)
    q = torch.round(xf / scale).clamp(-128.0, INT8_MAX).to(torch.int8)
    return q, scale


def int8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq [M, K] int8, wq [N, K] int8) -> [M, N] in `out_dtype`; scales fp32 [M|1, 1] and [N|1]."""
    m = xq.shape[0]
    a = xq
    if xq.is_cuda and m <= 16:  # cuBLASLt int8 GEMM needs M > 16: pad with zero rows
        a = torch.cat([xq, xq.new_zeros(17 - m, xq.shape[1])])
    acc = torch._int_mm(a, wq.t())[:m]
    y = acc.float() * x_scale * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


class Int8Linear(nn.Module):
    """A linear stored as int8 codes with per-channel (or per-tensor) fp32 scales, run as W8A8."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.to(torch.int8).contiguous())
        ws = weight_scale.float().reshape(-1)
        if ws.numel() not in (1, self.out_features):
            raise UserError(f"int8 weight_scale of {ws.numel()} entries for {self.out_features} channels")
        self.register_buffer("weight_scale", ws.expand(self.out_features).contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.dtype = dtype
        # divisor of dynamic per-token scales: 127 is what vLLM's int8 kernels use; set 127.5 to
        # reproduce compressed-tensors' fake quantization (transformers) bit for bit
        self.act_qmax = INT8_MAX

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        xq, xs = quantize_activation_int8(x.reshape(-1, self.in_features), self.input_scale, self.act_qmax)
        y = int8_scaled_mm(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        act = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        return f"in={self.in_features}, out={self.out_features}, int8 weights, int8 {act} activations"


def build_int8_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype,
                      input_scale: torch.Tensor | None = None) -> Int8Linear:
    """`ACTIVATION_LINEARS["int-quantized"]`: the runtime module of a W8A8-INT8 linear."""
    w, a = scheme.weights, scheme.input_activations
    if input_scale is None:  # decode_linear may attach the checkpoint's input_scale to the weight
        input_scale = getattr(qw, "input_scale", None)
    if w.type != "int" or w.num_bits != 8 or not w.symmetric or w.strategy not in ("channel", "tensor"):
        raise UserError(f"W8A8-INT8 execution needs symmetric int8 per-channel/tensor weights, got {w.describe()}")
    if qw.zero_point is not None or qw.g_idx is not None:
        raise UserError("W8A8-INT8 execution does not support weight zero points or g_idx")
    if a is None or a.type != "int" or a.num_bits != 8 or not a.symmetric:
        raise UserError(f"W8A8-INT8 execution needs symmetric int8 activations, got {a.describe() if a else None}")
    if a.dynamic:
        if a.strategy != "token":
            raise UserError(f"dynamic int8 activations must be per token, got {a.strategy}")
        input_scale = None
    else:
        if a.strategy != "tensor":
            raise UserError(f"static int8 activations must be per tensor, got {a.strategy}")
        if input_scale is None:
            raise UserError("static int8 activation scheme but the checkpoint has no input_scale for this linear")
    return Int8Linear(qw.q, qw.scale, bias, input_scale, dtype)


ACTIVATION_LINEARS["int-quantized"] = build_int8_linear
