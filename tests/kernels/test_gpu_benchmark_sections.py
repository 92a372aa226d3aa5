"""benchmarks/gpu_kernels.py's INT8/FP8 GEMM and causal-prefill sections, on CPU.

The sections live in gpu_matmul_sections.py and gpu_attention_sections.py beside it; they are
reached through gpu_kernels.py, which imports them the way the script runs them.

The timing needs a GPU; what the table's ratios rest on does not: that our GEMM and the torch peer
it is timed against compute the same function (both pass the reference's `checks.dot_bound` on the
same operands), that a wrong peer is caught, and that the shapes and FLOP counts are the ones the
issue names (4096^3, 8192^3, 8B/70B layers at M = 1/16/64; causal pairs, not the full rectangle).
"""

from __future__ import annotations

import pytest
import torch
from helpers import gpu_kernels_benchmark

from lmfoundry.kernels import harness, harness_attention
from lmfoundry.kernels.dispatch import JitLauncher
from lmfoundry.kernels.error_bounds import U32


@pytest.fixture(scope="module")
def matmul():
    """benchmarks/gpu_matmul_sections.py (W4A16 on LLM shapes, INT8/FP8 GEMM)."""
    return gpu_kernels_benchmark().gpu_matmul_sections


@pytest.fixture(scope="module")
def attention():
    """benchmarks/gpu_attention_sections.py (paged decode, causal prefill)."""
    return gpu_kernels_benchmark().gpu_attention_sections


@pytest.mark.parametrize("kernel", ["w8a8_gemm", "fp8_gemm"])
@pytest.mark.parametrize("m", [1, 5])
def test_gemm8_ours_and_peer_pass_the_same_check(matmul, kernel, m, device):
    ex = matmul.gemm8_example(kernel, m, 48, 96, device)
    assert ex.call.semantics["A_PER_TOKEN"] and ex.call.semantics["B_PER_CHANNEL"]
    matmul.gemm8_check(ex, JitLauncher(), U32)
    fn, to_out = matmul.gemm8_peer(ex.call)
    out = to_out(fn())
    assert out.shape == (m, 48) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("kernel", ["w8a8_gemm", "fp8_gemm"])
def test_gemm8_check_rejects_a_peer_that_computes_something_else(matmul, kernel, device, monkeypatch):
    real = matmul.gemm8_peer

    def unscaled(call):  # forgets the weight scales: the kind of mismatch that would fake a ratio
        fn, to_out = real(call)
        sb = call.args["b_scale_ptr"].float().reshape(1, -1)
        return fn, (lambda r: (to_out(r).float() / sb).to(torch.bfloat16))

    monkeypatch.setattr(matmul, "gemm8_peer", unscaled)  # where gemm8_check looks it up
    with pytest.raises(AssertionError):
        matmul.gemm8_check(matmul.gemm8_example(kernel, 5, 48, 96, device), JitLauncher(), U32)


def test_gemm8_plan_is_the_issues_shapes(matmul):
    assert matmul.gemm8_kernels(90) == ["w8a8_gemm", "fp8_gemm"]
    assert matmul.gemm8_kernels(80) == ["w8a8_gemm"]  # no FP8 tensor cores before sm_89
    assert set(matmul.GEMM8_SQUARE) == {4096, 8192}
    assert (8192, 28672) in matmul.W4A16_LLM_SHAPES and (4096, 14336) in matmul.W4A16_LLM_SHAPES
    assert matmul.GEMM8_LLM_ROWS == (1, 16, 64)


def test_prefill_cases_count_causal_pairs(attention):
    cases = attention.prefill_cases(90)
    assert {c["kv"] for c in cases} == {"bf16", "i8", "fp8e4nv"}
    assert {c["kv"] for c in attention.prefill_cases(80)} == {"bf16", "i8"}
    assert all(c["q_len"] == c["ctx"] and c["uniform"] for c in cases)
    heads = attention.PREFILL_HEADS
    # a short instance of each case builds on CPU with the same flop count the section asserts
    for case in cases[:2]:
        n = 48
        ex = harness.build("paged_prefill", {"act": "bf16", "kv": case["kv"]}, {**heads, "KV_QUANT": case["KV_QUANT"]},
                            {"B": case["B"], "ctx": n, "q_len": n, "uniform": 1}, "cpu")
        assert ex.flops == harness_attention.causal_attention_flops([n] * case["B"], [n] * case["B"], 32, 128)
        assert ex.flops == 4 * 128 * 32 * case["B"] * n * (n + 1) // 2


def test_fp8_checks_have_a_bound_at_every_planned_shape(matmul):
    """The lease checked FP8 at K = 8192..28672 with one 2^-13 unit over all of K, where γ_K does
    not exist (`gamma undefined`); every planned shape now gets the kernel's own tiled bound, for
    every tile bucket the Hopper table gives it (SPLIT_K sized per shape)."""
    from lmfoundry.kernels import tiles
    from lmfoundry.kernels.error_bounds import dot_gamma

    gpu_timing = gpu_kernels_benchmark().gpu_timing
    shapes = [(sq, sq) for sq in matmul.GEMM8_SQUARE] + list(matmul.W4A16_LLM_SHAPES)
    assert max(k for _, k in shapes) == 28672
    for n, k in shapes:
        for _, _, config in tiles.buckets(90, "fp8_gemm", {"N": n, "K": k}):
            assert dot_gamma(k, gpu_timing.acc_unit("fp8_gemm", 90, config), 4) < 0.02, (n, k, config)
    with pytest.raises(ValueError, match="tile config"):
        gpu_timing.acc_unit("fp8_gemm", 90)
