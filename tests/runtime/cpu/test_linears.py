"""Packed weight-only linears on CPU (int4pack / int8pack) against the float64 reference linear.

Bound, per output element: the kernels take the input in bf16 (one rounding of each x_k, relative
u = 2^-8), hold the zero point as zero = -zp * s rounded to bf16 (error u |zp s| per weight), and
round the output to bf16 (u |y|); fp32 accumulation adds K * 2^-24, negligible here. So

    |y - y_ref| <= 3 u (sum_k |x_k| (|w_nk| + |zp_n s_n|) + |b_n|)

with w the checkpoint's dequantized weight (what transformers decompresses). Every case runs both
paths: the per-row kernel (few rows) and dequantize-then-GEMM (DEQUANT_ROWS rows and more).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lmfoundry.model.reference import MLP, Attention
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs, make_scheme
from lmfoundry.runtime.checkpoint_model import build_linear
from lmfoundry.runtime.cpu.dense_linears import (
    BlockedEmbedding,
    FusedPrepackedLinear,
    PrepackedLinear,
    PrepackedPart,
    can_prepack,
    prepack_dense_linears,
)
from lmfoundry.runtime.cpu.features import onednn_bf16
from lmfoundry.runtime.cpu.native.bf16_fma_gemm import load_f32_fma_gemm
from lmfoundry.runtime.cpu.native.bf16_gemv import MAX_ROWS, load_bf16_gemv
from lmfoundry.runtime.cpu.native.int4_gemm import load_int4_gemm
from lmfoundry.runtime.cpu.native.int8_gemm import load_int8_gemm
from lmfoundry.runtime.cpu.panel_linears import FloatPanelLinear, panel_float_linears
from lmfoundry.runtime.cpu.weight_only_linears import (
    DEQUANT_ROWS,
    CProductLinear,
    Int4PackLinear,
    Int8PackLinear,
    packed_linear,
    prepack_c_products,
)

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


def _capabilities() -> list[str]:
    """ATen CPU capabilities this machine can run (each packs int4 codes its own way)."""
    caps = ["default"]
    if torch.cpu._is_avx2_supported():
        caps.append("avx2")
    if torch.cpu._is_avx512_supported():
        caps.append("avx512")
    return caps


@pytest.mark.parametrize("capability", _capabilities())
def test_int4_layout_of_each_cpu_capability(capability: str) -> None:
    """The dequantized weight and the dequantize-then-GEMM path read the int4pack blocks the way
    PyTorch wrote them under every capability (AVX-512, AVX2 and the portable kernel pack
    differently), so a W4A16 model is right on whichever CPU serves it."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    env.pop("LMFOUNDRY_CPU_ISA", None)  # it would set ATEN_CPU_CAPABILITY itself
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "dequantized_weight_is or (within_the_bf16_bound and int4)"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


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


# prepacking needs oneDNN with bf16 kernels or the FMA product (AVX2 CPUs); some tests are about oneDNN's
needs_prepack = pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="no bf16 prepacking on this CPU")
needs_bf16_onednn = pytest.mark.skipif(not onednn_bf16(), reason="oneDNN has no bf16 kernels here")
needs_fma_panels = pytest.mark.skipif(onednn_bf16() or not can_prepack(torch.bfloat16),
                                      reason="the FMA panels serve CPUs without bf16 oneDNN kernels")


def within_gemm_bound(got: torch.Tensor, x: torch.Tensor, lin: torch.nn.Linear) -> bool:
    """Whether `got` is F.linear(x) up to fp32 accumulation in another order and one bf16 rounding
    on each side: 2 (u + (K + 2) 2^-24) (sum_k |x_k w_nk| + |b_n|) per element."""
    want = torch.nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    bound = torch.abs(x.double()) @ torch.abs(lin.weight.double()).t() \
        + (0 if lin.bias is None else lin.bias.double().abs())
    k = lin.in_features
    return got.shape == want.shape and bool(((got.double() - want).abs() <= 2 * (U + (k + 2) * 2.0**-24) * bound).all())


