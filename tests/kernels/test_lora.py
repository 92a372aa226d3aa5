"""The gathered LoRA Triton kernels (BGMV shrink and expand) against their PyTorch references and
float64, rows of several adapters and of the base mixed in one call (`helpers.check_lora_kernels`)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_lora_kernels

from lmfoundry.kernels import lora

CASES = [  # (rows, parts, rank, K, dtype)
    (5, [64, 32, 32], 8, 96, torch.bfloat16),
    (3, [48, 48], 16, 40, torch.float16),
    (7, [80], 4, 130, torch.float32),
]


def _shrink(x, a, rows, out):
    lora.lora_shrink(x, a, rows, out=out)


@pytest.mark.parametrize("t,parts,rank,k,dtype", CASES)
def test_shrink_and_expand(t, parts, rank, k, dtype, gen, device):
    check_lora_kernels(_shrink, lora.lora_expand, t, parts, rank, k, dtype, gen, device)


def test_all_base_rows_change_nothing(gen, device):
    a = torch.randn(2, 4, 16, generator=gen).to(torch.bfloat16).to(device)
    bt = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16).to(device)
    rows = torch.full((4,), -1, dtype=torch.int32, device=device)
    x = torch.randn(4, 16, generator=gen).to(torch.bfloat16)
    s = lora.lora_shrink(x.to(device), a, rows)
    assert not s.cpu().any()
    y0 = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    y = lora.lora_expand(s, bt, rows, torch.tensor([32], dtype=torch.int32, device=device), y0.clone().to(device))
    assert torch.equal(y.cpu(), y0)


def test_shapes_refused():
    with pytest.raises(ValueError, match="lora_shrink"):
        lora.lora_shrink(torch.zeros(2, 8), torch.zeros(1, 4, 9), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="lora_expand"):
        lora.lora_expand(torch.zeros(2, 6), torch.zeros(1, 4, 6), torch.zeros(2, dtype=torch.int32),
                         torch.tensor([3, 6], dtype=torch.int32), torch.zeros(2, 6))


@pytest.mark.parametrize("kernel,out,row", [("lora_shrink", "s_ptr", 1), ("lora_expand", "y_ptr", 0),
                                            ("lora_expand", "y_ptr", 1)])
def test_the_harness_check_rejects_a_wrong_row(kernel, out, row, device):
    """The GPU benchmark's and compile's check: a row off by a little (an adapter row, or a base row
    the expand must leave alone) fails it."""
    from lmfoundry.kernels import harness
    from lmfoundry.kernels.dispatch import JitLauncher

    shape = {"T": 6, "K": 64, "S": 32} if kernel == "lora_shrink" else {"T": 6, "N": 96, "R": 8}
    ex = harness.build(kernel, {"act": "bf16"}, {} if kernel == "lora_shrink" else {"PARTS": 2}, shape, device)
    harness.run_and_check(ex, JitLauncher())

    class Wrong:
        def run(self, call):
            JitLauncher().run(call)
            call.args[out][row, 3] += 0.5  # row 0 is a base row (slot -1), row 1 an adapter's

    with pytest.raises(AssertionError):
        harness.run_and_check(ex, Wrong())
