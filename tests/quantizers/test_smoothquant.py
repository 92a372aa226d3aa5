"""SmoothQuant: smoothing is exact in float, it helps int8 activations, and the W8A8-INT8
checkpoint runs in our integer reference path and in transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model_folder, write_text

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.model.quantized_linear import ActivationQuantizedLinear as Int8Linear
from lmfoundry.quantformat.scheme import make_scheme, with_static_activations
from lmfoundry.quantizers.base import LayerCalibration
from lmfoundry.quantizers.smoothquant import SmoothQuantQuantizer, smoothing_factors
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model


def attach_input_scales(monkeypatch):
    """Until the loader passes `input_scale` to the runtime linears (see the issue report), attach
    it to the decoded weight, where the factories look for it."""
    import lmfoundry.runtime.checkpoint_model as checkpoint_model
    from lmfoundry.checkpoint.folder import decode_linear

    def decode(tensors, scheme):
        qw = decode_linear(tensors, scheme)
        qw.input_scale = tensors.get("input_scale")
        return qw

    monkeypatch.setattr(checkpoint_model, "decode_linear", decode)


def outlier_model(tmp_path, **overrides):
    """Tiny Llama whose normed activations have a few large channels (what SmoothQuant targets)."""
    folder = tiny_model_folder(tmp_path / "float", **overrides)
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    for name in list(state):
        if name.endswith("layernorm.weight"):
            w = state[name].clone()
            w[[3, 50, 97]] *= 40.0
            state[name] = w
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def recipe(method, scheme, tmp_path, **q):
    rec = Recipe().with_overrides(method=method, scheme=scheme, **q)
    rec = rec.with_overrides(source=str(write_text(tmp_path / "calib.txt")), num_samples=8, seq_len=48,
                              batch_size=4)
    return rec


def _layer_calibration(model, ids):
    x = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(torch.arange(ids.shape[1])[None], x.dtype)
    return [x], cos, sin


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 4}], ids=["gqa", "mha"])
def test_smoothing_folded_into_norms_keeps_float_logits(tmp_path, overrides):
    folder = outlier_model(tmp_path, **overrides)
    model, _ = load_model(folder)
    ids = torch.randint(4, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
        smoothed = copy.deepcopy(model)
        inputs, cos, sin = _layer_calibration(smoothed, ids)
        calib = LayerCalibration(inputs, cos, sin)
        schemes = {n: make_scheme("w8a8") for n in smoothed.config.linear_shapes}
        sq = SmoothQuantQuantizer({"alpha": 0.5})
        spread = []
        for i, layer in enumerate(smoothed.model.layers):
            calib.run(layer, hooks=sq.calibration_hooks(layer, schemes, i))
            res = sq.quantize_layer(layer, schemes, calib, i)  # smooths the float layer in place
            spread += [m["s_max"] / m["s_min"] for m in res.metrics["smoothing"].values()]
            calib.inputs = calib.run(layer, keep_outputs=True)
        after = smoothed(ids)
    assert max(spread) > 5.0  # smoothing really rescaled channels
    orig = dict(model.named_parameters())
    changed = [n for n, p in smoothed.named_parameters() if not torch.equal(p, orig[n])]
    assert any("input_layernorm" in n for n in changed) and any("v_proj" in n for n in changed)
    assert any("up_proj" in n for n in changed) and any("o_proj" in n for n in changed)
    # float32 rounding of the rescaled weights only
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))


def test_smoothing_factor_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smoothing_factors(act, w, 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))  # zeros: nothing to migrate


def _w8a8_layer_error(folder, tmp_path, method, options=None):
    out = tmp_path / f"{method}-{len(options or {})}"
    rec = recipe(method, "w8a8", tmp_path, options=options or {})
    run_job(QuantizeJob(str(folder), out, rec, progress=False))
    return out


def test_smoothquant_beats_plain_w8a8_on_outliers(tmp_path):
    folder = outlier_model(tmp_path)
    ref, _ = load_model(folder)
    ids = torch.randint(4, 250, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y0 = ref(ids)
        errs = {}
        for method in ("rtn", "smoothquant"):
            q, _ = load_model(_w8a8_layer_error(folder, tmp_path, method))
            assert isinstance(q.model.layers[0].mlp.down_proj, Int8Linear)
            errs[method] = float((q(ids) - y0).norm() / y0.norm())
    assert errs["smoothquant"] < 0.7 * errs["rtn"], errs


def test_alpha_search_chooses_from_grid(tmp_path):
    folder = outlier_model(tmp_path)
    out = _w8a8_layer_error(folder, tmp_path, "smoothquant", {"alpha_search": True, "alpha_grid": [0.3, 0.5, 0.8]})
    import json

    layers = json.loads((out / "lmfoundry.json").read_text())["layers"]
    alphas = {m["alpha"] for layer in layers.values() if "smoothing" in layer for m in layer["smoothing"].values()}
    assert alphas and alphas <= {0.3, 0.5, 0.8}


def test_static_w8a8_writes_shared_input_scales(tmp_path, monkeypatch):
    attach_input_scales(monkeypatch)
    folder = outlier_model(tmp_path)
    import lmfoundry.calibration.job as job
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.quantformat.scheme import QuantizationPlan, SchemeGroup

    static = with_static_activations(make_scheme("w8a8"))
    monkeypatch.setattr(job, "build_plan", lambda q: QuantizationPlan([SchemeGroup(static)], ["lm_head"]))
    out = tmp_path / "static"
    run_job(QuantizeJob(str(folder), out, recipe("smoothquant", "w8a8", tmp_path), progress=False))
    reader = CheckpointReader(out)
    assert reader.plan.groups[0].scheme.input_activations.dynamic is False
    p = "model.layers.0"
    t = reader.get([f"{p}.self_attn.{n}_proj.input_scale" for n in "qkvo"] + [f"{p}.mlp.{n}_proj.input_scale" for n in ("gate", "up", "down")])
    assert torch.equal(t[f"{p}.self_attn.q_proj.input_scale"], t[f"{p}.self_attn.k_proj.input_scale"])
    assert torch.equal(t[f"{p}.self_attn.q_proj.input_scale"], t[f"{p}.self_attn.v_proj.input_scale"])
    assert torch.equal(t[f"{p}.mlp.gate_proj.input_scale"], t[f"{p}.mlp.up_proj.input_scale"])
    assert all(v.shape == (1,) and float(v) > 0 for v in t.values())
    ref, _ = load_model(folder)
    q, _ = load_model(out)
    assert q.model.layers[0].self_attn.q_proj.input_scale is not None
    ids = torch.randint(4, 250, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y0, y = ref(ids), q(ids)
    assert float((y - y0).norm() / y0.norm()) < 0.35  # per-tensor static int8 on random weights


def test_refuses_non_w8a8(tmp_path):
    with pytest.raises(UserError, match="w8a8"):
        SmoothQuantQuantizer().validate(make_scheme("w4a16"))
    with pytest.raises(UserError, match="weight_method"):
        SmoothQuantQuantizer({"weight_method": "awq"})


def test_transformers_runs_our_w8a8_checkpoint(tmp_path):
    """transformers decompresses int-quantized weights and fake-quantizes activations per token with
    compressed-tensors' scale absmax/127.5. With that divisor our integer path must agree to fp32
    roundoff; with vLLM's 127 (our default) the two differ by activation rounding only, about one
    int8 step per element: well under the quantization error itself."""
    from transformers import AutoModelForCausalLM

    folder = outlier_model(tmp_path)
    out = _w8a8_layer_error(folder, tmp_path, "smoothquant")
    ids = torch.randint(4, 250, (2, 40), generator=torch.Generator().manual_seed(3))
    ours, _ = load_model(out)
    ref, _ = load_model(folder)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        y_hf = hf(ids).logits.float()
        y_vllm = ours(ids)
        y0 = ref(ids)
        for m in ours.modules():
            if isinstance(m, Int8Linear):
                m.act_qmax = 127.5
        y_ct = ours(ids)
    def rel(a, b):
        return float((a - b).norm() / b.norm())

    # same convention: identical int8 codes except where x / s lands within fp32 roundoff of a
    # rounding tie (a code then differs by one step): measured 0.3% here, against 11% quantization
    # error and 5% between the two conventions
    assert rel(y_ct, y_hf) < 0.1 * rel(y_vllm, y_hf)
    assert rel(y_ct, y_hf) < 0.02
    assert rel(y_vllm, y_hf) < rel(y_hf, y0)
