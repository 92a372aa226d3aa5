"""Reading schemes, shapes and tensors from compressed-tensors checkpoints."""

from __future__ import annotations

import json

import pytest

from lmfoundry.compile.source import load_checkpoint
from lmfoundry.errors import UserError


def test_w4a16_group_symmetric(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", bits=4, group=32))
    s = ck.schemes["model.layers.1.self_attn.q_proj"]
    assert (s.kind, s.bits, s.group_size, s.symmetric, s.actorder) == ("w4a16", 4, 32, True, False)
    assert ck.schemes["lm_head"].kind == "dense"  # ignored
    assert ck.dtype == "bfloat16" and ck.scale_dtype("model.layers.0.mlp.up_proj") == "bfloat16"
    assert ck.tensors["model.layers.0.self_attn.q_proj.weight_packed"] == ("I32", (128, 16))
    assert ck.shape_of("model.layers.0.mlp.down_proj") == (128, 256)


def test_asymmetric_actorder_and_channel(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", bits=8, group=None, symmetric=False, actorder=True))
    s = ck.schemes["model.layers.0.mlp.gate_proj"]
    assert (s.bits, s.group_size, s.symmetric, s.actorder, s.weight_strategy) == (8, 0, False, True, "channel")


@pytest.mark.parametrize("scheme,kind", [("w8a8", "w8a8"), ("fp8", "fp8")])
def test_activation_quantized(make_checkpoint, scheme, kind):
    ck = load_checkpoint(make_checkpoint(scheme=scheme, kv_cache="fp8" if kind == "fp8" else "int8"))
    s = ck.schemes["model.layers.0.self_attn.o_proj"]
    assert (s.kind, s.weight_strategy, s.input_strategy, s.input_dynamic) == (kind, "channel", "token", True)
    assert ck.kv.dtype == ("fp8" if kind == "fp8" else "int8")


def test_regex_target_overrides(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(
        scheme="w4a16", group=32,
        overrides={"re:.*down_proj$": {"weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                   "strategy": "channel"}, "input_activations": None}},
        weights=False))
    assert ck.schemes["model.layers.0.mlp.down_proj"].bits == 8
    assert ck.schemes["model.layers.0.mlp.up_proj"].bits == 4


def test_float_checkpoint_is_all_dense(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="dense"))
    assert {s.kind for s in ck.schemes.values()} == {"dense"}


def test_config_only_folder(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(weights=False))
    assert not ck.has_weights() and ck.schemes["model.layers.0.self_attn.k_proj"].kind == "w4a16"


def test_user_errors(tmp_path, make_checkpoint):
    with pytest.raises(UserError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing")
    with pytest.raises(UserError, match="group size 96 does not divide"):
        load_checkpoint(make_checkpoint(group=96, weights=False))
    with pytest.raises(UserError, match="3-bit weights"):
        load_checkpoint(make_checkpoint(bits=3, weights=False))
    p = make_checkpoint(weights=False)
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="quant_method"):
        load_checkpoint(p)
