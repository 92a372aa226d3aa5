"""The 4-bit crossover (`runtime/cpu_crossover.py`): measured once per shape and cached, the override,
and the dense path it switches to computing what the C product computes."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.cpu.int4_gemm import load_int4_gemm
from lmfoundry.runtime import cpu_crossover

gemm = load_int4_gemm()
pytestmark = pytest.mark.skipif(gemm is None, reason="no AVX-512 BF16 C product here")
SHAPE = (64, 256, 64, False)


def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_crossover.ENV, raising=False)
    calls = []

    def measure(shape, g, rows=cpu_crossover.CANDIDATE_ROWS):
        calls.append(shape)
        return 256 if shape == SHAPE else None

    monkeypatch.setattr(cpu_crossover, "measure", measure)
    other = (128, 256, 64, True)
    assert cpu_crossover.int4_dense_rows([SHAPE, other, SHAPE], gemm) == {SHAPE: 256, other: None}
    assert calls == [SHAPE, other]
    assert len(list((tmp_path / "cpu-crossover").glob("int4-*.json"))) == 1
    assert cpu_crossover.int4_dense_rows([other, SHAPE], gemm) == {SHAPE: 256, other: None}
    assert len(calls) == 2  # the second start read the cache


def test_the_override(monkeypatch) -> None:
    monkeypatch.setenv(cpu_crossover.ENV, "never")
    assert cpu_crossover.int4_dense_rows([SHAPE], gemm) == {SHAPE: None}
    monkeypatch.setenv(cpu_crossover.ENV, "300")
    assert cpu_crossover.int4_dense_rows([SHAPE], gemm) == {SHAPE: 300}
    monkeypatch.setenv(cpu_crossover.ENV, "soon")
    with pytest.raises(ValueError, match="expected `never` or a number"):
        cpu_crossover.int4_dense_rows([SHAPE], gemm)


def test_measure_answers_a_candidate_or_never() -> None:
    got = cpu_crossover.measure(SHAPE, gemm, rows=(64, 128))
    assert got in (None, 64, 128)


def test_the_dense_path_computes_what_the_c_product_does() -> None:
    """Dequantized weight (each element rounded once to bf16) times x in the CPU's GEMM against the
    C product on the same codes: both accumulate in fp32; they differ by the rounding of each
    weight to bf16 (u = 2^-8 relative) and the summation order."""
    from lmfoundry.model.cpu_linears import Int4GemmLinear, packed_linear
    from lmfoundry.quantizers.base import QuantizedWeight
    from lmfoundry.quantizers.scheme import QuantArgs

    gen = torch.Generator().manual_seed(3)
    args = QuantArgs(4, "int", False, "group", 64)
    q = torch.randint(-8, 8, (128, 256), generator=gen)
    scale = torch.rand(128, 4, generator=gen) * 0.05 + 0.01
    zp = torch.randint(-2, 3, (128, 4), generator=gen)
    module = Int4GemmLinear([packed_linear(QuantizedWeight(q, scale, zp, args), None)], gemm)
    x = torch.randn(70, 256, generator=gen).bfloat16()
    c_product = module(x)
    module.dense_from = 64
    dense = module(x)
    w = module.dequantized_weight().double()
    bound = 3 * 2.0**-8 * (x.double().abs() @ w.abs().t()) + 1e-30
    assert ((dense.double() - c_product.double()).abs() <= bound).all()
    module.dense_from = 71
    assert torch.equal(module(x), c_product)  # below the crossover: the C product
