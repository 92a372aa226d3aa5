"""The 4-bit product (`runtime/cpu/native/int4_gemm.c`) against its reference: the codes dequantized
exactly (float64 here) and multiplied in float64.

Error bound (`error_bounds.dot_bound`): each product of a bf16 input and a code is exact in fp32;
per group the kernel sums g of them in fp32, multiplies the sum by the group's scale (one rounding)
and adds zero x Σx for asymmetric codes, then accumulates the K/g groups and the bias in fp32: at
most K + 2 K/g + 2 roundings of terms bounded by Σ_k |x_k| (|(u_k - 8) s| + |z|), then one rounding
to bf16. Outputs start as NaN; every element must be written.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned
from lmfoundry.runtime.cpu.native.int4_gemm import Int4Weight, dequantize, fits, load_int4_gemm, pack

kernel = load_int4_gemm()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 BF16 C product here")


def random_weight(gen: torch.Generator, n: int, k: int, group: int, asymmetric: bool) -> Int4Weight:
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randn(n, k // group, generator=gen) * 0.05 if asymmetric else None
    return pack(codes, scale, zero, group)


def check(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    out = poisoned((x.shape[0], w.out_features), torch.bfloat16)
    kernel(x, w, bias, out)
    assert_written(out, "int4_gemm")
    wd = dequantize(w).double()
    ref = torch.nn.functional.linear(x.double(), wd, None if bias is None else bias.double())
    g = w.group
    zero = _zero(w) if w.zero is not None else torch.zeros_like(wd)
    abs_w = (wd - zero).abs() + zero.abs()  # |(u - 8) s| + |z|: the two sums the kernel forms
    products = x.double().abs() @ abs_w.t() + (0 if bias is None else bias.double().abs())
    k = w.in_features
    assert_within(out, ref, dot_bound(ref, products, k + 2 * (k // g) + 2, torch.bfloat16), "int4_gemm")
    return out


def _zero(w: Int4Weight) -> torch.Tensor:
    assert w.zero is not None
    n, k, g = w.out_features, w.in_features, w.group
    return w.zero.permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, 1).double()


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 17, 67])
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (48, 256, 64), (960, 576, 64), (64, 512, 128)])
def test_matches_the_dequantized_product(gen, m, n, k, group) -> None:
    w = random_weight(gen, n, k, group, asymmetric=False)
    wide = torch.randn(m, k + 64, generator=gen).to(torch.bfloat16)
    check(wide[:, 16 : 16 + k], w, None)  # rows with a stride of their own


@pytest.mark.parametrize("m", [1, 5, 12])
def test_asymmetric_codes_and_bias(gen, m) -> None:
    w = random_weight(gen, 80, 384, 32, asymmetric=True)
    bias = torch.randn(80, generator=gen).to(torch.bfloat16)
    check(torch.randn(m, 384, generator=gen).to(torch.bfloat16), w, bias)


def test_a_row_computes_the_same_in_any_batch(gen) -> None:
    """Rows of a block never mix: a token's product alone equals its product among 30 others,
    bit for bit (what makes a prefix-cached prompt greedy-equal to a cold one)."""
    w = random_weight(gen, 192, 576, 64, asymmetric=True)
    x = torch.randn(31, 576, generator=gen).to(torch.bfloat16)
    together = torch.empty(31, 192, dtype=torch.bfloat16)
    kernel(x, w, None, together)
    for i in (0, 7, 8, 30):
        alone = torch.empty(1, 192, dtype=torch.bfloat16)
        kernel(x[i : i + 1], w, None, alone)
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("asymmetric", [False, True])
def test_dequantized_weight_is_the_reference_rounded_once(gen, asymmetric) -> None:
    w = random_weight(gen, 48, 192, 64, asymmetric)
    out = poisoned((48, 192), torch.bfloat16)
    kernel.dequantize(w, out)
    assert_written(out, "int4 dequantize")
    exact = dequantize(w).double()
    # (u - 8) * s + z as one fused multiply-add in fp32, then one rounding to bf16
    assert_within(out, exact, 2.0**-8 * exact.abs() + 2.0**-24 * (exact.abs() + 1) + 1e-38, "int4 dequantize")


def test_packed_layout() -> None:
    codes = torch.arange(32 * 4).remainder(16).view(32, 4)
    w = pack(codes, torch.ones(32, 2), None, 2)
    assert w.codes.shape == (2, 2, 16) and w.scale.shape == (2, 2, 16)
    assert int(w.codes[1, 1, 3]) == int(codes[19, 2]) | int(codes[19, 3]) << 4
    assert torch.equal(dequantize(w), (codes - 8).float())
    assert fits(960, 576, 64) and not fits(200, 576, 64) and not fits(960, 576, 7)


def test_mismatched_arguments_are_refused(gen) -> None:
    w = random_weight(gen, 32, 64, 32, asymmetric=False)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="int4_gemm"):
        kernel(x.float(), w, None, torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int4_gemm"):
        kernel(x, w, None, torch.empty(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kernel(x, w, torch.zeros(16, dtype=torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int4_gemm"):
        pack(torch.zeros(20, 64, dtype=torch.long), torch.ones(20, 2), None, 32)
