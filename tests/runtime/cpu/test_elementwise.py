"""The serving-time swap of RMSNorm, SiLU(gate) * up and rotary onto the one-pass C kernels: which modules
it takes, and that a swapped bf16 model computes what the reference modules do (within bf16
rounding steps) on the shipped SmolLM2 and a toy model."""

from __future__ import annotations

import pytest
import torch
from toy import toy_model

from lmfoundry.model.reference import MLP, Attention, RMSNorm
from lmfoundry.runtime.cpu.dense_linears import can_prepack, prepack_dense_linears
from lmfoundry.runtime.cpu.elementwise import NativeRMSNorm, NativeSiluMul, swap_native_elementwise
from lmfoundry.runtime.cpu.native.norm_act import load_norm_act

pytestmark = pytest.mark.skipif(load_norm_act() is None, reason="no native kernel here")


def test_swap_takes_plain_bf16_norms_and_silu_mlps() -> None:
    model = toy_model(dtype=torch.bfloat16)
    norms = sum(type(m) is RMSNorm for m in model.modules())
    mlps = sum(isinstance(m, MLP) for m in model.modules())
    attentions = sum(isinstance(m, Attention) for m in model.modules())
    assert swap_native_elementwise(model) == norms + mlps + attentions
    assert not any(type(m) is RMSNorm for m in model.modules())
    assert all(isinstance(m.act_mul, NativeSiluMul) for m in model.modules() if isinstance(m, MLP))
    assert all(m.rope is not None for m in model.modules() if isinstance(m, Attention))
    assert swap_native_elementwise(model) == 0  # nothing left to swap
    float_model = toy_model(dtype=torch.float32)
    assert swap_native_elementwise(float_model) == mlps + attentions  # the kernels decline fp32 calls themselves
    assert not any(isinstance(m, NativeRMSNorm) for m in float_model.modules())  # fp32 gains stay reference


def test_swap_is_off_with_native_kernels_disabled(monkeypatch) -> None:
    from lmfoundry.runtime.cpu.native import build

    monkeypatch.setenv(build.DISABLE_ENV, "0")
    assert swap_native_elementwise(toy_model(dtype=torch.bfloat16)) == 0


def test_swapped_model_computes_what_the_reference_does() -> None:
    """Hidden states of a bf16 toy model (prepacked and fused, as served, where oneDNN has bf16
    kernels) with and without the swap: per-element differences stay at the scale of a few bf16
    steps of the activations."""
    gen = torch.Generator().manual_seed(0)
    model = toy_model(dtype=torch.bfloat16)
    if can_prepack(torch.bfloat16):
        prepack_dense_linears(model, fuse=True)
    ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen)  # 96 rows: SiLU on the kernel
    with torch.no_grad():
        ref = model.hidden_states(ids).float()
        swap_native_elementwise(model)
        out = model.hidden_states(ids).float()
    rel = (out - ref).norm() / ref.norm()
    assert float(rel) < 4 * 2.0**-8, float(rel)
    assert not torch.equal(out, torch.zeros_like(out))