@needs_fma_panels
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_on_fma_panels_serves_every_row_count(rows: int, bias: bool) -> None:
    """Without bf16 oneDNN kernels the weight is kept once, as FMA panels (200 outputs: a padded
    last panel), and every row count, 2-D or 3-D, is F.linear within the GEMM bound."""
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g) + 0.1)
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    packed = PrepackedLinear(lin)
    assert packed.packed is None and packed.blocked is not None and "FMA panels" in repr(packed)
    assert torch.equal(packed.weight, lin.weight)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    assert within_gemm_bound(packed(x), x, lin)
    x3 = x.reshape(1, rows, 96)
    assert within_gemm_bound(packed(x3), x3, lin)


@needs_bf16_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_equals_f_linear_exactly(rows: int, bias: bool, monkeypatch) -> None:
    """oneDNN's product over the prepacked weight is F.linear's own kernel: equal bit for bit, at
    every row count, 2-D and 3-D inputs alike (the few-row C product turned off)."""
    monkeypatch.setenv("LMFOUNDRY_NATIVE_KERNELS", "0")
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
@pytest.mark.skipif(load_bf16_gemv() is None, reason="no AVX-512 BF16 C product here")
@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_takes_the_c_product_for_decode_rows(rows: int, bias: bool) -> None:
    """Up to MAX_ROWS rows the C product runs (within the fp32-accumulation bound of F.linear: K
    products summed in another order, each side rounding once to bf16); above, oneDNN exactly."""
    g = torch.Generator().manual_seed(rows)
    k, n = 96, 192
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) + 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    packed = PrepackedLinear(lin)
    assert packed.gemv is not None
    x = torch.randn(1, rows, k, generator=g).to(torch.bfloat16)
    got, want = packed(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape == (1, rows, n)
    if rows > MAX_ROWS:
        assert torch.equal(got, want)
        return
    assert within_gemm_bound(got, x, lin)


@needs_prepack
def test_prepack_swaps_the_dense_bf16_linears_and_keeps_the_model_output() -> None:
    """oneDNN prepacking computes F.linear's own product (equal logits); FMA panels compute it in
    another summation order (logits within a few bf16 steps of their scale)."""
    from toy import toy_model

    model = toy_model(seed=3, dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
        n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
        assert prepack_dense_linears(model) == n_linear > 0
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        got = model(ids)
        if onednn_bf16():
            assert torch.equal(got, want)
        else:
            assert float((got.float() - want.float()).abs().max()) <= 4 * U * float(want.float().abs().max())
    assert prepack_dense_linears(toy_model(seed=3)) == 0  # float32 models stay as they are


# Fused q/k/v and gate/up (FusedPrepackedLinear). Each fused output element is the dot product of
# the separate linear, but the fused GEMM has another shape, for which oneDNN may block (and so sum)
# K differently: equality is not promised. Each side accumulates K bf16 products in fp32 (error at
# most K 2^-24 of sum_k |x_k w_nk|) and rounds once to bf16 (u |y|), so the two differ by at most
#     2 (u + K 2^-24) (sum_k |x_k| |w_nk| + |b_n|)
# per element, and by at most a few bf16 steps of the output's scale after the layer's elementwise
# work (rotary, norms, activation); a wrong split (q and k swapped, gate and up swapped, a bias
# block misplaced) is off by the output's whole scale.
FUSE_SIZES = [(128, 32, 32), (200, 200)]  # q/k/v (GQA) and gate/up


def fused_linears(sizes: tuple[int, ...], k: int, bias: bool, seed: int) -> list[torch.nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    linears = []
    for n in sizes:
        lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) + 0.1)  # random, non-zero
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g) + 0.1)
        linears.append(lin)
    return linears


