"""`lmfoundry plan --max-loras N --max-lora-rank R`: the LoRA slots' memory by hand, counted with
the weights in the fit, and equal to what the runtime allocates."""

from __future__ import annotations

import json

import pytest
import torch
from toy import toy_model

from lmfoundry.capacity.arithmetic import lora_bytes
from lmfoundry.capacity.inputs import CapacityInputs
from lmfoundry.capacity.report import build_report
from lmfoundry.model.config import ModelConfig
from lmfoundry.runtime.engine.lora_adapters import LoRAStack

from .test_capacity import LLAMA3_8B, run_cli, write_model


@pytest.fixture
def llama8b(tmp_path):
    return write_model(tmp_path / "llama3-8b", LLAMA3_8B)


def test_lora_bytes_by_hand():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    # per layer, in + out of q (4096 + 4096), k and v (1024 + 4096 each), o (4096 + 4096),
    # gate and up (14336 + 4096 each), down (4096 + 14336)
    per_layer = 8192 + 5120 + 5120 + 8192 + 18432 + 18432 + 18432
    assert per_layer == 81920
    assert lora_bytes(cfg, 8, 16) == 8 * 16 * 32 * 81920 * 2 == 671_088_640


def test_the_slots_count_with_the_weights(llama8b):
    plain = build_report(CapacityInputs(model=str(llama8b)))
    with_lora = build_report(CapacityInputs(model=str(llama8b), max_loras=8, max_lora_rank=16))
    assert with_lora["lora"] == {"max_loras": 8, "max_rank": 16, "bytes": 671_088_640,
                                 "bytes_per_adapter": 671_088_640 // 8}
    a, b = plain["selected"], with_lora["selected"]
    assert b["weight_bytes"] - a["weight_bytes"] == 671_088_640
    assert b["kv_room_bytes"] == a["kv_room_bytes"] - 671_088_640
    assert plain["lora"] is None


def test_the_plan_is_what_the_runtime_allocates():
    model = toy_model(seed=0, dtype=torch.bfloat16)
    stack = LoRAStack.on_model(model, model.config, 3, 8)
    assert stack.nbytes() == lora_bytes(model.config, 3, 8, element_bytes=2)


def test_cli(llama8b, capsys):
    code, out, err = run_cli([llama8b, "--max-loras", "8", "--max-lora-rank", "16"], capsys)
    assert code == 0, err
    assert "LoRA: 8 adapter slots x rank 16" in out and "0.62 GiB" in out
    code, out, err = run_cli([llama8b, "--max-loras", "4", "--json"], capsys)
    assert json.loads(out)["lora"]["bytes"] == 4 * 16 * 32 * 81920 * 2
    for args, message in ((["--max-loras", "0"], "--max-loras must be at least 1"),
                          (["--max-loras", "2", "--tp", "2"], "the runtime serves LoRA adapters on one device"),
                          (["--max-lora-rank", "0"], "--max-lora-rank must be at least 1")):
        code, out, err = run_cli([llama8b, *args], capsys)
        assert code != 0 and err.strip().startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
