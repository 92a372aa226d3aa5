"""The typed recipe: defaults in one place, YAML then flags, checked at each step, and the dict
the manifest records."""

from __future__ import annotations

import pytest

from lmfoundry.errors import UserError
from lmfoundry.recipe import CalibrationSection, QuantizeSection, Recipe

# what lmfoundry.json recorded for a recipe of defaults before the recipe became typed
DEFAULT_DICT = {
    "quantize": {"method": "rtn", "scheme": "w4a16", "group_size": None, "per_channel": False, "symmetric": None,
                 "observer": "minmax", "actorder": None, "targets": ["Linear"], "ignore": ["lm_head"],
                 "kv_cache": None, "kv_strategy": "tensor", "dtype": "auto", "options": {}},
    "calibration": {"source": "c4", "num_samples": 128, "seq_len": 512, "seed": 0, "propagate": "quantized",
                    "batch_size": 8, "moe_experts": "all"},
}


def test_defaults_are_the_manifest_dict_of_before():
    assert Recipe().to_dict() == DEFAULT_DICT
    assert list(Recipe().to_dict()["quantize"]) == list(DEFAULT_DICT["quantize"])
    assert Recipe.from_yaml(None) == Recipe()


def test_a_later_key_is_recorded_only_when_set(tmp_path):
    """`lm_head` came after checkpoints were published: at "float" the record is the one of before,
    set otherwise it is recorded, and a recorded recipe reads back to the same recipe."""
    import yaml

    head = Recipe().with_overrides(lm_head="w8a16")
    assert head.to_dict()["quantize"]["lm_head"] == "w8a16"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(head.to_dict()))
    assert Recipe.from_yaml(path).quantize == head.quantize
    with pytest.raises(UserError, match="quantize.lm_head must be one of float, w8a16, w4a16"):
        Recipe().with_overrides(lm_head="w2a16")


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: mine\nquantize: {method: gptq, group_size: 32, options: {dampening_frac: 0.05}}\n"
                    "calibration: {num_samples: 16}\n")
    rec = Recipe.from_yaml(path)
    assert rec.source_file == str(path) and rec.name == "mine"
    assert rec.quantize == QuantizeSection(method="gptq", group_size=32, options={"dampening_frac": 0.05})
    assert rec.calibration == CalibrationSection(num_samples=16)
    flagged = rec.with_overrides(group_size=None, seq_len=64, source="tiny")  # None: a flag not given
    assert flagged.quantize.group_size == 32 and flagged.calibration.seq_len == 64
    assert flagged.source_file == rec.source_file and rec.calibration.seq_len == 512  # rec is unchanged
    assert flagged.to_dict()["name"] == "mine" and "source_file" not in flagged.to_dict()


def test_flags_are_checked_and_unknown_keys_refused(tmp_path):
    with pytest.raises(UserError, match=r"recipe \(with the command-line flags\): calibration.seq_len must be"):
        Recipe().with_overrides(seq_len=0)
    with pytest.raises(TypeError, match="no recipe key"):
        Recipe().with_overrides(sequence_length=64)
    path = tmp_path / "bad.yaml"
    path.write_text("quantize: {per_channel: 'no'}\n")
    with pytest.raises(UserError, match="quantize.per_channel must be true or false"):
        Recipe.from_yaml(path)
    with pytest.raises(UserError, match="calibration.seed must be"):
        Recipe(calibration=CalibrationSection(seed=-1)).check()