@needs_prepack
@pytest.mark.parametrize("sizes", FUSE_SIZES)
@pytest.mark.parametrize("rows", [1, 4, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_prepacked_linear_matches_each_f_linear(sizes: tuple[int, ...], rows: int, bias: bool) -> None:
    k = 96
    linears = fused_linears(sizes, k, bias, seed=rows)
    fused = FusedPrepackedLinear(linears)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = fused.parts(x)
    assert len(outs) == len(sizes)
    base = fused(x).untyped_storage().nbytes()
    for out, lin in zip(outs, linears, strict=True):
        ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert out.shape == ref.shape and bool(out.isfinite().all())  # every element written
        bound = torch.abs(x.double()) @ torch.abs(lin.weight.double()).t()
        if bias:
            bound += torch.abs(lin.bias.double())
        assert bool(((out.double() - ref.double()).abs() <= 2 * (U + k * 2.0**-24) * bound).all())
        assert out.untyped_storage().nbytes() == base  # a view of the one product, not a copy
    parts = fused.parts(x.reshape(1, rows, k))  # 3-D input, as the model passes
    assert [p.shape for p in parts] == [(1, rows, n) for n in sizes]


def fusable_model(model_type: str = "llama", **overrides: object) -> torch.nn.Module:
    from toy import toy_model

    return toy_model(seed=3, dtype=torch.bfloat16, model_type=model_type, **overrides)


@needs_prepack
@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("qwen3", {"head_dim": 16}),  # q/k norms
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}),  # GELU into a new tensor instead of SiLU in place
    ("qwen3_moe", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
])
def test_fused_layers_compute_what_the_unfused_prepacked_layers_do(model_type: str, overrides: dict) -> None:
    fused, unfused = fusable_model(model_type, **overrides), fusable_model(model_type, **overrides)
    plain = {name: (m.weight.clone(), None if m.bias is None else m.bias.clone())
             for name, m in fused.named_modules() if type(m) is torch.nn.Linear}
    n_linear = len(plain)
    assert prepack_dense_linears(unfused) == n_linear
    assert prepack_dense_linears(fused, fuse=True) == n_linear
    assert not any(type(m) is torch.nn.Linear for m in fused.modules())
    attns = [layer.self_attn for layer in fused.model.layers]
    mlps = [m for m in fused.modules() if isinstance(m, MLP)]
    assert all(type(a.qkv_proj) is FusedPrepackedLinear for a in attns)
    assert mlps and all(type(m.gate_up_proj) is FusedPrepackedLinear for m in mlps)
    for name, (weight, bias) in plain.items():  # the fused linears still read as themselves
        part = fused.get_submodule(name)
        assert torch.equal(part.weight, weight) and (bias is None) == (part.bias is None)
        assert bias is None or torch.equal(part.bias, bias)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, fused.config.hidden_size, generator=g).to(torch.bfloat16)
    cos, sin = fused.model.rotary_emb(torch.arange(7).expand(2, 7), torch.bfloat16)

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape and bool(got.isfinite().all())
        assert float((got.float() - want.float()).abs().max()) <= 4 * U * float(want.float().abs().max())

    with torch.no_grad():
        for a, b in zip(attns, (layer.self_attn for layer in unfused.model.layers), strict=True):
            for got, want in zip(a.project_qkv(x, cos, sin), b.project_qkv(x, cos, sin), strict=True):
                close(got, want)
            for got, want in zip(a.project_qk(x, cos, sin), b.project_qk(x, cos, sin), strict=True):  # the parts alone
                close(got, want)
        for a, b in zip(mlps, (m for m in unfused.modules() if isinstance(m, MLP)), strict=True):
            close(a.hidden(x), b.hidden(x))
            close(a(x), b(x))
        ids = torch.randint(0, 256, (2, 9), generator=g)
        close(fused(ids), unfused(ids))


class Adapted(torch.nn.Linear):
    """Stands for any linear that is not a plain nn.Linear (LoRA, quantized, ...)."""


@needs_prepack
def test_fusion_only_swaps_groups_of_plain_linears_that_agree() -> None:
    model = fusable_model()
    first, second = (layer.self_attn for layer in model.model.layers)
    first.q_proj = Adapted(64, 64, bias=False).to(torch.bfloat16)
    second.k_proj = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16)  # q and v have none
    prepack_dense_linears(model, fuse=True)
    assert first.qkv_proj is None and type(first.q_proj) is Adapted and type(first.k_proj) is PrepackedLinear
    assert second.qkv_proj is None and type(second.k_proj) is PrepackedLinear
    assert all(type(layer.mlp.gate_up_proj) is FusedPrepackedLinear for layer in model.model.layers)

    unfused = fusable_model()
    prepack_dense_linears(unfused)  # fuse=False: every linear packed alone
    assert all(m.qkv_proj is None for m in unfused.modules() if isinstance(m, Attention))
    assert not any(isinstance(m, (FusedPrepackedLinear, PrepackedPart)) for m in unfused.modules())
    float_model = fusable_model().float()
    assert prepack_dense_linears(float_model, fuse=True) == 0
    assert all(m.qkv_proj is None for m in float_model.modules() if isinstance(m, Attention))


