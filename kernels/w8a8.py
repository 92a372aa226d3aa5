"""W8A8 INT8 GEMM: int8 activations x int8 weights, int32 accumulation, per-token x per-channel
(or per-tensor) scale epilogue. The Triton kernel is shared with FP8 (`scaled_mm.py`); this module
declares the int8 family, its reference and its ops.
"""

from __future__ import annotations

import torch

from lmfoundry.kernels import scaled_mm
from lmfoundry.kernels.dispatch import Executor
from lmfoundry.kernels.scaled_mm import ScaledLinear
from lmfoundry.kernels.spec import Support

SUPPORT = Support(
    {
        "bits": (8,),
        "dtype": ("float16", "bfloat16"),
        "weight_strategy": ("channel", "tensor"),
        "input_strategy": ("token", "tensor"),
        "arch": (80, 86, 89, 90),
    },
    note="symmetric int8 only; K < 2**17 keeps the int32 accumulator exact",
)


KERNEL = scaled_mm.gemm_kernel("w8a8_gemm", hopper_mma="IGMMA", mma="IMMA")


def reference(
    xq: torch.Tensor, x_scale: torch.Tensor, w: ScaledLinear, out_dtype: torch.dtype
) -> torch.Tensor:
    """Exact integer dot products, then acc * x_scale[m] * w_scale[n] (+ bias) in fp32."""
    return scaled_mm.reference(xq, w.weight, x_scale, w.weight_scale, w.bias, out_dtype)


def w8a8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: ScaledLinear,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """out [M, N] from int8 xq [M, K] with fp32 scales ([M] per token, or [1] when w is static)."""
    if xq.dtype != torch.int8 or w.weight.dtype != torch.int8:
        raise TypeError("w8a8_gemm takes int8 activations and weights")
    return scaled_mm.run_gemm(KERNEL, xq, x_scale, w, out_dtype, out, executor)


def w8a8_linear(x: torch.Tensor, w: ScaledLinear, executor: Executor | None = None) -> torch.Tensor:
    """Quantize x [..., K] to int8 per token (or with w.input_scale) and multiply by w."""
    return scaled_mm.run_linear(KERNEL, x, w, torch.int8, executor)
