"""Invariants every kernel definition must keep for the AOT path and the cubin launcher."""

from __future__ import annotations

import inspect

import pytest

from lmfoundry.kernels import registry
from lmfoundry.kernels.spec import TileConfig, eval_grid_rule


def _arg_names(kd) -> list[str]:
    fn = kd.fn
    names = getattr(fn, "arg_names", None)
    if names is None:  # InterpretedFunction
        names = list(inspect.signature(fn.fn).parameters)
    return list(names)


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_params_follow_the_kernel_signature(name):
    """Launchers pack args in `params` order: it must be the kernel's own non-constexpr order, and
    every other kernel argument must be a declared semantic or tile constexpr."""
    kd = registry.kernel(name)
    names = _arg_names(kd)
    runtime = [p.name for p in kd.params]
    assert names[: len(runtime)] == runtime
    assert sorted(names[len(runtime):]) == sorted((*kd.semantics, *kd.tiles))
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_grid_rules_evaluate(name):
    kd = registry.kernel(name)
    names = {n: 7 for rule in kd.grid for n in ("M", "N", "S", "T", "B", "max_q_len", "INTER", "num_splits")}
    names.update({n: 16 for n in (*kd.semantics, *kd.tiles)})
    for rule in kd.grid:
        assert eval_grid_rule(rule, names) >= 1


def test_supports():
    assert registry.supports("w4a16", bits=4, group_size=64, dtype="bfloat16", arch=90)
    assert not registry.supports("w4a16", bits=3)
    assert not registry.supports("fp8", arch=80)
    assert registry.supports("fp8", arch=89)
    assert registry.supports("paged_attention", kv_dtype="int8", block_size=16, head_dim=64)
    with pytest.raises(KeyError):
        registry.supports("w4a16", colour="red")
    with pytest.raises(KeyError):
        registry.family("nope")


def test_every_family_has_a_test_module():
    from pathlib import Path

    here = Path(__file__).parent
    tested = {
        "w4a16": "test_w4a16.py", "w8a8": "test_w8a8.py", "fp8": "test_fp8_gemm.py", "rmsnorm_quant": "test_norm_quant.py",
        "silu_mul": "test_activation.py", "rotary": "test_rotary.py", "kv_cache": "test_paged_attention.py",
        "paged_attention": "test_paged_attention.py", "lora": "test_lora.py",
    }
    assert set(tested) == set(registry.FAMILIES)
    for module in tested.values():
        assert (here / module).exists()


def test_grid_rule_language():
    assert eval_grid_rule("cdiv(M, BLOCK_M)", {"M": 65, "BLOCK_M": 64}) == 2
    assert eval_grid_rule("max(1, N // 2) * 3", {"N": 1}) == 3
    for bad in ("__import__('os')", "M ** 2", "M.bit_length()", "lambda: 1"):
        with pytest.raises(ValueError):
            eval_grid_rule(bad, {"M": 2})
    with pytest.raises(KeyError):
        eval_grid_rule("cdiv(M, BLOCK_M)", {"M": 1})


def test_tile_config_round_trip():
    cfg = TileConfig.make(num_warps=8, num_stages=3, BLOCK_M=128, BLOCK_N=64)
    assert TileConfig.from_dict(cfg.as_dict()) == cfg
    assert cfg["BLOCK_M"] == 128


def test_every_family_names_its_ops_once():
    """The registry is the one list of families: an engine's KernelSet binds `registry.OPS`, so
    every family offers an op and no two families offer one under the same name."""
    names = [name for f in registry.FAMILIES.values() for name in f.ops]
    assert all(f.ops for f in registry.FAMILIES.values())
    assert len(names) == len(set(names)) == len(registry.OPS)