@needs_prepack
def test_engine_decodes_the_same_tokens_with_fused_linears() -> None:
    """The engine fuses when it prepacks; a model prepacked beforehand without fusion (nothing left
    for the engine to swap) is the unfused engine. Greedy tokens are the same."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    prompts = [[5, 17, 99, 3, 250, 42, 7], [200, 1, 64], list(range(30, 52))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens = []
    for fuse in (False, True):
        model = fusable_model()
        if not fuse:
            prepack_dense_linears(model)
        engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
        fused = [m.qkv_proj is not None for m in model.modules() if isinstance(m, Attention)]
        assert fused and all(f == fuse for f in fused)
        tokens.append([o.outputs[0].token_ids for o in engine.generate(prompts, params)])
    assert tokens[0] == tokens[1]
    assert len(set(t for out in tokens[1] for t in out)) > 3  # not a degenerate repeat


@needs_bf16_onednn
@pytest.mark.skipif(load_bf16_gemv() is None, reason="no AVX-512 BF16 C product here")
def test_few_row_copies_only_where_memory_allows(monkeypatch, caplog) -> None:
    """The blocked copies double the dense weights' memory: a model whose copies would take more
    than a quarter of the available memory stays on oneDNN alone, with one log line."""
    import logging

    from lmfoundry.runtime.cpu import dense_linears

    fits = fusable_model()
    prepack_dense_linears(fits, fuse=True)
    assert any(m.gemv is not None for m in fits.modules() if isinstance(m, PrepackedLinear))
    monkeypatch.setattr(dense_linears, "_available_memory", lambda: 1024)
    tight = fusable_model()
    with caplog.at_level(logging.INFO, logger="lmfoundry.runtime"):
        prepack_dense_linears(tight, fuse=True)
    assert all(m.gemv is None and m.blocked is None for m in tight.modules() if isinstance(m, PrepackedLinear))
    assert any("stay on oneDNN" in r.getMessage() for r in caplog.records)


# ---- our C products (runtime/cpu/native/int4_gemm.c, int8_gemm.c) at the serving swap ---------------------
needs_c_products = pytest.mark.skipif(load_int4_gemm() is None or load_int8_gemm() is None,
                                      reason="no AVX-512 BF16 C products here")
C_CASES = [(a, o) for a, o in CASES if a.num_bits <= 4 or a.strategy == "channel"]


@needs_c_products
@pytest.mark.parametrize("args,act_order", C_CASES, ids=[f"{a.describe()}{' act' if o else ''}" for a, o in C_CASES])
@pytest.mark.parametrize("rows", [1, 7, 133])
def test_c_product_linear_within_the_bf16_bound(args: QuantArgs, act_order: bool, rows: int) -> None:
    """The same bound as PyTorch's packed modules: the C products read the codes and scales those
    modules hold, and accumulate in fp32."""
    n, k = 192, 512
    qw = quantized(n, k, args, act_order)
    bias = torch.randn(n)
    packed = packed_linear(qw, bias)
    module = CProductLinear([packed])
    assert module.kind == ("int4" if args.num_bits <= 4 else "int8")
    w, zs = reference_weight(qw)
    x = torch.randn(3, rows, k)
    y = module(x.bfloat16())
    assert y.shape == (3, rows, n) and y.dtype == torch.bfloat16
    x64 = x.double().reshape(-1, k)
    ref = x64 @ w.t() + bias.double()
    bound = 3 * U * (x64.abs() @ (w.abs() + zs).t() + bias.double().abs())
    err = (y.double().reshape(-1, n) - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max():.2f} of the bound"
    assert ((module.dequantized_weight().double() - packed.dequantized_weight().double()).abs()
            <= U * (w.abs() + zs)).all()


@needs_c_products
@pytest.mark.parametrize("args", [QuantArgs(4, "int", False, "group", 64), QuantArgs(8, "int", False, "channel", None)],
                         ids=["int4", "int8"])
def test_fused_c_product_is_each_linear_bit_for_bit(args: QuantArgs) -> None:
    """q/k/v as one product: every output is the same sum as in its own linear's product."""
    linears = [packed_linear(quantized(n, 256, args, seed=n), None) for n in (128, 64, 64)]
    fused = CProductLinear(linears)
    x = torch.randn(9, 256).bfloat16()
    for part, lin in zip(fused.parts(x), linears, strict=True):
        assert torch.equal(part, CProductLinear([lin])(x))


