"""The bf16 product for CPUs without bf16 arithmetic (`runtime/cpu/native/bf16_fma_gemm.c`) against F.linear.

Error bound (`error_bounds.dot_bound`): bf16 values widen to float32 exactly, so every product of
two bf16 inputs is exact in float32 (8-bit significands); the kernel accumulates K of them with
fused multiply-adds in its own order, adds the bias and rounds once to bf16, as a bf16 GEMM with
float32 accumulation does. Outputs start as NaN; every element must be written (and none past N:
the padded channels of the last panel are never stored).
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned
from lmfoundry.runtime.cpu.native.bf16_fma_gemm import Bf16FmaGemm, F32FmaGemm, load_bf16_fma_gemm, load_f32_fma_gemm

kernel = load_bf16_fma_gemm()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX2 + FMA C product here")


# row counts around the kernel's groups of six and its row blocks (256 KiB of float32 x: 113 rows
# of K = 576), output counts with and without a partial last panel
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (1, 960, 576), (2, 200, 96), (5, 48, 7), (6, 576, 1536),
                                   (13, 3072, 64), (40, 40, 576), (130, 96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(gen, m, n, k, bias) -> None:
    w = (torch.randn(n, k, generator=gen) + 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    wide = torch.randn(m, k + 64, generator=gen).to(torch.bfloat16)
    x = wide[:, 16 : 16 + k]  # rows with a stride of their own, as a slice of a wider activation
    whole = poisoned((m, n + 5), torch.bfloat16)
    out = whole[:, :n]  # strided rows; the 5 columns past N must stay NaN
    kernel(x, Bf16FmaGemm.block(w), b, out)
    assert_written(out, "bf16_fma_gemm")
    assert bool(whole[:, n:].isnan().all()), "bf16_fma_gemm wrote past the last output channel"
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    products = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert_within(out, ref, dot_bound(ref, products, k + 1, torch.bfloat16), "bf16_fma_gemm")


def test_panels_are_16_channels_by_k_padded_with_zeros() -> None:
    w = torch.arange(40 * 8, dtype=torch.float32).view(40, 8).to(torch.bfloat16)
    panels = Bf16FmaGemm.block(w)
    assert panels.shape == (3, 8, 16)
    assert torch.equal(panels[1, 5, 3], w[16 + 3, 5]) and torch.equal(panels[2, 7, 7], w[39, 7])
    assert not bool(panels[2, :, 8:].any())  # channels 40..47: zero padding
    assert torch.equal(Bf16FmaGemm.unblock(panels, 40), w)


def test_mismatched_arguments_are_refused(gen) -> None:
    w = Bf16FmaGemm.block(torch.randn(32, 64, generator=gen).to(torch.bfloat16))
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_fma_gemm"):
        kernel(x.float(), w, None, torch.empty(2, 32))
    with pytest.raises(ValueError, match="bf16_fma_gemm"):
        kernel(x, w, None, torch.empty(2, 16, dtype=torch.bfloat16))  # 16 outputs, two panels
    with pytest.raises(ValueError, match="bf16_fma_gemm"):
        kernel(x[:, :32], w, None, torch.empty(2, 32, dtype=torch.bfloat16))  # K of the panels is 64
    with pytest.raises(ValueError, match="bias"):
        kernel(x, w, torch.zeros(16, dtype=torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16))


def test_a_row_is_the_same_in_any_batch(gen) -> None:
    """A row's product does not depend on how many rows come with it or where it sits among them
    (one FMA chain per output, in k order): a token's K/V are the same computed in a prompt chunk
    or alone in a decode step, so a prefix-cached request repeats the cold one bit for bit.

    Every row is the same vector, and the weight's last column and the bias cancel its product to
    within a few float32 roundings of the terms: what is left (and rounded to bf16) is the summation
    order's own error, so any change of order between batch shapes changes outputs."""
    n, k = 200, 576
    x0 = torch.cat([torch.randn(k - 1, generator=gen), torch.ones(1)]).to(torch.bfloat16)
    w = torch.randn(n, k - 1, generator=gen).to(torch.bfloat16)
    last = (-(w.double() @ x0[:-1].double())).to(torch.bfloat16)  # cancels most of each product
    w = torch.cat([w, last[:, None]], 1)
    bias = (-(w.double() @ x0.double())).to(torch.bfloat16)  # and most of what is left
    panels = Bf16FmaGemm.block(w)
    x = x0.expand(300, k).contiguous()
    whole = torch.empty(300, n, dtype=torch.bfloat16)
    kernel(x, panels, bias, whole)
    assert bool((whole != 0).any())  # the residues are there to compare
    assert torch.equal(whole, whole[:1].expand(300, n)), "rows differ by their place in the batch"
    for rows in (1, 2, 5, 13):
        part = torch.empty(rows, n, dtype=torch.bfloat16)
        kernel(x[:rows], panels, bias, part)
        assert torch.equal(part, whole[:rows]), rows


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (6, 200, 96), (130, 96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_product_matches_f_linear_and_a_row_is_the_same_in_any_batch(gen, m, n, k, bias) -> None:
    """`lmf_f32_fma_gemm`, the deterministic mode's float32 linear: F.linear in float64 within the
    float32 dot-product bound; each row equal to itself computed alone."""
    f32 = load_f32_fma_gemm()
    assert f32 is not None
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(m, k + 16, generator=gen)[:, 8 : 8 + k]  # strided rows
    panels = F32FmaGemm.block(w)
    assert panels.dtype == torch.float32 and torch.equal(F32FmaGemm.unblock(panels, n), w)
    out = poisoned((m, n), torch.float32)
    f32(x, panels, b, out)
    assert_written(out, "f32_fma_gemm")
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    products = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert_within(out, ref, dot_bound(ref, products, k + 1, torch.float32), "f32_fma_gemm")
    for r in (0, m - 1):
        alone = torch.empty(1, n)
        f32(x[r : r + 1], panels, b, alone)
        assert torch.equal(alone[0], out[r]), r
    with pytest.raises(ValueError, match="f32_fma_gemm"):
        f32(x.to(torch.bfloat16), panels, b, out)
