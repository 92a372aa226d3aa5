"""The 8-bit product (`runtime/cpu/native/int8_gemm.c`) against its reference: the codes dequantized
exactly (float64 here) and multiplied in float64.

Error bound (`error_bounds.dot_bound`): each product of a bf16 input and an int8 code is exact in
fp32 (|code| <= 128: 8 significant bits, widened to bf16 exactly); the kernel sums the K of them in
fp32, multiplies by the channel's scale and adds the bias (and -zero_scaled x Σx for asymmetric
codes, Σx itself a K-term fp32 sum): at most 2K + 3 roundings of terms bounded by
Σ_k |x_k| (|code_k s| + |zs|), then one rounding to bf16. Outputs start as NaN; every element must be
written.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned
from lmfoundry.runtime.cpu.native.int8_gemm import Int8Weight, dequantize, fits, load_int8_gemm, pack

kernel = load_int8_gemm()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 BF16 C product here")


def random_weight(gen: torch.Generator, n: int, k: int, asymmetric: bool) -> Int8Weight:
    codes = torch.randint(-128, 128, (n, k), generator=gen)
    scale = torch.rand(n, generator=gen) * 0.01 + 0.001
    return pack(codes, scale, torch.randn(n, generator=gen) * 0.05 if asymmetric else None)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 70])
@pytest.mark.parametrize("n,k,asymmetric", [(16, 32, False), (960, 576, False), (48, 1536, True)])
def test_matches_the_dequantized_product(gen, m, n, k, asymmetric) -> None:
    w = random_weight(gen, n, k, asymmetric)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16) if asymmetric else None
    wide = torch.randn(m, k + 32, generator=gen).to(torch.bfloat16)
    x = wide[:, 8 : 8 + k]
    out = poisoned((m, n), torch.bfloat16)
    kernel(x, w, bias, out)
    assert_written(out, "int8_gemm")
    wd = dequantize(w).double()
    ref = torch.nn.functional.linear(x.double(), wd, None if bias is None else bias.double())
    zs = torch.zeros(n, dtype=torch.float64) if w.zero_scaled is None else w.zero_scaled.double()
    abs_w = (wd + zs[:, None]).abs() + zs.abs()[:, None]
    products = x.double().abs() @ abs_w.t() + (0 if bias is None else bias.double().abs())
    assert_within(out, ref, dot_bound(ref, products, 2 * k + 3, torch.bfloat16), "int8_gemm")


def test_a_row_computes_the_same_in_any_batch(gen) -> None:
    w = random_weight(gen, 64, 256, asymmetric=True)
    x = torch.randn(19, 256, generator=gen).to(torch.bfloat16)
    together = torch.empty(19, 64, dtype=torch.bfloat16)
    kernel(x, w, None, together)
    for i in (0, 8, 18):
        alone = torch.empty(1, 64, dtype=torch.bfloat16)
        kernel(x[i : i + 1], w, None, alone)
        assert torch.equal(alone[0], together[i])


def test_packed_layout() -> None:
    codes = (torch.arange(32 * 4) % 251 - 125).view(32, 4)
    w = pack(codes, torch.ones(32), None)
    assert w.codes.shape == (2, 2, 32)
    assert int(w.codes[1, 1, 2 * 3]) == int(codes[19, 2]) and int(w.codes[1, 1, 2 * 3 + 1]) == int(codes[19, 3])
    assert torch.equal(dequantize(w), codes.float())
    assert fits(960, 576) and not fits(200, 576) and not fits(960, 575)
    with pytest.raises(ValueError, match="int8_gemm"):
        pack(torch.zeros(20, 64, dtype=torch.long), torch.ones(20), None)
