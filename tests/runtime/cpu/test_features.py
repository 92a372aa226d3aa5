"""`--dtype auto` on CPU (`lmfoundry.runtime.cpu.features`): bfloat16 where the CPU has bf16 arithmetic or
the AVX2 kernels widen bf16 for it, float32 where neither holds."""

from __future__ import annotations

import torch

from lmfoundry.runtime.cpu import features as cpu_isa


def test_auto_is_bf16_only_where_something_computes_it_fast(monkeypatch) -> None:
    from lmfoundry.runtime.cpu.native.bf16_fma_gemm import load_bf16_fma_gemm

    built = load_bf16_fma_gemm() is not None
    assert cpu_isa.widened_bf16() == (built and not cpu_isa.native_bf16())
    want = torch.bfloat16 if cpu_isa.native_bf16() or built else torch.float32
    assert cpu_isa.default_dtype() == want
    monkeypatch.setenv("LMFOUNDRY_NATIVE_KERNELS", "0")  # no C kernels: only bf16 arithmetic makes bf16 fast
    assert not cpu_isa.widened_bf16()
    assert cpu_isa.default_dtype() == (torch.bfloat16 if cpu_isa.native_bf16() else torch.float32)
    assert "float32" in cpu_isa.describe() or cpu_isa.native_bf16()
