"""The gathered LoRA C kernels (`runtime/cpu/native/lora.c`) against the PyTorch references and float64
(`helpers.check_lora_kernels`: fp32-accumulation bounds, outputs fully written, base rows
untouched), on decode-sized and prefill-sized steps."""

from __future__ import annotations

import pytest
import torch
from helpers import check_lora_kernels

from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.lora import load_lora_kernels

kernels = load_lora_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"no native kernel: {unavailable_reason('lora')}")


@pytest.mark.parametrize("t,parts,rank,k,dtype", [
    (5, [64, 32, 32], 8, 96, torch.bfloat16),
    (3, [48, 48], 16, 40, torch.float32),
    (7, [130], 4, 77, torch.bfloat16),  # columns and inputs off the vector width
    (300, [576, 192, 192], 16, 576, torch.bfloat16),  # a prefill chunk: the parallel path
])
def test_shrink_and_expand(t, parts, rank, k, dtype, gen):
    check_lora_kernels(kernels.shrink, kernels.expand, t, parts, rank, k, dtype, gen)


def test_inputs_it_does_not_take_are_refused():
    x = torch.zeros(2, 8, dtype=torch.float16)
    a = torch.zeros(1, 4, 8, dtype=torch.float16)
    rows = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="shrink"):
        kernels.shrink(x, a, rows, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="expand"):  # ends that do not cover y's columns
        kernels.expand(torch.zeros(2, 4), torch.zeros(1, 4, 6), rows, torch.tensor([5], dtype=torch.int32),
                       torch.zeros(2, 6))


def test_apply_is_shrink_then_expand(gen):
    """The serving path's one call equals the two calls bit for bit (same loops, same order)."""
    t, parts, rank, k = 9, [64, 32, 32], 8, 96
    a = (torch.randn(3, len(parts) * rank, k, generator=gen) / k**0.5).to(torch.bfloat16)
    bt = (torch.randn(3, rank, sum(parts), generator=gen) / rank**0.5).to(torch.bfloat16)
    ends = torch.tensor(parts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = torch.tensor([(i % 4) - 1 for i in range(t)], dtype=torch.int32)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    y = torch.randn(t, sum(parts), generator=gen).to(torch.bfloat16)
    two = y.clone()
    kernels.expand(kernels.shrink(x, a, rows, torch.empty(t, a.shape[1])), bt, rows, ends, two)
    kernels.check_stack(a, bt, ends)
    assert torch.equal(kernels.apply(x, a, bt, rows, ends, y.clone()), two)
    with pytest.raises(ValueError, match="lora apply"):
        kernels.apply(x.float(), a, bt, rows, ends, y.clone())
    with pytest.raises(ValueError, match="lora stack"):
        kernels.check_stack(a, bt, torch.tensor([64, 96], dtype=torch.int32))
