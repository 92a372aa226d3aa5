"""FP8 W8A8 (e4m3) execution with real float8 tensors and `torch._scaled_mm`.

The arithmetic of vLLM's FP8 linear for compressed-tensors `float-quantized` checkpoints:

    s_x   = max(absmax(row) / 448, 1 / (448 * 512))   dynamic per token, or the calibrated input_scale
    x_8   = float8_e4m3fn(clamp(x / s_x, -448, 448))  round to nearest even
    y     = (x_8 @ w_8^T) * s_x * s_w + bias           fp32 accumulation and epilogue

Weights are fp8 with a per-channel [out, 1] or per-tensor [1] scale. `torch._scaled_mm` runs on CPU
(and on sm_89+ GPUs), so the CPU reference is the kernel's computation, not an emulation. The lower
bound on the dynamic scale is vLLM's (it keeps an all-zero row from dividing by zero).
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.errors import UserError
from lmfoundry.quantizers.base import QuantizedWeight
from lmfoundry.quantizers.scheme import Scheme
from lmfoundry.runtime.linears import ACTIVATION_LINEARS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_DYNAMIC_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_activation_fp8(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1] or [1, 1])."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_DYNAMIC_SCALE)
    else:
        scale = input_scale.float().reshape(1, 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(xq [M, K], wq [N, K] float8_e4m3fn) -> [M, N]; x_scale fp32 [M|1, 1], w_scale fp32 [N|1].

    `_scaled_mm` takes either two per-tensor scales or row-wise [M, 1] × [1, N] scales; mixed cases
    are expanded to the row-wise form (identical arithmetic)."""
    m, n = xq.shape[0], wq.shape[0]
    sa, sb = x_scale.float(), w_scale.float().reshape(1, -1)
    if sa.numel() == 1 and sb.numel() == 1:
        sa, sb = sa.reshape(()), sb.reshape(())
    else:
        sa, sb = sa.expand(m, 1).contiguous(), sb.expand(1, n).contiguous()
    y = torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


class Fp8Linear(nn.Module):
    """A linear stored as float8_e4m3fn with fp32 scales, run as FP8 W8A8."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.to(FP8_DTYPE).contiguous())
        ws = weight_scale.float().reshape(-1)
        if ws.numel() not in (1, self.out_features):
            raise UserError(f"fp8 weight_scale of {ws.numel()} entries for {self.out_features} channels")
        self.register_buffer("weight_scale", ws.contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        xq, xs = quantize_activation_fp8(x.reshape(-1, self.in_features), self.input_scale)
        y = fp8_scaled_mm(xq, xs, self.weight, self.weight_scale, self.bias, x.dtype)
        return y.reshape(*shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def extra_repr(self) -> str:
        act = "static per-tensor" if self.input_scale is not None else "dynamic per-token"
        w = "per-tensor" if self.weight_scale.numel() == 1 else "per-channel"
        return f"in={self.in_features}, out={self.out_features}, fp8 {w} weights, fp8 {act} activations"


def build_fp8_linear(qw: QuantizedWeight, bias: torch.Tensor | None, scheme: Scheme, dtype: torch.dtype,
                     input_scale: torch.Tensor | None = None) -> Fp8Linear:
    """`ACTIVATION_LINEARS["float-quantized"]`: the runtime module of an FP8 W8A8 linear."""
    w, a = scheme.weights, scheme.input_activations
    if input_scale is None:  # decode_linear may attach the checkpoint's input_scale to the weight
        input_scale = getattr(qw, "input_scale", None)
    if w.type != "float" or w.strategy not in ("channel", "tensor"):
        raise UserError(f"FP8 execution needs fp8 per-channel/tensor weights, got {w.describe()}")
    if qw.q.dtype != FP8_DTYPE:
        raise UserError(f"float-quantized weight has dtype {qw.q.dtype}, expected float8_e4m3fn")
    if a is None or a.type != "float":
        raise UserError(f"FP8 execution needs fp8 activations, got {a.describe() if a else None}")
    if a.dynamic:
        if a.strategy != "token":
            raise UserError(f"dynamic fp8 activations must be per token, got {a.strategy}")
        input_scale = None
    else:
        if a.strategy != "tensor":
            raise UserError(f"static fp8 activations must be per tensor, got {a.strategy}")
        if input_scale is None:
            raise UserError("static fp8 activation scheme but the checkpoint has no input_scale for this linear")
    return Fp8Linear(qw.q, qw.scale, bias, input_scale, dtype)


ACTIVATION_LINEARS["float-quantized"] = build_fp8_linear
