"""FP8 (e4m3) GEMM with scales: per tensor, or per token x per channel; fp32 accumulation.

Shares the Triton kernel with W8A8 (`scaled_mm.py`). FP8 tensor cores exist from sm_89 (Ada:
QMMA) and sm_90 (Hopper: QGMMA); Triton refuses e4m3 below sm_89, and so does `compile`.
"""

from __future__ import annotations

import torch

from lmfoundry.kernels import scaled_mm
from lmfoundry.kernels.dispatch import Executor
from lmfoundry.kernels.scaled_mm import ScaledLinear
from lmfoundry.kernels.spec import Support

SUPPORT = Support(
    {
        "dtype": ("float16", "bfloat16"),
        "weight_strategy": ("channel", "tensor"),
        "input_strategy": ("token", "tensor"),
        "arch": (89, 90),
    },
    note="e4m3 only; needs sm_89 or newer",
)


KERNEL = scaled_mm.gemm_kernel("fp8_gemm", hopper_mma="QGMMA", mma="QMMA")


def reference(
    xq: torch.Tensor, x_scale: torch.Tensor, w: ScaledLinear, out_dtype: torch.dtype
) -> torch.Tensor:
    """Exact products of e4m3 values summed in float64, then the fp32 scale epilogue."""
    return scaled_mm.reference(xq, w.weight, x_scale, w.weight_scale, w.bias, out_dtype)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    w: ScaledLinear,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """out [M, N] from e4m3 xq [M, K] and fp32 scales ([M] per token, or [1] static)."""
    if xq.dtype != torch.float8_e4m3fn or w.weight.dtype != torch.float8_e4m3fn:
        raise TypeError("fp8_gemm takes float8_e4m3fn activations and weights")
    return scaled_mm.run_gemm(KERNEL, xq, x_scale, w, out_dtype, out, executor)


def fp8_linear(x: torch.Tensor, w: ScaledLinear, executor: Executor | None = None) -> torch.Tensor:
    """Quantize x [..., K] to e4m3 per token (or with w.input_scale) and multiply by w."""
    return scaled_mm.run_linear(KERNEL, x, w, torch.float8_e4m3fn, executor)
