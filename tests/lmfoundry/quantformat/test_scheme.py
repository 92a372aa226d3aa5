import pytest

from lmfoundry.errors import UserError
from lmfoundry.quantformat.scheme import (
    QuantizationPlan,
    SchemeGroup,
    make_scheme,
    matches_any,
    plan_from_compressed_tensors,
    to_compressed_tensors,
)


@pytest.mark.parametrize("name,fmt,bits", [("w4a16", "pack-quantized", 4), ("w8a16", "pack-quantized", 8),
                                           ("w2a16", "pack-quantized", 2), ("w8a8", "int-quantized", 8),
                                           ("fp8-dynamic", "float-quantized", 8), ("fp8-static", "float-quantized", 8)])
def test_scheme_names(name, fmt, bits):
    s = make_scheme(name, group_size=64)
    assert s.format == fmt and s.weights.num_bits == bits


def test_defaults_and_overrides():
    s = make_scheme("w4a16")
    assert s.weights.group_size == 128 and s.weights.symmetric and s.weights.strategy == "group"
    assert make_scheme("w4a16", per_channel=True).weights.strategy == "channel"
    assert not make_scheme("w4a16", symmetric=False).weights.symmetric


@pytest.mark.parametrize("bad", ["w9a16", "w1a16", "int4", "w4a8", ""])
def test_unknown_scheme(bad):
    with pytest.raises(UserError, match="unknown scheme"):
        make_scheme(bad)


def test_compressed_tensors_roundtrip():
    plan = QuantizationPlan([SchemeGroup(make_scheme("w4a16", group_size=64, symmetric=False))], ["lm_head"])
    cfg = to_compressed_tensors(plan)
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    back = plan_from_compressed_tensors(cfg)
    assert back.groups[0].scheme.weights == plan.groups[0].scheme.weights
    assert back.scheme_for("model.layers.0.mlp.up_proj") is not None
    assert back.scheme_for("lm_head") is None


def test_targets():
    assert matches_any("model.layers.3.self_attn.q_proj", ["re:.*self_attn.*"])
    assert not matches_any("model.layers.3.mlp.up_proj", ["re:.*self_attn.*"])
    assert matches_any("lm_head", ["lm_head"]) and matches_any("model.layers.0.mlp.up_proj", ["Linear"])
