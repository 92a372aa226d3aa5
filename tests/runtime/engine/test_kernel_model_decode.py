"""How the kernel executor's model runs decode attention: FlashDecoding with a split count chosen
once per step (from the batch, the KV heads, the block table's width and the SMs to fill)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmfoundry.kernels import paged_attention
from lmfoundry.kernels.dispatch import JitLauncher, is_interpreter
from lmfoundry.runtime.kernel_model import KernelModel


def _model(mode: str) -> KernelModel:
    """A KernelModel with only what `decode_splits` reads: 8 KV heads, a hopper bundle, blocks of 16."""
    model = object.__new__(KernelModel)
    model.config = SimpleNamespace(num_kv_heads=8)
    model.device = torch.device("cpu")
    model.kernels = SimpleNamespace(mode=mode, manifest={"archs": {"hopper": {"capability": 90, "sm": "sm_90a"}},
                                                         "kv_cache": {"block_size": 16, "dtype": "auto"}})
    return model


def test_split_count_follows_the_execution_mode():
    reference, interpret = _model("reference"), _model("interpret")
    assert reference.decode_sm_count() == 1 and reference.decode_splits(1, 256) == 1  # CPU references: never split
    assert interpret.decode_sm_count() == 132  # the hopper table's nominal H100/H200 count
    assert interpret.decode_splits(1, 256) == paged_attention.decode_splits(1, 8, 4096, 132, 16) > 1
    assert interpret.decode_splits(64, 256) == 1  # 512 programs fill the GPU unsplit
    assert interpret.decode_splits(1, 4) == 1  # 64 tokens: too short to split


def _kernel_executor_tests():
    path = Path(__file__).with_name("test_kernel_executor.py")
    spec = importlib.util.spec_from_file_location("kernel_executor_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(not is_interpreter(), reason="runs the Triton kernels through the interpreter")
def test_split_decode_through_the_engine(tmp_path, monkeypatch):
    """Greedy decoding with 3 context splits per step (forced: the test contexts are shorter than a
    split's minimum) through the interpreted split and merge kernels agrees with the same bundle on
    the kernels' references (which also split: reference partial states, reference merge)."""
    ke = _kernel_executor_tests()
    monkeypatch.setattr(KernelModel, "decode_splits", lambda self, num_decode, width: 3)
    monkeypatch.setattr(paged_attention, "MIN_SPLIT_TOKENS", 16)  # splits of one block
    seen: Counter = Counter()
    run = JitLauncher.run

    def counting(self, call):
        seen[call.kernel.name] += 1
        return run(self, call)

    monkeypatch.setattr(JitLauncher, "run", counting)
    ke.check_triton_matches_references(ke.Bundles(tmp_path), "w4a16-kv-int8", "cpu", tokens=4)
    assert seen["paged_decode_split"] > 0 and seen["paged_decode_reduce"] == seen["paged_decode_split"]
