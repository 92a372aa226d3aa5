"""Fixtures of the C kernels' tests (they compare each kernel with its PyTorch reference)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """The seeded generator the kernel tests draw their inputs from (the seed of tests/kernels)."""
    return torch.Generator().manual_seed(20261129)
