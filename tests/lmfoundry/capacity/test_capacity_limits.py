"""`lmfoundry plan` with absurd sizes: a step's activations, --gpu-util, the overhead or the LoRA
slots that alone take more than the GPU has are refused in one line naming the limit, and the
limit named is the exact boundary (it passes, one step past it is refused). A plan that only does
not fit is reported with a hint, and the hint never names a flag combination plan refuses."""

from __future__ import annotations

import re

import pytest

from lmfoundry.capacity.arithmetic import lora_bytes
from lmfoundry.capacity.inputs import CapacityInputs
from lmfoundry.capacity.report import build_report
from lmfoundry.errors import UserError
from lmfoundry.model.config import ModelConfig

from .test_capacity import SMOLLM2, run_cli, write_model


@pytest.fixture
def smollm2(tmp_path):
    return write_model(tmp_path / "smollm2", SMOLLM2)


def _refusal(model, capsys, *args: str) -> str:
    code, out, err = run_cli([model, *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and not re.search(r"\s-\d", lines[0])  # no negative size
    return lines[0]


def _limit(line: str, pattern: str) -> float:
    return float(re.search(pattern, line)[1].replace(",", ""))


def test_batch_tokens_past_the_gpu_are_refused_at_the_exact_limit(smollm2, capsys):
    line = _refusal(smollm2, capsys, "--batch-tokens", "1000000000000000000")
    assert "--batch-tokens 1,000,000,000,000,000,000" in line and "activation workspace" in line
    most = int(_limit(line, r"at most ([\d,]+) tokens fit"))
    assert most > 8192
    # the whole GPU but --overhead-gib: at the limit the step fits, one token more it does not
    assert build_report(CapacityInputs(model=str(smollm2), batch_tokens=most, gpu_util=1.0))["selected"]
    with pytest.raises(UserError, match=f"at most {most:,} tokens fit"):
        build_report(CapacityInputs(model=str(smollm2), batch_tokens=most + 1, gpu_util=1.0))


@pytest.mark.parametrize("overhead", ["1", "0"])
def test_a_gpu_util_that_leaves_less_than_the_step_is_refused_with_the_least_that_works(smollm2, capsys, overhead):
    line = _refusal(smollm2, capsys, "--gpu-util", "1e-300", "--overhead-gib", overhead)
    least = _limit(line, r"it must be at least ([\d.]+)")
    assert "--gpu-util 1e-300 leaves 0.00 GiB" in line and 0 < least < 0.05
    report = build_report(CapacityInputs(model=str(smollm2), gpu_util=least, overhead_gib=float(overhead)))
    assert report["selected"]["usable_bytes"] >= report["selected"]["overhead_bytes"] + report["activation_bytes_per_gpu"]
    with pytest.raises(UserError, match="--gpu-util"):
        build_report(CapacityInputs(model=str(smollm2), gpu_util=least - 0.001, overhead_gib=float(overhead)))


def test_an_overhead_of_the_whole_gpu_is_refused(smollm2, capsys):
    assert "--overhead-gib 100 is all of the NVIDIA L4" in _refusal(smollm2, capsys, "--gpu", "l4", "--overhead-gib", "100")


def test_lora_slots_past_the_gpu_are_refused_and_the_named_count_fits(smollm2, capsys):
    """10,000 slots of rank 16 of SmolLM2 take 91 GiB: plan suggested --tp 3, which it then refused
    with --max-loras. Now it refuses the slots, naming how many fit beside the weights and one
    sequence; that many fit, one more does not, and the hint says so without --tp."""
    line = _refusal(smollm2, capsys, "--max-loras", "10000")
    assert "--max-loras 10,000: 10,000 adapter slots of rank 16 take 90.98 GiB" in line and "LoRA runs on one GPU" in line
    most = int(_limit(line, r"at most ([\d,]+) fit"))
    per_slot = lora_bytes(ModelConfig.from_dict(SMOLLM2), 1, 16)
    fits = build_report(CapacityInputs(model=str(smollm2), max_loras=most))["selected"]
    assert fits["max_sequences"] >= 1 and fits["kv_room_bytes"] - fits["kv_bytes_per_sequence"] < per_slot
    over = build_report(CapacityInputs(model=str(smollm2), max_loras=most + 1))
    assert over["selected"]["max_sequences"] == 0
    assert f"at most {most:,} fit beside one 8,192-token sequence" in over["notes"][-1]
    assert "--tp" not in over["notes"][-1].replace("--tp does not divide them", "")


@pytest.mark.parametrize("args", [
    {"max_loras": 7800},  # the slots are what does not fit
    {"max_loras": 1, "context": 4_000_000},  # the sequence is: no slot count helps, and no --tp
    {"context": 4_000_000},  # no LoRA: --tp may be the answer
    {"gpu": "l4", "context": 2_000_000},
])
def test_the_hint_names_only_what_plan_accepts(smollm2, args):
    """Each flag the does-not-fit hint suggests, applied, gives a plan plan does not refuse."""
    report = build_report(CapacityInputs(model=str(smollm2), **args))
    assert report["selected"]["max_sequences"] == 0
    hint = report["notes"][-1]
    assert hint.startswith("does not fit"), report["notes"]
    tp = re.search(r"--tp (\d+) fits", hint)
    if tp is not None:
        assert "max_loras" not in args
        assert build_report(CapacityInputs(model=str(smollm2), **args, tp=int(tp[1])))["selected"]["max_sequences"] >= 1
    slots = re.search(r"at most ([\d,]+) fit", hint)
    if slots is not None:
        fixed = dict(args, max_loras=int(slots[1].replace(",", "")))
        assert build_report(CapacityInputs(model=str(smollm2), **fixed))["selected"]["max_sequences"] >= 1
    if "max_loras" in args:
        assert tp is None
