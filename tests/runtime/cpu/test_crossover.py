"""The crossover of the quantized linears (`runtime/cpu/crossover.py`): measured once per shape
and cached, the override, and the dense path it switches to computing what the packed product
computes; for our C products and for PyTorch's int4pack / int8pack linears where there is none."""

from __future__ import annotations

import time

import pytest
import torch

from lmfoundry.quantformat.quantized_weight import QuantizedWeight
from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.runtime.cpu import crossover as cpu_crossover
from lmfoundry.runtime.cpu.native.int4_gemm import load_int4_gemm
from lmfoundry.runtime.cpu.weight_only_linears import (
    DEQUANT_ROWS,
    CProductLinear,
    Int4PackLinear,
    Int8PackLinear,
    packed_linear,
)

needs_c_product = pytest.mark.skipif(load_int4_gemm() is None, reason="no AVX-512 BF16 C product here")


def pytorch_packed(n: int, k: int, bits: int = 4, seed: int = 3) -> Int4PackLinear | Int8PackLinear:
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        args = QuantArgs(4, "int", False, "group", 64)
        q = torch.randint(-8, 8, (n, k), generator=gen)
        scale = torch.rand(n, k // 64, generator=gen) * 0.05 + 0.01
        zp = torch.randint(-2, 3, (n, k // 64), generator=gen)
    else:
        args = QuantArgs(8, "int", True, "channel", None)
        q = torch.randint(-127, 128, (n, k), generator=gen)
        scale, zp = torch.rand(n, 1, generator=gen) * 0.01 + 0.001, None
    linear = packed_linear(QuantizedWeight(q, scale, zp, args), None)
    assert isinstance(linear, (Int4PackLinear, Int8PackLinear)), linear
    return linear


def c_product(n: int, k: int, bits: int = 4, seed: int = 3) -> CProductLinear:
    return CProductLinear([pytorch_packed(n, k, bits, seed)])


@needs_c_product
def test_measured_once_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_crossover.ENV, raising=False)
    calls = []

    def measure(linear, rows=cpu_crossover.CANDIDATE_ROWS):
        calls.append(linear.shape)
        return 256 if linear.kind == "int4" else None

    monkeypatch.setattr(cpu_crossover, "measure", measure)
    linears = [c_product(64, 256), c_product(64, 256, seed=4), c_product(32, 128, bits=8)]
    table = cpu_crossover.set_dense_rows(linears)
    assert table == {("int4", 64, 256, 64, True): 256, ("int8", 32, 128, 128, False): None}
    assert [lin.dense_from for lin in linears] == [256, 256, None]
    assert len(calls) == 2  # one measurement per shape
    assert len(list((tmp_path / "cpu-crossover").glob("*.json"))) == 1
    fresh = [c_product(64, 256), c_product(32, 128, bits=8)]
    assert cpu_crossover.set_dense_rows(fresh) == table and fresh[0].dense_from == 256
    assert len(calls) == 2  # the second start read the cache


@needs_c_product
def test_the_override(monkeypatch) -> None:
    linear = c_product(64, 256)
    monkeypatch.setenv(cpu_crossover.ENV, "300")
    cpu_crossover.set_dense_rows([linear])
    assert linear.dense_from == 300
    monkeypatch.setenv(cpu_crossover.ENV, "never")
    cpu_crossover.set_dense_rows([linear])
    assert linear.dense_from is None
    monkeypatch.setenv(cpu_crossover.ENV, "soon")
    with pytest.raises(ValueError, match="expected `never` or a number"):
        cpu_crossover.set_dense_rows([linear])


@needs_c_product
def test_measure_answers_a_candidate_or_never() -> None:
    linear = c_product(64, 256)
    assert cpu_crossover.measure(linear, rows=(64, 128)) in (None, 64, 128)
    assert linear.dense_from is None  # left as it was


@needs_c_product
@pytest.mark.parametrize("bits", [4, 8])
def test_the_dense_path_computes_what_the_c_product_does(bits) -> None:
    """Dequantized weight (each element rounded once to bf16) times x in the CPU's GEMM against the
    C product on the same codes: both accumulate in fp32; they differ by the rounding of each
    weight to bf16 (u = 2^-8 relative) and the summation order."""
    module = c_product(128, 256, bits)
    x = torch.randn(70, 256).bfloat16()
    c_out = module(x)
    module.dense_from = 64
    dense = module(x)
    w = module.dequantized_weight().double()
    bound = 3 * 2.0**-8 * (x.double().abs() @ w.abs().t()) + 1e-30
    assert ((dense.double() - c_out.double()).abs() <= bound).all()
    module.dense_from = 71
    assert torch.equal(module(x), c_out)  # below the crossover: the C product


def test_pytorch_packed_linears_get_their_own_measured_crossover(tmp_path, monkeypatch) -> None:
    """Where no C product takes a linear, PyTorch's int4pack / int8pack kernel serves it: its
    crossover is measured and cached per shape the same way, instead of the DEQUANT_ROWS default."""
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_crossover.ENV, raising=False)
    calls = []

    def measure(linear, rows=cpu_crossover.CANDIDATE_ROWS):
        calls.append(linear.shape)
        return 512 if linear.shape[0] == "int4pack" else None

    monkeypatch.setattr(cpu_crossover, "measure", measure)
    linears = [pytorch_packed(64, 256), pytorch_packed(64, 256, seed=5), pytorch_packed(32, 128, bits=8)]
    assert all(lin.dense_from == DEQUANT_ROWS for lin in linears)
    table = cpu_crossover.set_dense_rows(linears)
    assert table == {("int4pack", 64, 256, 64, False): 512, ("int8pack", 32, 128, 128, False): None}
    assert [lin.dense_from for lin in linears] == [512, 512, None] and len(calls) == 2
    fresh = [pytorch_packed(64, 256), pytorch_packed(32, 128, bits=8)]  # the next start of the same model
    assert cpu_crossover.set_dense_rows(fresh) == table and fresh[0].dense_from == 512
    assert len(calls) == 2  # read from the cache


@pytest.mark.parametrize("bits", [4, 8])
def test_measuring_a_pytorch_packed_linear_leaves_it_as_it_was(bits) -> None:
    linear = pytorch_packed(64, 256, bits)
    assert cpu_crossover.measure(linear, rows=(64, 128)) in (None, 64, 128)
    assert linear.dense_from == DEQUANT_ROWS


class FakeSiluKernel:
    """A one-pass SiLU(gate) * up that takes `seconds` a call (what `measure_silu_mul` times)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.seconds:
            time.sleep(self.seconds)
        return gate


def test_the_silu_pass_is_taken_from_where_it_is_faster() -> None:
    assert cpu_crossover.measure_silu_mul(FakeSiluKernel(0.0), 256, rows=(1, 4)) == 256  # faster at every size
    assert cpu_crossover.measure_silu_mul(FakeSiluKernel(0.01), 256, rows=(1, 4)) is None  # never faster


def test_the_silu_crossover_is_measured_per_width_once_then_cached(tmp_path, monkeypatch) -> None:
    from toy import toy_model

    from lmfoundry.model.reference import CausalLM
    from lmfoundry.runtime.cpu.elementwise import NativeSiluMul, swap_native_elementwise
    from lmfoundry.runtime.cpu.native.norm_act import load_norm_act

    if load_norm_act() is None:
        pytest.skip("the one-pass kernels are not built here")
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_crossover.SILU_ENV, raising=False)
    calls = []

    def measure(kernel, width, rows=cpu_crossover.SILU_ROWS):
        calls.append(width)
        return 3 * width

    monkeypatch.setattr(cpu_crossover, "measure_silu_mul", measure)
    model: CausalLM = toy_model(seed=0).to(torch.bfloat16)
    assert swap_native_elementwise(model)
    width = model.config.intermediate_size
    assert cpu_crossover.set_silu_mul_from(model) == {width: 3 * width}
    acts = [layer.mlp.act_mul for layer in model.model.layers]
    assert all(isinstance(a, NativeSiluMul) and a.min_elements == 3 * width for a in acts)
    assert calls == [width]  # one measurement for the model's one width
    fresh = toy_model(seed=0).to(torch.bfloat16)
    swap_native_elementwise(fresh)
    assert cpu_crossover.set_silu_mul_from(fresh) == {width: 3 * width} and calls == [width]  # read back
    monkeypatch.setenv(cpu_crossover.SILU_ENV, "never")
    assert cpu_crossover.set_silu_mul_from(fresh) == {width: None}
    assert all(layer.mlp.act_mul.min_elements > 2**40 for layer in fresh.model.layers)
    monkeypatch.setenv(cpu_crossover.SILU_ENV, "many")
    with pytest.raises(ValueError, match="expected `never` or a number"):
        cpu_crossover.set_silu_mul_from(fresh)


def test_a_cached_answer_is_used_only_for_the_key_it_records(tmp_path, monkeypatch) -> None:
    """Two cache files swapped with each other (or one copied in from another machine's cache)
    are measured again rather than read; a killed write's staged file is swept."""
    from pathlib import Path

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path))
    calls: list[int] = []

    def answer(n: int):
        return lambda: calls.append(n) or n * 100

    assert cpu_crossover._cached("probe", [1], answer(1)) == 100
    assert cpu_crossover._cached("probe", [2], answer(2)) == 200
    assert cpu_crossover._cached("probe", [1], answer(1)) == 100 and calls == [1, 2]  # read back
    one, two = sorted((tmp_path / "cpu-crossover").glob("probe-*.json"))
    texts = one.read_text(), two.read_text()
    one.write_text(texts[1])
    two.write_text(texts[0])
    assert cpu_crossover._cached("probe", [1], answer(1)) == 100
    assert cpu_crossover._cached("probe", [2], answer(2)) == 200
    assert calls == [1, 2, 1, 2]  # both measured again
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    staged = tmp_path / "cpu-crossover" / f".{one.name}.partial-{dead_pid}-0a1b2c"
    staged.write_text("{")
    cpu_crossover._cached("probe", [3], answer(3))
    assert not staged.exists() and len(list((tmp_path / "cpu-crossover").iterdir())) == 3
