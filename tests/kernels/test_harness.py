"""The benchmark/tuning harness (`lmfoundry.kernels.harness`) on every kernel, through the
interpreter: its inputs are valid, its checks pass on correct kernels and fail on wrong output."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import harness, harness_attention, registry
from lmfoundry.kernels.dispatch import JitLauncher

BF, F16 = "bf16", "fp16"
CASES = {
    "w4a16_gemm": ({"act": BF, "scale": BF}, {"BITS": 4, "GROUP_SIZE": 32, "HAS_ZP": True, "HAS_GIDX": True, "HAS_BIAS": True},
                   {"M": 20, "N": 96, "K": 128, "bits": 4}),
    "w4a16_gemv": ({"act": F16, "scale": F16}, {"BITS": 8, "GROUP_SIZE": 0, "HAS_ZP": False, "HAS_GIDX": False, "HAS_BIAS": False},
                   {"M": 2, "N": 64, "K": 96, "bits": 8}),
    "w4a16_tiled": ({"act": BF, "scale": BF}, {"BITS": 4, "GROUP_SIZE": 64, "HAS_ZP": True, "HAS_BIAS": True},
                    {"M": 3, "N": 96, "K": 192, "bits": 4, "group": 64}),
    "w8a8_gemm": ({"a": "i8", "bscale": BF, "out": BF}, {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False,
                                                          "ACC_INT": True}, {"M": 9, "N": 64, "K": 128}),
    "fp8_gemm": ({"a": "fp8e4nv", "bscale": "fp32", "out": F16}, {"A_PER_TOKEN": False, "B_PER_CHANNEL": False,
                                                                  "HAS_BIAS": True, "ACC_INT": False}, {"M": 5, "N": 48, "K": 64}),
    "rmsnorm_quant": ({"act": BF, "out": "i8"}, {"APPLY_NORM": True, "HAS_RESIDUAL": True, "QUANT": 1, "STATIC_SCALE": False},
                      {"M": 4, "H": 192}),
    "silu_mul": ({"act": BF}, {}, {"M": 3, "I": 100}),
    "rotary": ({"act": F16}, {"NUM_Q_HEADS": 4, "NUM_KV_HEADS": 2, "HEAD_DIM": 64}, {"T": 5}),
    "store_kv": ({"act": BF, "kv": "fp8e4nv"}, {"NUM_KV_HEADS": 2, "HEAD_DIM": 64, "PAGE": 16, "KV_QUANT": 2}, {"T": 21}),
    "paged_prefill": ({"act": F16, "kv": "i8"}, {"NUM_Q_HEADS": 4, "NUM_KV_HEADS": 2, "HEAD_DIM": 64, "PAGE": 16, "KV_QUANT": 1},
                      {"B": 2, "ctx": 40, "q_len": 10}),
    "paged_decode": ({"act": BF, "kv": BF}, {"NUM_Q_HEADS": 2, "NUM_KV_HEADS": 1, "HEAD_DIM": 64, "PAGE": 16, "KV_QUANT": 0},
                     {"B": 3, "ctx": 50}),
    "paged_decode_split": ({"act": F16, "kv": "i8"}, {"NUM_Q_HEADS": 6, "NUM_KV_HEADS": 2, "HEAD_DIM": 64, "PAGE": 16,
                                                      "KV_QUANT": 1}, {"B": 2, "ctx": 70, "splits": 3}),
    "paged_decode_reduce": ({"act": BF}, {"NUM_Q_HEADS": 4, "HEAD_DIM": 64}, {"B": 2, "ctx": 90, "splits": 4, "Hkv": 2}),
    "lora_shrink": ({"act": BF}, {}, {"T": 7, "K": 96, "S": 48}),
    "lora_expand": ({"act": F16}, {"PARTS": 3}, {"T": 6, "N": 160, "R": 16}),
}


def test_every_kernel_has_an_example():
    assert set(CASES) == set(registry.KERNELS) == set(harness.BUILDERS)


@pytest.mark.parametrize("kernel", sorted(CASES))
def test_example_passes_its_own_check(kernel, device):
    types, sem, shape = CASES[kernel]
    ex = harness.build(kernel, types, sem, shape, device)
    assert ex.call.kernel.name == kernel and ex.bytes > 0
    harness.run_and_check(ex, JitLauncher())


@pytest.mark.parametrize("kernel", ["w4a16_gemm", "w4a16_tiled", "paged_prefill", "rmsnorm_quant", "paged_decode_reduce"])
def test_example_check_rejects_wrong_output(kernel, device):
    types, sem, shape = CASES[kernel]
    ex = harness.build(kernel, types, sem, shape, device)

    class Wrong:
        def run(self, call):
            JitLauncher().run(call)
            out = call.args["out_ptr"]
            flat = out.view(-1)
            flat[flat.numel() // 2] = (flat[flat.numel() // 2].float() * 1.5 + 3).to(out.dtype)

    with pytest.raises(AssertionError):
        harness.run_and_check(ex, Wrong())


def test_causal_flops_count_the_pairs_the_mask_keeps():
    """Brute force: query j of a context n whose last q_len positions are queries sees keys 0..pos."""
    q_lens, ctx_lens, heads, d = [5, 1, 7, 3], [9, 12, 7, 3], 4, 16
    pairs = 0
    for ql, n in zip(q_lens, ctx_lens, strict=True):
        pos = torch.arange(n - ql, n)[:, None]
        pairs += int((torch.arange(n)[None, :] <= pos).sum())
    assert harness_attention.causal_attention_flops(q_lens, ctx_lens, heads, d) == 4 * d * heads * pairs
    # a full prefill does about half the rectangle's work, not all of it
    assert harness_attention.causal_attention_flops([2048], [2048], 1, 1) == 4 * 2048 * 2049 // 2


def test_prefill_example_uniform_lengths_match_a_dense_batch():
    types, sem, _ = CASES["paged_prefill"]
    ex = harness.build("paged_prefill", types, sem, {"B": 3, "ctx": 40, "q_len": 40, "uniform": 1})
    assert ex.call.args["ctx_len_ptr"].tolist() == [40, 40, 40]
    assert ex.flops == 4 * sem["HEAD_DIM"] * sem["NUM_Q_HEADS"] * 3 * (40 * 41 // 2)
