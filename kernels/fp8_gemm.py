"""FP8 (e4m3) GEMM with scales: per tensor, or per token x per channel; fp32 accumulation.

The Triton kernel and the entry points are shared with W8A8 (`scaled_mm.py`). FP8 tensor cores
exist from sm_89 (Ada: QMMA) and sm_90 (Hopper: QGMMA); Triton refuses e4m3 below sm_89, and so
does `compile`.
"""

from __future__ import annotations

import torch

from lmfoundry.kernels import scaled_mm
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
E4M3 = scaled_mm.CodeFamily(KERNEL, torch.float8_e4m3fn)
reference, fp8_gemm, fp8_linear = E4M3.reference, E4M3.gemm, E4M3.linear
