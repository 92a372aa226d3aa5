"""W8A8 int8 GEMM (int32 accumulation, scale epilogue) and the quantize-then-GEMM linear."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import w8a8
from lmfoundry.kernels.error_bounds import U32, assert_within, assert_written, dot_bound, poisoned, unit_roundoff
from lmfoundry.kernels.scaled_mm import ScaledLinear


def int8(shape, gen):
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


@pytest.mark.parametrize(
    "m,n,k,per_token,per_channel,bias,dtype",
    [
        (1, 64, 128, True, True, False, torch.bfloat16),  # M=1
        (33, 96, 160, True, True, True, torch.float16),  # K not a block multiple, bias
        (70, 100, 64, False, False, False, torch.bfloat16),  # per tensor both, N odd-ish
        (130, 48, 256, True, False, True, torch.float16),  # M > 2 blocks, per-tensor weight
    ],
)
def test_gemm_matches_reference(m, n, k, per_token, per_channel, bias, dtype, gen, device):
    xq, wq = int8((m, k), gen), int8((n, k), gen)
    xs = torch.rand(m if per_token else 1, generator=gen) * 0.01 + 1e-3
    ws = (torch.rand(n if per_channel else 1, 1, generator=gen) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    lin = ScaledLinear(wq, ws, None if per_token else xs, b)
    lin_d = ScaledLinear(wq.to(device), ws.to(device), None if per_token else xs.to(device), None if b is None else b.to(device))
    out = poisoned((m, n), dtype, device)
    w8a8.w8a8_gemm(xq.to(device), xs.to(device), lin_d, dtype, out=out)
    assert_written(out, "w8a8")
    ref = w8a8.reference(xq, xs, lin, dtype)
    # The int32 sum is exact; the epilogue is two fp32 products and a bias add, then one rounding.
    scaled = (xq.double() @ wq.double().t()).abs() * xs.double().reshape(-1, 1) * ws.double().reshape(1, -1)
    if bias:
        scaled = scaled + b.double().abs()
    assert_within(out.cpu(), ref, dot_bound(ref, scaled, 2, dtype), f"w8a8 {m}x{n}x{k}")


def test_int32_accumulation_is_exact(gen, device):
    """With unit scales and fp32 output the result is the exact integer dot product."""
    m, n, k = 5, 32, 256
    xq = torch.full((m, k), 127, dtype=torch.int8)
    wq = torch.full((n, k), -127, dtype=torch.int8)
    wq[:, ::2] = 127
    lin = ScaledLinear(wq.to(device), torch.ones(n, 1, device=device))
    out = w8a8.w8a8_gemm(xq.to(device), torch.ones(m, device=device), lin, torch.float32)
    assert torch.equal(out.cpu(), (xq.double() @ wq.double().t()).float())


@pytest.mark.parametrize("static", [False, True])
def test_linear_error_is_the_quantization_error(static, gen, device):
    """y = w8a8_linear(x) differs from x @ W^T by no more than x's int8 rounding allows."""
    m, n, k, dtype = 9, 64, 192, torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(dtype)
    wq = int8((n, k), gen)
    ws = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).to(dtype)
    input_scale = (x.float().abs().amax() / 127).reshape(1) if static else None
    lin = ScaledLinear(wq.to(device), ws.to(device), None if input_scale is None else input_scale.to(device))
    out = w8a8.w8a8_linear(x.to(device), lin).cpu()
    w = wq.double() * ws.double()
    exact = x.double() @ w.t()
    s = input_scale.double() if static else x.double().abs().amax(-1, keepdim=True) / 127
    # |q*s - x| <= s/2 (rounding) + fp32 division/scale error; then the GEMM's own bound.
    e_x = s / 2 * (1 + 8 * U32) + 4 * U32 * x.double().abs()
    bound = e_x @ w.abs().t() + dot_bound(exact, x.double().abs() @ w.abs().t(), k + 2, dtype)
    bound = bound + unit_roundoff(dtype) * exact.abs()
    assert_within(out, exact, bound, "w8a8 linear")
