"""FP8 (e4m3) W8A8 reference execution with float8 tensors and torch._scaled_mm.

Bound: products of two e4m3 values are exact in fp32 and the K-term fp32 sum is within
gamma_K = K*u/(1-K*u) of sum|x_k w_k| (u = 2^-24); two scale multiplications and the bias add
contribute 3 more units. Checked elementwise against float64 on the dequantized operands.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.errors import UserError
from lmfoundry.kernels.w8a8_reference import QUANT_FP8, quantize_reference
from lmfoundry.model.quantized_linear import ActivationQuantizedLinear as Fp8Linear
from lmfoundry.model.quantized_linear import build_activation_linear as build_fp8_linear
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import make_scheme
from lmfoundry.quantizers.rtn import rtn_quantize_weight
from lmfoundry.runtime.checkpoint_model import build_linear

FP8_DTYPE = torch.float8_e4m3fn
MIN_DYNAMIC_SCALE = 1.0 / (448.0 * 512.0)  # vLLM's floor of a dynamic fp8 scale


def quantize_activation_fp8(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization, with scales shaped [M|1, 1] for the float64 checks."""
    q, scale = quantize_reference(x, QUANT_FP8, input_scale)
    return q, scale.reshape(-1, 1)


U = 2.0**-24


def _weight(scheme_name: str, out: int, k: int, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) / k**0.5
    return rtn_quantize_weight(w, make_scheme(scheme_name).weights, torch.float32)


def _check(y, xq, xs, qw, bias, k):
    x64 = xq.double() * xs.double()
    w64 = qw.q.double() * qw.scale.double().reshape(-1, 1)
    ref = x64 @ w64.t()
    mag = x64.abs() @ w64.abs().t()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    gamma = (k + 3) * U / (1 - (k + 3) * U)
    err = (y.double() - ref).abs()
    assert (err <= gamma * mag + 1e-30).all(), float((err / (mag + 1e-30)).max())


@pytest.mark.parametrize("scheme_name", ["fp8-dynamic", "fp8-static"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (9, 256, 80), (40, 128, 130)])
def test_fp8_matches_float64(scheme_name, m, k, n):
    torch.manual_seed(m * k + n)
    x = torch.randn(m, k) * torch.linspace(0.05, 6.0, k)
    qw = _weight(scheme_name, n, k)
    bias = torch.randn(n)
    static = scheme_name == "fp8-static"
    input_scale = (x.abs().max() / 448.0).reshape(1) if static else None
    lin = build_fp8_linear(qw, bias, make_scheme(scheme_name), torch.float32, input_scale=input_scale)
    y = torch.full((m, n), float("nan"))
    y.copy_(lin(x))
    assert torch.isfinite(y).all()
    xq, xs = quantize_activation_fp8(x, input_scale)
    assert xq.dtype == FP8_DTYPE and qw.q.dtype == FP8_DTYPE
    assert xs.shape == ((1, 1) if static else (m, 1))
    assert float(xq.float().abs().max()) <= 448.0
    _check(y, xq, xs, qw, bias, k)
    assert not torch.allclose(y, x @ qw.dequantize(torch.float32).t() + bias)


def test_weight_scale_layouts():
    assert _weight("fp8-dynamic", 16, 32).scale.shape == (16, 1)  # per channel
    assert _weight("fp8-static", 16, 32).scale.shape == (1,)  # per tensor


def test_zero_row_uses_minimum_scale_and_returns_bias():
    qw = _weight("fp8-dynamic", 8, 32)
    bias = torch.randn(8)
    lin = build_fp8_linear(qw, bias, make_scheme("fp8-dynamic"), torch.float32)
    x = torch.zeros(2, 32)
    _, xs = quantize_activation_fp8(x, None)
    assert torch.all(xs == MIN_DYNAMIC_SCALE)
    assert torch.equal(lin(x), bias.expand(2, 8))


def test_bf16_activations():
    qw = _weight("fp8-dynamic", 32, 64)
    lin = build_fp8_linear(qw, None, make_scheme("fp8-dynamic"), torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16
    xq, xs = quantize_activation_fp8(x, None)
    x64, w64 = xq.double() * xs.double(), qw.q.double() * qw.scale.double()
    ref, mag = x64 @ w64.t(), x64.abs() @ w64.abs().t()
    assert ((y.double() - ref).abs() <= (2.0**-8 + 70 * U) * mag + 1e-30).all()


def test_registered_for_float_quantized_and_static_needs_scale():
    qw = _weight("fp8-dynamic", 8, 32)
    assert isinstance(build_linear(qw, None, make_scheme("fp8-dynamic"), torch.float32), Fp8Linear)
    with pytest.raises(UserError, match="input_scale"):
        build_fp8_linear(_weight("fp8-static", 8, 32), None, make_scheme("fp8-static"), torch.float32)
