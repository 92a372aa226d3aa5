"""AWQ: folding the smoothing scales leaves the float model unchanged; the search lowers the output
error; the checkpoint is a plain pack-quantized one that transformers reads like ours."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import tiny_model_folder, write_text

from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import make_scheme
from lmfoundry.quantizers.awq import AWQQuantizer, clip_qparams, output_error, search_scales
from lmfoundry.quantizers.base import LayerCalibration
from lmfoundry.quantizers.observers import minmax_observer

NAMES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_folding_leaves_float_logits_unchanged(tmp_path, model_type):
    """Search + fold on every layer (GQA: 4 query heads over 2 KV heads, so v -> o uses repeated
    scales), no quantization: logits equal the original within fp32 rounding."""
    from lmfoundry.runtime.loader import load_model

    model, _ = load_model(tiny_model_folder(tmp_path / "m", model_type))
    ref_model = copy.deepcopy(model)
    ids = torch.randint(4, 250, (3, 40), generator=torch.Generator().manual_seed(0))
    scheme = make_scheme("w4a16", group_size=32)
    schemes = dict.fromkeys(NAMES, scheme)
    quantizer = AWQQuantizer()
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(torch.arange(ids.shape[1]).unsqueeze(0), x.dtype)
        for i, layer in enumerate(model.model.layers):
            before = {n: layer.get_submodule(n).weight.clone() for n in NAMES}
            calib = LayerCalibration([x], cos, sin)
            calib.run(layer, quantizer.calibration_hooks(layer, schemes, i))
            metrics = quantizer.smooth_layer(layer, schemes)
            assert len(metrics) == 4  # qkv, v->o, gate/up, up->down
            changed = [n for n in NAMES if not torch.equal(before[n], layer.get_submodule(n).weight)]
            assert len(changed) == len(NAMES), changed  # every linear was rescaled
            x = layer(x, cos, sin)
        ref = ref_model(ids)
        got = model(ids)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, err


def test_scale_search_beats_plain_rounding_on_outlier_channels():
    g = torch.Generator().manual_seed(0)
    cols = 128
    mags = torch.ones(cols)
    mags[torch.randperm(cols, generator=g)[:6]] = 30.0  # salient input channels
    x = torch.randn(4096, cols, generator=g) * mags
    h = 2 * x.t() @ x / x.shape[0]
    w = torch.randn(64, cols, generator=g)
    scheme = make_scheme("w4a16", group_size=32)
    base = output_error(w - qmath.fake_quantize(w, *minmax_observer(w, scheme.weights, torch.float32), scheme.weights), h)
    s, info = search_scales([w], [scheme.weights], h, x.abs().mean(0), torch.float32)
    wq = qmath.fake_quantize(w * s, *minmax_observer(w * s, scheme.weights, torch.float32), scheme.weights) / s
    err = output_error(w - wq, h)
    assert info["awq_alpha"] > 0 and float(err) < 0.8 * float(base), (float(err), float(base))
    assert info["awq_rel_gain"] == pytest.approx(1 - float(err) / float(base), rel=1e-4)


def test_clip_search_never_worse_than_observer():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 64, generator=g) @ torch.randn(64, 64, generator=g)
    h = 2 * x.t() @ x / x.shape[0]
    w = torch.randn(32, 64, generator=g)
    w[0, 3] = 12.0  # an outlier weight that stretches its group's range
    args = make_scheme("w4a16", group_size=16).weights
    s0, z0 = minmax_observer(w, args, torch.float32)
    s1, z1 = clip_qparams(w, args, h, torch.float32)
    e0 = output_error(w - qmath.fake_quantize(w, s0, z0, args), h)
    e1 = output_error(w - qmath.fake_quantize(w, s1, z1, args), h)
    assert float(e1) < float(e0)
    assert torch.all(s1 <= s0 + 1e-7)  # clipping only shrinks ranges


def test_awq_checkpoint_beats_rtn_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from lmfoundry.calibration.data import load_calibration
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.recipe import Recipe
    from lmfoundry.runtime.loader import load_model

    src = tiny_model_folder(tmp_path / "src")
    calib = write_text(tmp_path / "c.txt", 20000)
    evaltext = write_text(tmp_path / "e.txt", 4000, seed=7)
    float_model, tok = load_model(src)
    ids = load_calibration(str(evaltext), tok, 4, 48, 1).token_ids
    ref = float_model(ids)
    errs = {}
    for method in ("rtn", "awq"):
        rec = Recipe().with_overrides(method=method, group_size=32)
        rec = rec.with_overrides(source=str(calib), num_samples=16, seq_len=64)
        run_job(QuantizeJob(str(src), tmp_path / method, rec, progress=False, doctor=False))
        model, _ = load_model(tmp_path / method)
        ours = model(ids)
        errs[method] = float((ours - ref).norm() / ref.norm())
    assert errs["awq"] < 0.9 * errs["rtn"], errs
    manifest = json.loads((tmp_path / "awq" / "lmfoundry.json").read_text())
    assert "awq" in manifest["layers"]["model.layers.0"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "awq"), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_kv_statistics_weighted_by_received_attention():
    """With the option on, k/v get their own statistic (the attention-weighted one GPTQ uses,
    tested there) and q keeps the per-token one; by default q/k/v share one statistic."""
    from helpers import tiny_decoder_layer

    layer, cos, sin, config = tiny_decoder_layer()
    calib = LayerCalibration([torch.randn(2, 10, config.hidden_size)], cos, sin)
    names = dict.fromkeys(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
    on, off = AWQQuantizer({"kv_attention_weights": True}), AWQQuantizer()
    for q in (on, off):
        q.calib = calib
        calib.run(layer, hooks=q.calibration_hooks(layer, names, 0))
    assert on._stats["self_attn.k_proj"] is on._stats["self_attn.v_proj"] is not on._stats["self_attn.q_proj"]
    assert not torch.allclose(on._stats["self_attn.k_proj"].hessian(), on._stats["self_attn.q_proj"].hessian())
    assert off._stats["self_attn.q_proj"] is off._stats["self_attn.k_proj"]
    torch.testing.assert_close(off._stats["self_attn.q_proj"].hessian(), on._stats["self_attn.q_proj"].hessian())
