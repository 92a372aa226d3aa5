"""SiLU-and-multiply against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import activation
from lmfoundry.kernels.error_bounds import U32, assert_within, assert_written, poisoned, unit_roundoff


@pytest.mark.parametrize("rows,inter,dtype", [(1, 1536, torch.bfloat16), (7, 100, torch.float16), (3, 256, torch.float32)])
def test_silu_mul(rows, inter, dtype, gen, device):
    x = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    out = poisoned((rows, inter), dtype, device)
    activation.silu_mul(x.to(device), out=out)
    assert_written(out, "silu_mul")
    ref = activation.reference(x)
    g, u = x.double().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(g) * u
    # exp, add, divide, multiply: a few fp32 roundings each side, then one rounding to dtype.
    bound = 2 * unit_roundoff(dtype) * ref.double().abs() + 16 * U32 * exact.abs() + 2 * torch.finfo(dtype).tiny
    assert_within(out.cpu(), ref, bound, "silu_mul")


def test_leading_dims(gen, device):
    x = torch.randn(2, 3, 64, generator=gen).to(torch.float16)
    out = activation.silu_mul(x.to(device))
    assert out.shape == (2, 3, 32)
    ref = activation.reference(x.reshape(-1, 64)).reshape(2, 3, 32)
    bound = 2 * unit_roundoff(torch.float16) * ref.double().abs() + 16 * U32 * ref.double().abs() + 1e-7
    assert_within(out.cpu(), ref, bound, "silu_mul nd")
