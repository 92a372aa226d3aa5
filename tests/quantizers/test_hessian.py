"""The input statistics GPTQ and AWQ share (quantizers/hessian.py): the Hessian against float64,
its inverse factor against the three-step reference, the token energy cap, and received attention
against an explicit softmax."""

from __future__ import annotations

import pytest
import torch
from helpers import correlated_inputs, tiny_decoder_layer

from lmfoundry.quantizers.hessian import HessianAccumulator, inverse_hessian


@pytest.mark.parametrize("cols", [100, 301])
def test_hessian_accumulator_equals_float64(cols):
    """The one-triangle (ssyrk) accumulation gives the full symmetric 2·XᵀX/N, within float32
    rounding of each sum (|error| <= ~N·u·Σ|x_i x_j| bounds it; 1e-5 relative is ample)."""
    x = torch.randn(1000, cols, generator=torch.Generator().manual_seed(2)) + 0.3
    acc = HessianAccumulator()
    for chunk in x.split(300):
        acc.add(chunk)
    h = acc.hessian()
    ref = 2 * x.double().t() @ x.double() / x.shape[0]
    assert torch.equal(h, h.t())
    assert float((h.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("n", [1, 7, 96])
def test_upper_cholesky_of_inverse_matches_the_three_step_reference(n):
    """U from one Cholesky of the flipped H and a triangular inverse equals the factor of the
    textbook route (cholesky -> cholesky_inverse -> upper cholesky): upper triangular, Uᵀ·U = H⁻¹.
    Both are backward stable; with cond(H) ~ 1e3 here float32 gives ~1e-4 relative at most."""
    from lmfoundry.quantizers.hessian import upper_cholesky_of_inverse

    a = torch.randn(2 * n + 3, n, generator=torch.Generator().manual_seed(n)) + 0.2
    h = (a.t() @ a / a.shape[0]).double()
    h.diagonal().add_(0.01 * float(h.diagonal().mean()))
    u = upper_cholesky_of_inverse(h.float().flip(0, 1))
    assert u is not None and u.dtype == torch.float32 and u.is_contiguous()
    assert torch.equal(u, torch.triu(u)) and bool((u.diagonal() > 0).all())
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    assert float((u.double() - ref).abs().max() / ref.abs().max()) < 1e-4
    torch.testing.assert_close(u.double().t() @ u.double(), torch.linalg.inv(h), rtol=1e-3, atol=1e-3 * float(ref.abs().max()) ** 2)


@pytest.mark.parametrize("n", [5, 1030])
def test_mirror_upper_fills_the_lower_triangle_in_place(n):
    """Block-wise mirroring (1024 columns a block) copies the upper triangle onto the lower one in
    the tensor's own memory, whatever the lower triangle held, across block boundaries."""
    from lmfoundry.quantizers.hessian import mirror_upper_

    a = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
    ref = torch.triu(a) + torch.triu(a, 1).t()
    f = a.t().contiguous().t()  # Fortran-ordered, as the accumulator's float64 sum arrives
    out = mirror_upper_(f)
    assert out.data_ptr() == f.data_ptr() and torch.equal(out, ref)


def test_hessian_is_read_once_and_kept_and_inverse_leaves_it_unchanged():
    """The float64 sums are freed at the first read (later reads return the same float32
    matrix; adding after it is refused), and the inverse factor is made from a reordered copy
    factored in place: the caller's H is untouched, the in-place factor equals the copying one."""
    from lmfoundry.quantizers.hessian import upper_cholesky_of_inverse

    x = correlated_inputs(600, 48)
    acc = HessianAccumulator()
    acc.add(x)
    h = acc.hessian()
    assert acc.sum is None and acc.hessian() is h and h.is_contiguous()
    with pytest.raises(RuntimeError, match="after the Hessian was read"):
        acc.add(x)
    before = h.clone()
    for actorder in (None, "static"):
        hinv, warnings = inverse_hessian(h, actorder)
        assert hinv is not None and not warnings and torch.equal(h, before)
    flipped = (h + 0.01 * h.diagonal().mean() * torch.eye(48)).flip(0, 1).contiguous()
    copied = upper_cholesky_of_inverse(flipped)
    assert copied is not None
    assert torch.equal(upper_cholesky_of_inverse(flipped.clone(), overwrite=True), copied)


def test_upper_cholesky_of_inverse_refuses_an_indefinite_matrix():
    from lmfoundry.quantizers.hessian import upper_cholesky_of_inverse

    assert upper_cholesky_of_inverse(torch.diag(torch.tensor([1.0, -1.0, 2.0]))) is None


def test_token_energy_cap_limits_massive_tokens_only():
    from lmfoundry.quantizers.hessian import cap_token_energy

    x = torch.randn(1000, 32, generator=torch.Generator().manual_seed(0))
    x[7] *= 300.0  # an attention-sink-like token
    capped = cap_token_energy(x, 10.0)
    energy = x.square().sum(-1)
    limit = 10.0 * energy.median()
    assert capped[7].square().sum() == pytest.approx(float(limit), rel=1e-4)
    keep = energy <= limit
    assert torch.equal(capped[keep], x[keep])
    assert torch.equal(cap_token_energy(x, 0.0), x)
    # its direction is kept
    torch.testing.assert_close(capped[7] / capped[7].norm(), x[7] / x[7].norm())


@pytest.mark.parametrize("chunk", [64, 3, 1])
def test_received_attention_matches_explicit_softmax(chunk):
    """Per token: Σ over queries of softmax(qkᵀ/√d) with the causal mask, mean over heads; the
    first token receives every query's first-position weight, and the mean is exactly 1. Query
    chunks (one, several with a ragged last one, one query each) give the same sums."""
    from lmfoundry.quantizers.hessian import received_attention

    layer, cos, sin, config = tiny_decoder_layer()
    x = torch.randn(2, 10, config.hidden_size)
    got = received_attention(layer.self_attn, x, cos, sin, chunk=chunk, low_precision=False)
    q, k, _ = layer.self_attn.project_qkv(x, cos, sin)
    q, k = q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], 2)
    ref = []
    for b in range(2):
        for_heads = []
        for h in range(q.shape[2]):
            logits = q[b, :, h] @ k[b, :, h].t() / q.shape[-1] ** 0.5
            logits += torch.triu(torch.full((10, 10), float("-inf"), dtype=torch.float64), 1)
            for_heads.append(torch.softmax(logits, -1).sum(0))
        ref.append(torch.stack(for_heads).mean(0))
    ref = torch.cat(ref)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert abs(float(got.mean()) - 1.0) < 1e-5
    assert got.view(2, 10)[:, 0].min() >= 1.0  # the first token is attended by every query


