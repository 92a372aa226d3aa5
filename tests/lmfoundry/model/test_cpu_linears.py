"""Packed weight-only linears on CPU (int4pack / int8pack) against the float64 reference linear.

Bound, per output element: the kernels take the input in bf16 (one rounding of each x_k, relative
u = 2^-8), hold the zero point as zero = -zp * s rounded to bf16 (error u |zp s| per weight), and
round the output to bf16 (u |y|); fp32 accumulation adds K * 2^-24, negligible here. So

    |y - y_ref| <= 3 u (sum_k |x_k| (|w_nk| + |zp_n s_n|) + |b_n|)

with w the checkpoint's dequantized weight (what transformers decompresses). Every case runs both
paths: the per-row kernel (few rows) and dequantize-then-GEMM (DEQUANT_ROWS rows and more).
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.model.cpu_linears import (
    DEQUANT_ROWS,
    Int4PackLinear,
    Int8PackLinear,
    PrepackedLinear,
    can_prepack,
    packed_linear,
    prepack_dense_linears,
)
from lmfoundry.model.linears import build_linear
from lmfoundry.quantizers import qmath
from lmfoundry.quantizers.base import QuantizedWeight
from lmfoundry.quantizers.scheme import QuantArgs, make_scheme

U = 2.0**-8


def quantized(n: int, k: int, args: QuantArgs, act_order: bool = False, seed: int = 0) -> QuantizedWeight:
    """Random weights quantized by the reference arithmetic; act_order: GPTQ-style g_idx (group =
    rank in a random activation order // group size)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    g_idx = None
    if act_order:
        order = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // args.group_size
        w_sorted = w[:, order]
    else:
        w_sorted = w
    x = qmath.reduce_shape(w_sorted, args)
    scale, zp = qmath.qparams_from_range(x.amin(-1), x.amax(-1), args, torch.bfloat16)
    q = qmath.quantize(w_sorted, scale, zp, args)
    if act_order:
        q = q[:, torch.argsort(order)]
    return QuantizedWeight(q, scale, zp, args, g_idx=g_idx)


def reference_weight(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, |zp * s| per weight) in float64."""
    w = qw.dequantize(torch.float64)
    if qw.zero_point is None:
        return w, torch.zeros_like(w)
    # codes 0 with zero point -zp dequantize to (0 + zp) * s: the zero term of every weight
    zs = QuantizedWeight(torch.zeros_like(qw.q), qw.scale, -qw.zero_point, qw.args, qw.g_idx).dequantize(torch.float64)
    return w, zs.abs()


CASES = [
    (QuantArgs(4, "int", True, "group", 64), False),
    (QuantArgs(4, "int", False, "group", 32), False),
    (QuantArgs(4, "int", True, "group", 128), True),  # act-order
    (QuantArgs(4, "int", True, "channel", None), False),
    (QuantArgs(4, "int", True, "group", 512), False),  # stored groups of 512 served by kernel groups of 256
    (QuantArgs(3, "int", False, "group", 64), False),
    (QuantArgs(8, "int", True, "channel", None), False),
    (QuantArgs(8, "int", False, "channel", None), False),
]


@pytest.mark.parametrize("args,act_order", CASES, ids=[f"{a.describe()}{' act' if o else ''}" for a, o in CASES])
@pytest.mark.parametrize("rows", [1, 7, DEQUANT_ROWS + 5])
def test_packed_linear_within_the_bf16_bound(args: QuantArgs, act_order: bool, rows: int) -> None:
    n, k = 192, 512
    qw = quantized(n, k, args, act_order)
    bias = torch.randn(n)
    module = packed_linear(qw, bias)
    assert isinstance(module, Int8PackLinear if args.num_bits > 4 else Int4PackLinear), module
    w, zs = reference_weight(qw)
    x = torch.randn(3, rows, k)  # a leading batch dim: the module keeps it
    y = module(x.bfloat16())
    assert y.shape == (3, rows, n) and y.dtype == torch.bfloat16
    assert torch.isfinite(y).all()
    x64 = x.double().reshape(-1, k)
    ref = x64 @ w.t() + bias.double()
    bound = 3 * U * (x64.abs() @ (w.abs() + zs).t() + bias.double().abs())
    err = (y.double().reshape(-1, n) - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max():.2f} of the bound"
    assert (err > 0).any()  # the bf16 path really ran (not a float64 copy)


def test_dequantized_weight_is_the_checkpoint_weight() -> None:
    for args, act_order in CASES:
        qw = quantized(64, 512, args, act_order)
        module = packed_linear(qw, None)
        exact = qw.dequantize(torch.float64)
        got = module.dequantized_weight().double()
        # (u - 8) * s + zero in bf16: the zero term rounds at load, the multiply-add once more
        _, zs = reference_weight(qw)
        assert ((got - exact).abs() <= 2 * U * (exact.abs() + zs)).all(), args.describe()
        if qw.zero_point is None:
            assert torch.equal(got, exact), args.describe()  # codes times bf16 scales: exact in bf16


def test_int4_resident_bytes_are_under_a_third_of_bf16() -> None:
    n, k = 1536, 576
    module = packed_linear(quantized(n, k, QuantArgs(4, "int", True, "group", 64)), None)
    resident = sum(b.numel() * b.element_size() for b in module.buffers())
    assert resident <= 0.35 * n * k * 2


@pytest.mark.parametrize("args,n,why", [
    (QuantArgs(4, "int", True, "group", 16), 64, "no int4pack group size"),
    (QuantArgs(4, "int", True, "group", 64), 40, "multiple of 16"),
    (QuantArgs(8, "int", True, "group", 64), 64, "one scale per output channel"),
])
def test_codes_no_kernel_takes_are_named_and_served_dense(args: QuantArgs, n: int, why: str) -> None:
    qw = quantized(n, 256, args)
    reason = packed_linear(qw, None)
    assert isinstance(reason, str) and why in reason
    fallbacks: list[str] = []
    scheme = make_scheme("w4a16" if args.num_bits == 4 else "w8a16")
    module = build_linear(qw, None, scheme, torch.bfloat16, fallbacks)
    assert isinstance(module, torch.nn.Linear) and fallbacks == [reason]
    assert torch.equal(module.weight, qw.dequantize(torch.bfloat16))


def test_float32_models_keep_the_exact_dense_weight() -> None:
    qw = quantized(64, 256, QuantArgs(4, "int", True, "group", 64))
    module = build_linear(qw, None, make_scheme("w4a16"), torch.float32)
    assert isinstance(module, torch.nn.Linear)
    assert torch.equal(module.weight, qw.dequantize(torch.float32))


def test_act_order_groups_must_be_equal() -> None:
    qw = quantized(64, 256, QuantArgs(4, "int", True, "group", 64), act_order=True)
    qw.g_idx = torch.zeros(256, dtype=torch.long)  # every column in group 0
    reason = packed_linear(qw, None)
    assert isinstance(reason, str) and "g_idx" in reason


needs_bf16_onednn = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="oneDNN has no bf16 kernels here")


@needs_bf16_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_f_linear_exactly(rows: int, bias: bool) -> None:
    """oneDNN's product over the prepacked weight is F.linear's own kernel: equal bit for bit, at
    every row count, 2-D and 3-D inputs alike."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    packed = PrepackedLinear(lin)
    assert torch.equal(packed.weight, lin.weight)
    assert torch.equal(packed(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    x3 = x.reshape(1, rows, 96)
    assert torch.equal(packed(x3), torch.nn.functional.linear(x3, lin.weight, lin.bias))


@needs_bf16_onednn
def test_prepack_swaps_the_dense_bf16_linears_and_keeps_the_model_output() -> None:
    from lmfoundry.runtime.engine.toy import toy_model

    model = toy_model(seed=3, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
        n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
        assert prepack_dense_linears(model) == n_linear > 0
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert torch.equal(model(ids), want)
    assert prepack_dense_linears(toy_model(seed=3)) == 0  # float32 models stay as they are