@needs_c_products
@pytest.mark.parametrize("bits", [4, 8])
def test_c_product_swap_fuses_the_groups_and_drops_the_packed_codes(bits: int) -> None:
    from lmfoundry.model.config import ModelConfig

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
                                 "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                                 "num_hidden_layers": 1, "vocab_size": 64, "head_dim": 64})
    args = QuantArgs(4, "int", True, "group", 32) if bits == 4 else QuantArgs(8, "int", True, "channel", None)
    mlp, attn = MLP(cfg).to(torch.bfloat16), Attention(cfg, 0).to(torch.bfloat16)
    for parent in (mlp, attn):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, packed_linear(quantized(child.out_features, child.in_features, args), None))
    x = torch.randn(5, 128).bfloat16()
    before = mlp(x)
    assert prepack_c_products(mlp, fuse=True) == 3 and prepack_c_products(attn, fuse=True) == 4
    assert isinstance(mlp.gate_up_proj, CProductLinear) and isinstance(attn.qkv_proj, CProductLinear)
    assert isinstance(mlp.down_proj, CProductLinear) and isinstance(attn.o_proj, CProductLinear)
    assert not any(isinstance(m, (Int4PackLinear, Int8PackLinear)) for m in (*mlp.modules(), *attn.modules()))
    after = mlp(x)  # the same codes and scales, summed in another order: a few bf16 steps at most
    assert ((after.double() - before.double()).abs() <= 4 * U * before.double().abs().max()).all()


