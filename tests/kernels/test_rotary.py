"""Rotary embedding on q/k views of a fused qkv output, in place and out of place."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import rotary
from lmfoundry.kernels.error_bounds import U32, assert_within, assert_written, poisoned, unit_roundoff


def tables(d: int, positions: int):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    return rotary.rope_tables(inv, positions, attention_scaling=1.0)


def bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, ref: torch.Tensor, dtype) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = cos[pos.long()][:, None, :].double().abs(), sin[pos.long()][:, None, :].double().abs()
    x1, x2 = x.double().abs()[..., :half], x.double().abs()[..., half:]
    mag = torch.cat((x1 * c + x2 * s, x2 * c + x1 * s), dim=-1)
    return 2 * unit_roundoff(dtype) * ref.double().abs() + 4 * U32 * mag + 2 * torch.finfo(dtype).tiny


@pytest.mark.parametrize("t,hq,hkv,d,dtype", [(1, 9, 3, 64, torch.bfloat16), (13, 4, 4, 128, torch.float16),
                                              (5, 6, 2, 80, torch.bfloat16)])
def test_rotary_on_fused_qkv_views(t, hq, hkv, d, dtype, gen, device):
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cos, sin = tables(d, 4096)
    pos = torch.randint(0, 4096, (t,), generator=gen)
    q_out, k_out = poisoned((t, hq, d), dtype, device), poisoned((t, hkv, d), dtype, device)
    qkv_d = qkv.to(device)
    rotary.apply_rotary(qkv_d[:, : hq * d].view(t, hq, d), qkv_d[:, hq * d : (hq + hkv) * d].view(t, hkv, d),
                        pos.to(device), cos.to(device), sin.to(device), q_out, k_out)
    assert_written(q_out, "q")
    assert_written(k_out, "k")
    for x, out in ((q, q_out), (k, k_out)):
        ref = rotary.reference(x, pos, cos, sin)
        assert_within(out.cpu(), ref, bound(x, cos, sin, pos, ref, dtype), "rotary")


def test_in_place(gen, device):
    t, h, d = 6, 2, 64
    q = torch.randn(t, h, d, generator=gen).to(torch.float16)
    k = torch.randn(t, h, d, generator=gen).to(torch.float16)
    cos, sin = tables(d, 64)
    pos = torch.arange(t)
    qd, kd = q.clone().to(device), k.clone().to(device)
    rotary.apply_rotary(qd, kd, pos.to(device), cos.to(device), sin.to(device), q_out=qd, k_out=kd)
    ref = rotary.reference(q, pos, cos, sin)
    assert_within(qd.cpu(), ref, bound(q, cos, sin, pos, ref, torch.float16), "in place q")
    assert not torch.equal(qd.cpu(), q), "q was rotated in place"


def test_matches_the_model_convention(gen):
    """Same rotation as lmfoundry.model.attention_math.apply_rotary (rotate-half with cat(freqs, freqs))."""
    from lmfoundry.model.attention_math import apply_rotary as model_rotary

    t, h, d = 4, 3, 64
    x = torch.randn(t, h, d, generator=gen)
    cos, sin = tables(d, 16)
    pos = torch.tensor([0, 3, 7, 15])
    full_cos = torch.cat((cos, cos), dim=-1)[pos]
    full_sin = torch.cat((sin, sin), dim=-1)[pos]
    expected = model_rotary(x, full_cos, full_sin)
    assert torch.allclose(rotary.reference(x, pos, cos, sin), expected, rtol=0, atol=1e-6)
