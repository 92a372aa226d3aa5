"""W4A16/W8A16 GEMM and GEMV from the compressed-tensors packed layout against the reference."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from lmfoundry.kernels import w4a16
from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned


def make_linear(n, k, bits, group, symmetric, actorder, dtype, gen, bias=False) -> w4a16.PackedLinear:
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (n, k), generator=gen, dtype=torch.int8)
    groups = 1 if group == 0 else k // group
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).to(dtype)
    zp = None
    if not symmetric:
        zp = pack_to_int32(torch.randint(lo, hi, (n, groups), generator=gen, dtype=torch.int8), bits, packed_dim=0)
    g_idx = None
    if actorder:
        g_idx = ((torch.arange(k) // (group or k))[torch.randperm(k, generator=gen)]).to(torch.int32)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return w4a16.PackedLinear(pack_to_int32(q, bits), scale, bits, group, k, zp, g_idx, b)


def to(w: w4a16.PackedLinear, device: str) -> w4a16.PackedLinear:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return w4a16.PackedLinear(move(w.weight_packed), move(w.weight_scale), w.bits, w.group_size, w.in_features,
                              move(w.weight_zero_point), move(w.weight_g_idx), move(w.bias))


CASES = [
    # M, N, K, bits, group, symmetric, actorder, dtype, bias
    (1, 96, 128, 4, 32, True, False, torch.float16, False),  # GEMV, M=1
    (3, 80, 192, 4, 64, False, False, torch.bfloat16, True),  # GEMV, asymmetric, bias
    (37, 96, 192, 4, 64, True, False, torch.bfloat16, False),  # GEMM, M not a block multiple
    (70, 100, 160, 4, 32, False, True, torch.float16, False),  # N, K not block multiples, g_idx, asym
    (130, 64, 256, 4, 128, True, True, torch.bfloat16, True),  # g128 with g_idx
    (20, 72, 100, 4, 0, True, False, torch.float16, False),  # per channel, odd K
    (17, 64, 128, 8, 64, False, False, torch.bfloat16, False),  # W8A16 asymmetric
    (2, 48, 96, 8, 0, True, True, torch.float16, True),  # W8A16 per channel GEMV with g_idx
]


@pytest.mark.parametrize("m,n,k,bits,group,symmetric,actorder,dtype,bias", CASES)
def test_linear_matches_reference(m, n, k, bits, group, symmetric, actorder, dtype, bias, gen, device, acc_u):
    w = make_linear(n, k, bits, group, symmetric, actorder, dtype, gen, bias)
    x = torch.randn(m, k, generator=gen).to(dtype)
    wd, xd = to(w, device), x.to(device)
    out = poisoned((m, n), dtype, device)
    w4a16.w4a16_linear(xd, wd, out=out)
    assert_written(out, "w4a16")
    ref = w4a16.reference(x, w.weight_packed, w.weight_scale, w.weight_zero_point, w.weight_g_idx, w.bias, bits, group)
    deq = w.dequantize().to(dtype).double()
    abs_products = x.double().abs() @ deq.abs().t()
    if bias:
        abs_products = abs_products + w.bias.double().abs()
    assert_within(out.cpu(), ref, dot_bound(ref, abs_products, k, dtype, acc_u), f"w4a16 {m}x{n}x{k}")


def test_leading_dims_and_strided_input(gen, device, acc_u):
    """x [..., K] with a row stride larger than K (a slice) is handled without a copy."""
    w = make_linear(64, 128, 4, 64, True, False, torch.float16, gen)
    big = torch.randn(2, 9, 256, generator=gen).to(torch.float16)
    x = big[..., :128]
    out = w4a16.w4a16_linear(x.to(device), to(w, device))
    assert out.shape == (2, 9, 64)
    ref = w4a16.reference(x.reshape(-1, 128), w.weight_packed, w.weight_scale, None, None, None, 4, 64)
    abs_products = x.reshape(-1, 128).double().abs() @ w.dequantize().double().abs().t()
    assert_within(out.reshape(-1, 64).cpu(), ref, dot_bound(ref, abs_products, 128, torch.float16, acc_u), "strided")


def test_gemv_and_gemm_are_both_exercised():
    assert w4a16.GEMV_MAX_M >= 1
    x = torch.zeros(w4a16.GEMV_MAX_M + 1, 64)
    w = w4a16.PackedLinear(torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 1), 4, 0, 64)
    assert w4a16.make_call(x[:1], w, torch.empty(1, 8)).kernel is w4a16.GEMV
    assert w4a16.make_call(x, w, torch.empty(len(x), 8)).kernel is w4a16.GEMM


def test_unsupported_group_size_is_refused():
    w = w4a16.PackedLinear(torch.zeros(8, 12, dtype=torch.int32), torch.ones(8, 4), 4, 24, 96)
    with pytest.raises(ValueError, match="group size 24"):
        w4a16.make_call(torch.zeros(2, 96), w, torch.empty(2, 8))