@needs_c_products
def test_int4_widths_int4pack_packs_in_partial_blocks_keep_pytorchs_kernel() -> None:
    """An int4pack block is 64 channels wide on AVX-512 (32 on AVX2); a linear of fewer outputs (a toy
    model's k_proj of 32) is packed another way, which `_int4pack_codes` cannot read back: it keeps
    PyTorch's kernel instead of failing the swap (it failed serve's start-up)."""
    from lmfoundry.runtime.cpu.weight_only_linears import int4_layout

    args = QuantArgs(4, "int", True, "group", 32)
    width = int4_layout()[0]
    narrow = packed_linear(quantized(width // 2, 128, args), None)
    wide = packed_linear(quantized(width, 128, args), None)
    assert not CProductLinear.fits([narrow]) and CProductLinear.fits([wide])
    assert not CProductLinear.fits([wide, narrow])
    parent = torch.nn.Sequential(narrow, wide)
    assert prepack_c_products(parent) == 1
    assert isinstance(parent[0], Int4PackLinear) and isinstance(parent[1], CProductLinear)
def rows_alone(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each row of x through `module` on its own."""
    return torch.cat([module(x[i : i + 1]) for i in range(x.shape[0])])


@needs_prepack
@pytest.mark.parametrize("n,k", [(192, 96), (200, 96), (192, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_batch_invariant_prepacked_linear_gives_a_row_the_same_output_at_any_row_count(n, k, bias) -> None:
    """The deterministic mode's bf16 linear: one C product for every row count (the few-row one
    where the shape fits, else FMA panels), within the GEMM bound, each row equal to itself alone."""
    g = torch.Generator().manual_seed(n + k)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) + 0.1)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    packed = PrepackedLinear(lin, batch_invariant=True)
    assert packed.batch_invariant and packed.packed is None and torch.equal(packed.weight, lin.weight)
    x = torch.randn(150, k, generator=g).to(torch.bfloat16)
    whole = packed(x)
    assert within_gemm_bound(whole, x, lin)
    assert torch.equal(whole, rows_alone(packed, x))
    assert torch.equal(packed(x[:7].reshape(1, 7, k))[0], whole[:7])


@pytest.mark.skipif(load_f32_fma_gemm() is None, reason="no AVX2 + FMA C product here")
@pytest.mark.parametrize("bias", [False, True])
def test_float_panel_linear_gives_a_row_the_same_output_at_any_row_count(bias) -> None:
    """The deterministic mode's float32 linear, where F.linear's BLAS sums in an order chosen by
    the row count: F.linear within the float32 GEMM bound, each row equal to itself alone."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(96, 200, bias=bias))
    lin = model[0]
    assert panel_float_linears(model) == 1 and isinstance(model[0], FloatPanelLinear)
    panel = model[0]
    assert torch.equal(panel.weight, lin.weight)
    x = torch.randn(300, 96, generator=g)
    whole = panel(x)
    want = torch.nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    bound = x.double().abs() @ lin.weight.double().abs().t() + (0 if lin.bias is None else lin.bias.double().abs())
    assert bool(((whole.double() - want).abs() <= 2 * 98 * 2.0**-24 * bound).all())
    assert torch.equal(whole, rows_alone(panel, x))


def tied_model() -> torch.nn.Module:
    """A bf16 toy model whose LM head is the embedding's table (tied embeddings)."""
    from toy import toy_model

    model = toy_model(seed=5, dtype=torch.bfloat16, vocab_size=320, tie_word_embeddings=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


@needs_bf16_onednn
@pytest.mark.skipif(load_bf16_gemv() is None, reason="no AVX-512 BF16 C product here")
def test_tied_embedding_reads_the_lm_heads_blocked_copy() -> None:
    """After the swap the embedding holds no table of its own: its rows are the LM head's few-row
    copy, bit for bit, and the model's logits are unchanged (prompt and decode-sized inputs)."""
    model = tied_model()
    table = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[0, 1, 15, 16, 17, 255, 319, 42, 7]])
    with torch.no_grad():
        want_prompt, want_decode = model(ids), model(ids[:, :2])
        prepack_dense_linears(model, fuse=True)
        embedding = model.model.embed_tokens
        assert isinstance(embedding, BlockedEmbedding)
        assert embedding.blocked.data_ptr() == model.lm_head.blocked.data_ptr()  # one tensor, not a copy
        assert not any(p.data_ptr() == table.data_ptr() for p in model.parameters())
        for shape in [(9,), (1, 9), (3, 3)]:
            assert torch.equal(embedding(ids.reshape(shape)), torch.nn.functional.embedding(ids.reshape(shape), table))
        assert torch.equal(embedding.weight, table) and model.dtype == torch.bfloat16
        for bad in (-1, 320):  # out of range either way, as nn.Embedding refuses it
            with pytest.raises(IndexError):
                embedding(torch.tensor([3, bad]))
        assert torch.equal(model(ids), want_prompt)
        got = model(ids[:, :2])  # two rows: the LM head's C product, against oneDNN's F.linear
        assert float((got - want_decode).abs().max()) <= 4 * U * float(want_decode.abs().max())


@needs_prepack
def test_untied_or_unblocked_embeddings_keep_their_table(monkeypatch) -> None:
    """Only a tied LM head with a few-row copy lends its rows: an untied model, or a tied one
    prepacked without the few-row copies (they would not fit in memory), keeps nn.Embedding."""
    from toy import toy_model

    from lmfoundry.runtime.cpu import dense_linears

    untied = toy_model(seed=5, dtype=torch.bfloat16, vocab_size=320)
    prepack_dense_linears(untied, fuse=True)
    assert type(untied.model.embed_tokens) is torch.nn.Embedding
    monkeypatch.setattr(dense_linears, "_few_row_copies", lambda model: False)
    tied = tied_model()
    prepack_dense_linears(tied, fuse=True)
    assert type(tied.model.embed_tokens) is torch.nn.Embedding
