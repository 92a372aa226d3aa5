"""FP8 e4m3 GEMM with per-tensor and per-token x per-channel scales."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import fp8_gemm, scaled_mm
from lmfoundry.kernels.error_bounds import (
    U32,
    Accumulation,
    assert_within,
    assert_written,
    dot_bound,
    poisoned,
    unit_roundoff,
)
from lmfoundry.kernels.scaled_mm import ScaledLinear

E4M3 = torch.float8_e4m3fn


def fp8_acc(device: str, m: int, n: int, k: int) -> Accumulation:
    """fp32 in the interpreter; on a GPU, the kernel's own tiled accumulation with the tiles the
    default launcher (JIT, `default_config`) runs."""
    if device == "cpu":
        return U32
    return scaled_mm.fp8_accumulation(scaled_mm.default_config({"M": m, "N": n, "K": k}))


@pytest.mark.parametrize(
    "m,n,k,per_token,per_channel,bias,dtype",
    [
        (1, 64, 128, True, True, False, torch.bfloat16),
        (45, 96, 96, True, True, True, torch.float16),
        (70, 80, 256, False, False, False, torch.bfloat16),
        (129, 32, 64, True, False, False, torch.float16),
    ],
)
def test_gemm_matches_reference(m, n, k, per_token, per_channel, bias, dtype, gen, device):
    xq = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(E4M3)
    wq = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(E4M3)
    xs = torch.rand(m if per_token else 1, generator=gen) * 0.01 + 1e-3
    ws = (torch.rand(n if per_channel else 1, 1, generator=gen) * 0.01 + 1e-3).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    lin = ScaledLinear(wq, ws, None if per_token else xs, b)
    lin_d = ScaledLinear(wq.to(device), ws.to(device), None if per_token else xs.to(device), None if b is None else b.to(device))
    out = poisoned((m, n), dtype, device)
    fp8_gemm.fp8_gemm(xq.to(device), xs.to(device), lin_d, dtype, out=out)
    assert_written(out, "fp8")
    ref = fp8_gemm.reference(xq, xs, lin, dtype)
    # e4m3 products are exact in fp32; the sum carries γ_K, the epilogue two products and a bias.
    abs_products = (xq.double().abs() @ wq.double().abs().t()) * xs.double().reshape(-1, 1) * ws.double().reshape(1, -1)
    if bias:
        abs_products = abs_products + b.double().abs()
    bound = dot_bound(ref, abs_products, k, dtype, fp8_acc(device, m, n, k), extra=4)
    assert_within(out.cpu(), ref, bound, f"fp8 {m}x{n}x{k}")


def test_linear_error_is_the_quantization_error(gen, device):
    """fp8_linear(x) vs x @ W^T: within e4m3's relative rounding of x (2^-4) plus subnormals."""
    m, n, k, dtype = 6, 48, 128, torch.float16
    x = torch.randn(m, k, generator=gen).to(dtype)
    w_float = torch.randn(n, k, generator=gen) * 0.05
    ws = (w_float.abs().amax(-1, keepdim=True) / 448).to(dtype)
    wq = (w_float / ws.float()).clamp(-448, 448).to(E4M3)
    lin = ScaledLinear(wq.to(device), ws.to(device))
    out = fp8_gemm.fp8_linear(x.to(device), lin).cpu()
    w = wq.double() * ws.double()
    exact = x.double() @ w.t()
    s = x.double().abs().amax(-1, keepdim=True) / 448
    e_x = 2.0**-4 * x.double().abs() * (1 + 8 * U32) + 2.0**-10 * s + 4 * U32 * x.double().abs()
    bound = e_x @ w.abs().t() + dot_bound(exact, x.double().abs() @ w.abs().t(), k + 2, dtype)
    bound = bound + unit_roundoff(dtype) * exact.abs()
    assert_within(out, exact, bound, "fp8 linear")


def test_rejects_int8_operands():
    lin = ScaledLinear(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1))
    with pytest.raises(TypeError):
        fp8_gemm.fp8_gemm(torch.zeros(2, 32, dtype=torch.int8), torch.ones(2), lin, torch.float16)
