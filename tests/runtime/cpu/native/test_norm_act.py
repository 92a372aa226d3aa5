"""The one-pass RMSNorm and SiLU(gate) * up (`runtime/cpu/native/norm_act.c`) against the reference
model's bf16 arithmetic (`norm_quant.rmsnorm_reference`, `norm_act.silu_mul_reference`).

Error bounds: RMSNorm, `error_bounds.rmsnorm_bound` (the normalized value may round one bf16 step
apart, the gain product once more). SiLU(gate) * up: each side computes silu in fp32 (ours: a
polynomial exp and a refined reciprocal estimate, within 32 fp32 ulps; PyTorch's within a few),
rounds it to bf16, multiplies by up and rounds again, so the two differ by at most
2 (2u + 32 u32) |silu(g) up| plus underflow. Outputs start as NaN; every element must be written.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import U32, assert_within, assert_written, rmsnorm_bound, unit_roundoff
from lmfoundry.kernels.norm_quant import rmsnorm_reference
from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.norm_act import load_norm_act, silu_mul_reference

kernel = load_norm_act()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"no native kernel: {unavailable_reason('norm_act')}")


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 1000), (300, 576)])
def test_rms_norm_matches_the_reference(gen, rows, dim) -> None:
    x = (torch.randn(rows, dim, generator=gen) * 3 + 0.1).to(torch.bfloat16)
    gain = (torch.rand(dim, generator=gen) + 0.5).to(torch.bfloat16)
    out = kernel.rms_norm(x, gain, 1e-5)
    assert out is not None and out.shape == x.shape and out.dtype == torch.bfloat16
    assert_written(out, "rms_norm")
    ref = rmsnorm_reference(x, gain, 1e-5)
    assert_within(out, ref, rmsnorm_bound(x, gain, ref, 1e-5), "rms_norm")


def test_rms_norm_keeps_leading_dims_and_refuses_what_it_cannot_read(gen) -> None:
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    gain = torch.ones(64, dtype=torch.bfloat16)
    out = kernel.rms_norm(x, gain, 1e-6)
    assert out is not None and out.shape == (2, 3, 64)
    assert kernel.rms_norm(x.float(), gain, 1e-6) is None  # not bf16: the caller runs the reference
    assert kernel.rms_norm(x.transpose(1, 2), torch.ones(3, dtype=torch.bfloat16), 1e-6) is None  # strided columns


@pytest.mark.parametrize("rows,n", [(1, 1536), (5, 40), (3, 45), (64, 1536)])
def test_silu_mul_matches_the_reference(gen, rows, n) -> None:
    fused = (torch.randn(rows, 2 * n, generator=gen) * 4 + 0.05).to(torch.bfloat16)
    gate, up = fused.split(n, dim=-1)  # strided views of one gate/up product, as the MLP has them
    out = kernel.silu_mul(gate, up)
    assert out is not None and out.is_contiguous() and out.shape == (rows, n)
    assert_written(out, "silu_mul")
    ref = silu_mul_reference(gate.clone(), up)
    g = gate.double()
    exact = (g * torch.sigmoid(g) * up.double()).abs()
    u = unit_roundoff(torch.bfloat16)
    bound = 2 * (2 * u + 32 * U32) * exact + 2 * torch.finfo(torch.bfloat16).tiny
    assert_within(out, ref, bound, "silu_mul")


def test_silu_mul_extremes(gen) -> None:
    gate = torch.tensor([[-100.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 3.0] * 2], dtype=torch.bfloat16)
    up = torch.full_like(gate, 2.0)
    out = kernel.silu_mul(gate, up)
    assert out is not None
    assert torch.isfinite(out.float()).all()
    assert_within(out, silu_mul_reference(gate.clone(), up), 2 * 2 * unit_roundoff(torch.bfloat16) * 200 + 1e-30,
                  "silu_mul")


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 45), (70, 576)])
def test_float32_silu_mul_matches_silu_and_a_row_is_the_same_in_any_batch(gen, rows, n) -> None:
    """The deterministic mode's float32 activation: within a few float32 roundings of
    silu(gate) * up (its exp is a polynomial), and each row's values do not depend on the rows
    around it or on the thread count."""
    fused = torch.randn(rows, 2 * n, generator=gen) * 6
    gate, up = fused.split(n, dim=-1)
    out = kernel.silu_mul(gate, up)
    assert out is not None and out.dtype == torch.float32 and out.shape == (rows, n)
    g = gate.double()
    exact = g * torch.sigmoid(g) * up.double()
    assert_within(out, exact, 16 * U32 * exact.abs() + 1e-30, "silu_mul float32")
    for threads in (1, 2, 3):
        for r in (0, rows - 1):
            alone = kernel.silu_mul(gate[r : r + 1], up[r : r + 1], threads=threads)
            assert alone is not None and torch.equal(alone[0], out[r]), (r, threads)
