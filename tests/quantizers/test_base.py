"""LayerCalibration.run_sequential: the one-pass, group-by-group execution GPTQ runs in."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_decoder_layer

from lmfoundry.model.reference import DecoderLayer
from lmfoundry.quantizers.base import LayerCalibration

GROUPS = [("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]


def _layer_and_calib(arch: str, seed: int = 0) -> tuple[DecoderLayer, LayerCalibration]:
    layer, cos, sin, config = tiny_decoder_layer(arch, seed, tokens=12)
    for p in layer.parameters():  # non-trivial norms too
        p.data.normal_(0, 0.2)
    inputs = [torch.randn(2, 12, config.hidden_size) for _ in range(3)]
    return layer, LayerCalibration(inputs, cos, sin)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sequential_pass_equals_forward_when_nothing_changes(arch):
    layer, calib = _layer_and_calib(arch)
    expected = calib.run(layer, keep_outputs=True)
    seen: list[tuple[str, ...]] = []
    finished: list[tuple[str, ...]] = []
    out = calib.run_sequential(layer, lambda g, x: seen.append(g), finished.append)
    assert finished == GROUPS
    assert seen == [g for g in GROUPS for _ in range(3)]  # every batch observed before the group finishes
    assert len(out) == 3 and calib.inputs == []  # the inputs are consumed
    for o, e in zip(out, expected, strict=True):
        torch.testing.assert_close(o, e, rtol=1e-6, atol=1e-6)


def test_each_group_sees_inputs_of_the_already_changed_groups():
    """What a group observes and what the layer outputs follow the weights `finish` installed:
    the result equals a plain forward through the finally-changed layer, and down_proj's observed
    input is the one the changed gate/up produce."""
    layer, calib = _layer_and_calib("llama", seed=1)
    inputs = [x.clone() for x in calib.inputs]
    changed: dict[str, torch.Tensor] = {}

    def finish(group):
        for name in group:
            w = layer.get_submodule(name).weight
            w.data = torch.round(w.data * 8) / 8  # a stand-in "quantization"
            changed[name] = w.data

    observed: dict[str, list[torch.Tensor]] = {}
    out = calib.run_sequential(layer, lambda g, x: observed.setdefault(g[0], []).append(x.clone()), finish)
    assert sorted(changed) == sorted(n for g in GROUPS for n in g)
    reference = LayerCalibration(inputs, calib.cos, calib.sin).run(layer, keep_outputs=True)
    for o, e in zip(out, reference, strict=True):
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
    mlp, ln = layer.mlp, layer.post_attention_layernorm
    attn_out = [x + layer.self_attn(layer.input_layernorm(x), calib.cos, calib.sin) for x in inputs]
    for got, h in zip(observed["mlp.down_proj"], attn_out, strict=True):
        torch.testing.assert_close(got, mlp.hidden(ln(h)), rtol=1e-5, atol=1e-5)


def test_the_methods_table_names_every_method_and_refuses_bad_input():
    """methods.py is the one table of methods (base.py names none of them); an unknown name and
    an option of the wrong type are the user's errors."""
    from lmfoundry.errors import UserError
    from lmfoundry.quantizers.methods import METHODS, get_quantizer

    assert list(METHODS) == ["rtn", "gptq", "awq", "smoothquant", "fp8"]
    assert all(cls.name == name for name, cls in METHODS.items())
    with pytest.raises(UserError, match="unknown method 'nope'; known: rtn, gptq, awq, smoothquant, fp8"):
        get_quantizer("nope")
    with pytest.raises(UserError, match="gptq: an option has a value of the wrong type"):
        get_quantizer("gptq", {"dampening_frac": "banana"})
