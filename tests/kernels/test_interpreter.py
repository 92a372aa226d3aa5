"""The interpreter corrections the kernel tests rely on do what they claim."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import is_interpreter

pytestmark = pytest.mark.skipif(not is_interpreter(), reason="only meaningful under TRITON_INTERPRET=1")


@triton.jit
def _convert(x_ptr, bf_ptr, f8_ptr, i2bf_ptr, N, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    m = r < N
    x = tl.load(x_ptr + r, mask=m)
    tl.store(bf_ptr + r, x.to(tl.bfloat16), mask=m)
    tl.store(f8_ptr + r, x.to(tl.float8e4nv), mask=m)
    tl.store(i2bf_ptr + r, (r - 100).to(tl.bfloat16), mask=m)


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    b = tl.load(b_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))


def test_conversions_round_to_nearest_even(gen):
    n = 4096
    x = torch.randn(n, generator=gen) * torch.logspace(-4, 2.6, n)
    bf, f8 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.float8_e4m3fn)
    i2bf = torch.empty(n, dtype=torch.bfloat16)
    _convert[(1,)](x, bf, f8, i2bf, n, BLOCK=n)
    assert torch.equal(bf, x.to(torch.bfloat16))
    assert torch.equal(f8.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(i2bf, (torch.arange(n) - 100).to(torch.bfloat16))


def test_bf16_dot(gen):
    a = torch.randn(32, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(32, 32, generator=gen).to(torch.bfloat16)
    c = torch.empty(32, 32)
    _dot[(1,)](a, b, c, BLOCK=32)
    exact = a.double() @ b.double()
    assert torch.allclose(c.double(), exact, rtol=0, atol=32 * 2.0**-24 * (a.double().abs() @ b.double().abs()).max().item())
