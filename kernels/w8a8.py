"""W8A8 INT8 GEMM: int8 activations x int8 weights, int32 accumulation, per-token x per-channel
(or per-tensor) scale epilogue. The Triton kernel and the entry points are shared with FP8
(`scaled_mm.py`); this module declares the int8 family: what it supports and its kernel.
"""

from __future__ import annotations

import torch

from lmfoundry.kernels import scaled_mm
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
INT8 = scaled_mm.CodeFamily(KERNEL, torch.int8)
reference, w8a8_gemm, w8a8_linear = INT8.reference, INT8.gemm, INT8.linear
