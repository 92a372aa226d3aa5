"""W8A8-INT8 reference execution: real int8 x int8 -> int32 matmul plus the fp32 scale epilogue.

Bounds: the int32 accumulator is exact (|acc| <= K * 128 * 127 < 2^24, so its conversion to fp32
is exact too); the epilogue does two fp32 multiplications and one addition, so each output is
within 4 units of fp32 roundoff (u = 2^-24) of |acc * s_x * s_w| + |bias| from the float64 product
of the dequantized operands.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.errors import UserError
from lmfoundry.kernels.w8a8_reference import QUANT_INT8, quantize_reference
from lmfoundry.model.quantized_linear import ActivationQuantizedLinear as Int8Linear
from lmfoundry.model.quantized_linear import build_activation_linear as build_int8_linear
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import make_scheme, with_static_activations
from lmfoundry.quantizers.rtn import rtn_quantize_weight
from lmfoundry.runtime.checkpoint_model import build_linear

U = 2.0**-24


def quantize_activation_int8(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization, with scales shaped [M|1, 1] for the float64 checks."""
    q, scale = quantize_reference(x, QUANT_INT8, input_scale)
    return q, scale.reshape(-1, 1)


def _weight(out: int, k: int, seed: int = 0) -> tuple[torch.Tensor, QuantizedWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) / k**0.5
    return w, rtn_quantize_weight(w, make_scheme("w8a8").weights, torch.float32)


def _reference(xq, xs, qw: QuantizedWeight, bias):
    x64 = xq.double() * xs.double()
    w64 = qw.q.double() * qw.scale.double().reshape(-1, 1)
    ref = x64 @ w64.t()
    mag = (xq.double().abs() @ qw.q.double().abs().t()) * xs.double() * qw.scale.double().reshape(1, -1)
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    return ref, mag


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 256, 96), (33, 128, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dynamic_int8_matches_float64(m, k, n, with_bias):
    torch.manual_seed(m + k + n)
    x = torch.randn(m, k) * torch.linspace(0.1, 8.0, k)  # uneven channels, like real activations
    _, qw = _weight(n, k)
    bias = torch.randn(n) if with_bias else None
    lin = build_int8_linear(qw, bias, make_scheme("w8a8"), torch.float32)
    y = torch.full((m, n), float("nan"))
    y.copy_(lin(x))
    assert torch.isfinite(y).all()
    xq, xs = quantize_activation_int8(x, None)
    ref, mag = _reference(xq, xs, qw, bias)
    err = (y.double() - ref).abs()
    assert (err <= 4 * U * mag + 1e-30).all(), float((err / (mag + 1e-30)).max())
    # the reference operands are what the kernel sees: codes in range, one code per row at +-127
    assert xq.dtype == torch.int8 and int(xq.abs().amax(dim=1).min()) == 127
    # and the matmul is not trivially exact against the float input (quantization happened)
    assert not torch.allclose(y, x @ qw.dequantize(torch.float32).t() + (bias if bias is not None else 0))


def test_int32_accumulation_is_exact():
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (20, 512), dtype=torch.int8)
    b = torch.randint(-128, 128, (48, 512), dtype=torch.int8)
    acc = torch._int_mm(a, b.t())
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ b.long().t())


def test_static_per_tensor_uses_input_scale_and_saturates():
    torch.manual_seed(1)
    k, n = 64, 16
    _, qw = _weight(n, k)
    scheme = with_static_activations(make_scheme("w8a8"))
    x = torch.randn(5, k)
    s = torch.tensor([x.abs().max().item() / 127.0 / 2])  # half the range: the largest values clip
    lin = build_int8_linear(qw, None, scheme, torch.float32, input_scale=s)
    xq, xs = quantize_activation_int8(x, s)
    assert xs.shape == (1, 1) and float(xs) == float(s)
    assert int(xq.max()) == 127 or int(xq.min()) == -128
    ref, mag = _reference(xq, xs, qw, None)
    assert ((lin(x).double() - ref).abs() <= 4 * U * mag + 1e-30).all()


def test_bf16_model_dtype_and_batch_shape():
    torch.manual_seed(2)
    _, qw = _weight(32, 64)
    lin = build_int8_linear(qw, None, make_scheme("w8a8"), torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    y = lin(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    xq, xs = quantize_activation_int8(x.reshape(-1, 64), None)
    ref, mag = _reference(xq, xs, qw, None)
    # one more rounding: the cast of the fp32 result to bf16 (u = 2^-8)
    assert ((y.reshape(-1, 32).double() - ref).abs() <= 2.0**-8 * mag + 4 * U * mag + 1e-30).all()


def test_zero_row_gives_bias_only():
    _, qw = _weight(8, 32)
    bias = torch.randn(8)
    lin = build_int8_linear(qw, bias, make_scheme("w8a8"), torch.float32)
    y = lin(torch.zeros(3, 32))
    assert torch.equal(y, bias.expand(3, 8))


def test_registered_for_int_quantized_and_static_needs_scale():
    _, qw = _weight(8, 32)
    assert isinstance(build_linear(qw, None, make_scheme("w8a8"), torch.float32), Int8Linear)
    with pytest.raises(UserError, match="input_scale"):
        build_int8_linear(qw, None, with_static_activations(make_scheme("w8a8")), torch.float32)


def test_compressed_tensors_convention_is_selectable():
    """act_qmax 127.5 reproduces compressed-tensors' fake quantization (absmax / 127.5)."""
    torch.manual_seed(3)
    _, qw = _weight(16, 64)
    lin = build_int8_linear(qw, None, make_scheme("w8a8"), torch.float32)
    lin.act_qmax = 127.5
    x = torch.randn(4, 64)
    scale = x.abs().amax(dim=1, keepdim=True) / 127.5
    xq = torch.round(x / scale).clamp(-128, 127)
    emulated = (xq * scale) @ qw.dequantize(torch.float32).t()
    assert torch.allclose(lin(x), emulated, rtol=1e-5, atol=1e-6)
