"""Kernel tests run on a GPU when there is one, else through Triton's interpreter on CPU.

Under the interpreter, bf16/fp8 conversions and bf16 dots are corrected first (see
`lmfoundry.kernels.interpreter`): without that the interpreter, not the kernel, would be tested.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.dispatch import is_interpreter
from lmfoundry.kernels.error_bounds import U32

if is_interpreter():
    from lmfoundry.kernels.interpreter import patch_interpreter

    patch_interpreter()


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20261129)


@pytest.fixture
def acc_u(device: str) -> float:
    """Accumulator unit roundoff: exact fp32 RNE in the interpreter; tensor cores may truncate."""
    return U32 if device == "cpu" else 2.0**-22