@pytest.mark.parametrize("chunk", [64, 3])
def test_received_attention_honours_a_gemma_attention_spec(chunk):
    """With a layer's AttentionSpec (Gemma), the weights are the softmax the layer computes: its
    own scale, tanh soft-cap of the scores, and keys within the sliding window only; checked
    against an explicit float64 softmax per head."""
    from lmfoundry.model.attention_math import AttentionSpec
    from lmfoundry.quantizers.hessian import received_attention

    layer, cos, sin, config = tiny_decoder_layer()
    spec = AttentionSpec(scale=0.3, softcap=2.0, window=4)
    layer.self_attn.spec = spec
    x = torch.randn(2, 10, config.hidden_size)
    got = received_attention(layer.self_attn, x, cos, sin, chunk=chunk, low_precision=False)
    q, k, _ = layer.self_attn.project_qkv(x, cos, sin)
    q, k = q.double(), k.double().repeat_interleave(q.shape[2] // k.shape[2], 2)
    pos = torch.arange(10)
    blocked = ~spec.allowed(pos, pos)
    ref = []
    for b in range(2):
        per_head = []
        for h in range(q.shape[2]):
            scores = q[b, :, h] @ k[b, :, h].t() * spec.scale
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
            per_head.append(torch.softmax(scores.masked_fill(blocked, float("-inf")), -1).sum(0))
        ref.append(torch.stack(per_head).mean(0))
    torch.testing.assert_close(got.double(), torch.cat(ref), rtol=1e-5, atol=1e-6)
    assert got.view(2, 10)[:, 0].max() < 4.0  # outside the window of later queries, unlike plain causal


def test_received_attention_in_bf16_is_close_to_float32():
    """The bf16 scores move each token's weight by a few bf16 roundings of the logits (relative
    2⁻⁸ of |qk|/√d ≲ 4 here, so ≲ 2-3 % of a probability); the total stays exactly T per sequence."""
    from lmfoundry.quantizers.hessian import received_attention

    layer, cos, sin, config = tiny_decoder_layer(seed=3, tokens=40)
    x = torch.randn(2, 40, config.hidden_size)
    ref = received_attention(layer.self_attn, x, cos, sin, chunk=16, low_precision=False)
    got = received_attention(layer.self_attn, x, cos, sin, chunk=16, low_precision=True)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0.05, atol=1e-3)
    torch.testing.assert_close(got.view(2, 40).sum(1), torch.full((2,), 40.0), rtol=1e-5, atol=1e-4)
