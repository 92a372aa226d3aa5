"""The few-row bf16 product (`runtime/cpu/native/bf16_gemv.c`) against F.linear.

Error bound (`error_bounds.dot_bound`): both sides multiply bf16 inputs exactly in fp32 (AVX-512
BF16 dot products, pairs of products added in fp32), accumulate K products in fp32 in their own
order and round once to bf16. Outputs start as NaN; every element must be written.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned
from lmfoundry.runtime.cpu.native.bf16_gemv import Bf16Gemv, load_bf16_gemv

kernel = load_bf16_gemv()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX-512 BF16 C product here")


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (1, 960, 576), (3, 576, 1536), (4, 48, 96), (8, 960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(gen, m, n, k, bias) -> None:
    w = (torch.randn(n, k, generator=gen) + 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    wide = torch.randn(m, k + 64, generator=gen).to(torch.bfloat16)
    x = wide[:, 16 : 16 + k]  # rows with a stride of their own, as a slice of a wider activation
    out = poisoned((m, n), torch.bfloat16)
    kernel(x, Bf16Gemv.block(w), b, out)
    assert_written(out, "bf16_gemv")
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    products = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert_within(out, ref, dot_bound(ref, products, k + 1, torch.bfloat16), "bf16_gemv")


def test_blocked_layout_is_tiles_of_16_rows_by_32() -> None:
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    blocked = Bf16Gemv.block(w)
    assert blocked.shape == (2, 2, 16, 32)
    assert torch.equal(blocked[1, 0, 3], w[16 + 3, :32]) and torch.equal(blocked[0, 1, 15], w[15, 32:])
    assert Bf16Gemv.fits(960, 576) and not Bf16Gemv.fits(200, 96) and not Bf16Gemv.fits(192, 80)


def test_mismatched_arguments_are_refused(gen) -> None:
    w = Bf16Gemv.block(torch.randn(32, 64, generator=gen).to(torch.bfloat16))
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_gemv"):
        kernel(x.float(), w, None, torch.empty(2, 32))
    with pytest.raises(ValueError, match="bf16_gemv"):
        kernel(x, w, None, torch.empty(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kernel(x, w, torch.zeros(16, dtype=torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16))
