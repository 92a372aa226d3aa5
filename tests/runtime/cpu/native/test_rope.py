"""The one-call rotary of q and k (`runtime/cpu/native/rope.c`) against `attention_math.apply_rotary`: the same
bits (each product of bf16 values is exact in fp32 and both sides round where the reference's ops
do), heads read from strided views of a fused q/k/v output, and inputs it declines."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.model.attention_math import apply_rotary
from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.rope import load_rope

kernel = load_rope()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"no native kernel: {unavailable_reason('rope')}")


def tables(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


@pytest.mark.parametrize("t,hq,hk,d", [(1, 9, 3, 64), (40, 4, 2, 128), (300, 9, 3, 64), (5, 2, 1, 24)])
def test_same_bits_as_apply_rotary(gen, t, hq, hk, d) -> None:
    fused = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 3).to(torch.bfloat16)
    q = fused[:, : hq * d].view(t, hq, d)
    k = fused[:, hq * d : (hq + hk) * d].view(t, hk, d)
    cos, sin = tables(torch.randint(0, 4000, (t,), generator=gen), d)
    got = kernel(q, k, cos, sin)
    assert got is not None
    assert torch.equal(got[0], apply_rotary(q, cos, sin)) and torch.equal(got[1], apply_rotary(k, cos, sin))
    assert got[0].is_contiguous() and got[1].is_contiguous()


def test_declines_what_it_cannot_read(gen) -> None:
    q = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    cos, sin = tables(torch.arange(3), 64)
    assert kernel(q.float(), q.float(), cos.float(), sin.float()) is None  # fp32: the reference runs
    assert kernel(q[None], q[None], cos, sin) is None  # a batch dimension
    assert kernel(q, q, cos[:, :32], sin[:, :32]) is None  # tables of another width
