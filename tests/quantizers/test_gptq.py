"""GPTQ: error feedback beats RTN, the blocked implementation equals a plain reference of the
algorithm, act-order checkpoints load (and where transformers cannot follow, the test says so),
and degenerate Hessians never crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import correlated_inputs, tiny_decoder_layer, tiny_model_folder, write_text

from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.gptq import GPTQQuantizer, gptq_quantize
from lmfoundry.quantizers.hessian import HessianAccumulator, inverse_hessian
from lmfoundry.quantizers.rtn import rtn_quantize_weight


def out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((x @ (w - w_hat).t()).norm() / (x @ w.t()).norm())


@pytest.mark.parametrize("actorder", [None, "static", "dynamic"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,group", [(4, 32), (3, 64), (8, None)])
def test_gptq_beats_rtn_output_error(actorder, symmetric, bits, group):
    x = correlated_inputs(2048, 128)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    acc = HessianAccumulator()
    for chunk in x.split(500):
        acc.add(chunk)
    torch.testing.assert_close(acc.hessian(), 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    args = QuantArgs(bits, symmetric=symmetric, strategy="group" if group else "channel",
                     group_size=group, actorder=actorder)
    qw, warnings = gptq_quantize(w, acc.hessian(), args)
    assert warnings == []
    rtn = rtn_quantize_weight(w, args, torch.float32)
    e_gptq, e_rtn = out_err(x, w, qw.dequantize(torch.float32)), out_err(x, w, rtn.dequantize(torch.float32))
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)
    assert qw.q.dtype == torch.int8 and args.qmin <= qw.q.min() and qw.q.max() <= args.qmax
    assert (qw.g_idx is not None) == (actorder == "dynamic" and group is not None)
    assert qw.metrics["gptq_loss"] > 0


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scales_feed_back_the_stored_dequantization(scale_dtype):
    """With bf16/fp16 scales the error fed back is w - (q·s rounded to the scale dtype), what the
    checkpoint will hold: the loss equals that of a float32-scale run up to the scales' rounding,
    and the output error still beats RTN's."""
    x = correlated_inputs(2048, 128, seed=7)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(8))
    h = 2 * x.t() @ x / x.shape[0]
    args = QuantArgs(4, symmetric=False, strategy="group", group_size=32)
    qw, _ = gptq_quantize(w, h, args, scale_dtype=scale_dtype)
    ref, _ = gptq_quantize(w, h, args, scale_dtype=torch.float32)
    assert qw.scale.dtype == scale_dtype
    assert qw.metrics["gptq_loss"] == pytest.approx(ref.metrics["gptq_loss"], rel=0.05)
    rtn = rtn_quantize_weight(w, args, scale_dtype)
    assert out_err(x, w, qw.dequantize(torch.float32)) < 0.85 * out_err(x, w, rtn.dequantize(torch.float32))


# ------------------------------------------------------------------- a plain reference of GPTQ
def reference_gptq(w: torch.Tensor, h: torch.Tensor, args: QuantArgs, damp: float = 0.01):
    """Column-by-column OBQ/GPTQ in float64 with the explicit inverse Hessian, updated after
    each column by Gaussian elimination (eq. 3 of the paper) — no Cholesky, no blocks."""
    w, h = w.double().clone(), h.double().clone()
    rows, cols = w.shape
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diagonal(h), descending=True) if args.actorder else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    gs = args.group_size
    qmin, qmax = args.qmin, args.qmax

    def qparams(cols_w):
        lo = cols_w.min(1).values.clamp(max=0)
        hi = cols_w.max(1).values.clamp(min=0)
        if args.symmetric:
            s = torch.maximum(lo.abs(), hi) / ((qmax - qmin) / 2)
            return s.float().double(), torch.zeros_like(s)
        s = ((hi - lo) / (qmax - qmin)).float().double()
        return s, torch.clamp(torch.round(qmin - lo / s), qmin, qmax)

    codes = torch.zeros(rows, cols)
    scales, zps = {}, {}
    group_of = (perm // gs) if args.actorder == "static" else torch.arange(cols) // gs
    if args.actorder == "static":  # groups in the original order, ranges from the original weight
        for g in range(cols // gs):
            scales[g], zps[g] = qparams(w[:, group_of == g])
    loss = 0.0
    for j in range(cols):
        g = int(group_of[j])
        if args.actorder != "static" and j % gs == 0:
            scales[g], zps[g] = qparams(w[:, j:j + gs])
        q = torch.clamp(torch.round(w[:, j] / scales[g]) + zps[g], qmin, qmax)
        deq = (q - zps[g]) * scales[g]
        codes[:, j] = q
        d = hinv[j, j]
        err = (w[:, j] - deq) / d
        loss += float(((w[:, j] - deq) ** 2 / d).sum() / 2)  # the OBQ objective of column j
        w[:, j + 1:] -= torch.outer(err, hinv[j, j + 1:])
        w[:, j] = deq
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / d  # eliminate column j
    inv = torch.argsort(perm)
    g_idx = group_of[inv] if args.actorder == "dynamic" else None
    return codes[:, inv], torch.stack([scales[g] for g in range(cols // gs)], 1), loss, g_idx


@pytest.mark.parametrize("actorder", [None, "static", "dynamic"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("inner", [32, 2])  # 2: rank-1 updates in sub-blocks, matmul between them
def test_8x16_matches_reference(actorder, symmetric, inner, monkeypatch):
    import lmfoundry.quantizers.gptq as gptq

    monkeypatch.setattr(gptq, "INNER_BLOCK", inner)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 16, generator=g)
    x = torch.randn(64, 16, generator=g) @ torch.randn(16, 16, generator=g) * torch.linspace(0.2, 3, 16)
    x[:, 5] = 0.0  # a dead input column
    h = 2 * x.t() @ x / x.shape[0]
    args = QuantArgs(4, symmetric=symmetric, strategy="group", group_size=4, actorder=actorder)
    ref_codes, ref_scales, ref_loss, ref_gidx = reference_gptq(w, h, args)
    # block_size 4 exercises the lazy cross-block update
    qw, _ = gptq_quantize(w, h, args, block_size=4 if actorder != "static" else 128)
    if symmetric:
        # compressed-tensors' symmetric grid maps -absmax to exactly -7.5, a rounding tie that
        # float32 vs float64 can break either way (-7 or -8); a flip then propagates. Require
        # near-agreement only.
        assert (qw.q.float() == ref_codes).float().mean() > 0.75
        assert qw.metrics["gptq_loss"] == pytest.approx(ref_loss, rel=0.05)
    else:
        assert torch.equal(qw.q.float(), ref_codes), (qw.q, ref_codes)
        torch.testing.assert_close(qw.scale.double(), ref_scales, rtol=1e-5, atol=0)
        assert qw.metrics["gptq_loss"] == pytest.approx(ref_loss, rel=1e-4)
    if ref_gidx is None:
        assert qw.g_idx is None
    else:
        assert torch.equal(qw.g_idx.long(), ref_gidx)
    assert torch.all(qw.dequantize(torch.float32)[:, 5] == 0)  # dead input: weight zeroed, exactly representable


def test_static_block_start_qparams_with_small_blocks():
    """With act-order static and blocks smaller than the matrix, groups first touched in a later
    block take their range from the error-updated weights; still a large gain over RTN."""
    x = correlated_inputs(1024, 128, seed=4)
    w = torch.randn(32, 128)
    h = 2 * x.t() @ x / x.shape[0]
    args = QuantArgs(4, strategy="group", group_size=32, actorder="static")
    qw, _ = gptq_quantize(w, h, args, block_size=32)
    rtn = rtn_quantize_weight(w, args, torch.float32)
    assert out_err(x, w, qw.dequantize(torch.float32)) < 0.85 * out_err(x, w, rtn.dequantize(torch.float32))


# ------------------------------------------------------------------------- degenerate Hessians


def test_indefinite_hessian_retries_with_more_damping():
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(5)))
    eig = torch.ones(32)
    eig[0] = -0.05  # fails at 0.01 x mean diagonal, succeeds at 0.1 x
    h = q @ torch.diag(eig) @ q.t()
    hinv, warnings = inverse_hessian(h, None, 0.01, 3, "model.layers.7.q_proj")
    assert hinv is not None and hinv.damping_frac == pytest.approx(0.1)
    assert len(warnings) == 1 and "model.layers.7.q_proj" in warnings[0] and "retrying" in warnings[0]


def test_hopeless_hessian_falls_back_to_rtn():
    h = torch.full((16, 16), float("nan"))
    w = torch.randn(4, 16)
    args = QuantArgs(4, strategy="group", group_size=8)
    qw, warnings = gptq_quantize(w, h, args, name="lin")
    assert qw.metrics["rtn_fallback"] == 1.0 and any("RTN" in m for m in warnings)
    rtn = rtn_quantize_weight(w, args, torch.float32)
    assert torch.equal(qw.q, rtn.q)


def _quantize(src: Path, out: Path, calib: Path, **quant):
    from lmfoundry.calibration.job import QuantizeJob, run_job
    from lmfoundry.recipe import Recipe

    rec = Recipe().with_overrides(method="gptq", group_size=32, **quant)
    rec = rec.with_overrides(source=str(calib), num_samples=8, seq_len=64)
    run_job(QuantizeJob(str(src), out, rec, progress=False, doctor=False))
    return json.loads((out / "lmfoundry.json").read_text())


def test_repeated_token_calibration_does_not_crash(tmp_path):
    src = tiny_model_folder(tmp_path / "src")
    calib = tmp_path / "aaa.txt"
    calib.write_text("a" * 5000)
    manifest = _quantize(src, tmp_path / "out", calib)
    metrics = manifest["layers"]["model.layers.0"]["self_attn.q_proj"]
    assert "gptq_loss" in metrics or metrics.get("rtn_fallback") == 1.0
    # with almost no damping the rank-deficient Hessian cannot be factored: RTN, recorded
    manifest = _quantize(src, tmp_path / "out2", calib, options={"dampening_frac": 1e-12, "max_damp_retries": 0})
    fallbacks = [n for layer in manifest["layers"].values() for n, m in layer.items()
                 if isinstance(m, dict) and m.get("rtn_fallback") == 1.0]
    assert fallbacks, manifest["warnings"]
    assert any("fell back to RTN" in w for w in manifest["warnings"])


def test_hooks_share_one_hessian_per_input():
    from helpers import TINY_CONFIGS

    from lmfoundry.model.config import ModelConfig
    from lmfoundry.model.reference import DecoderLayer

    layer = DecoderLayer(ModelConfig.from_dict(TINY_CONFIGS["llama"]), 0)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    quantizer = GPTQQuantizer()
    hooks = quantizer.calibration_hooks(layer, dict.fromkeys(names), 0)
    assert sorted(hooks) == ["mlp.down_proj", "mlp.gate_proj", "self_attn.o_proj", "self_attn.q_proj"]
    h = quantizer._hessians
    assert h["self_attn.q_proj"] is h["self_attn.k_proj"] is h["self_attn.v_proj"]
    assert h["mlp.gate_proj"] is h["mlp.up_proj"] and h["mlp.down_proj"] is not h["mlp.up_proj"]


# ------------------------------------------------------------------- act-order checkpoints
def _reference_dense(qw) -> torch.Tensor:
    """(q - zp[g]) * s[g] column by column, with g from g_idx (or contiguous groups)."""
    cols = qw.q.shape[1]
    g_idx = qw.g_idx.long() if qw.g_idx is not None else torch.arange(cols) // qw.args.group_size
    out = torch.empty(qw.q.shape)
    for c in range(cols):
        zp = qw.zero_point[:, g_idx[c]].float() if qw.zero_point is not None else 0.0
        out[:, c] = (qw.q[:, c].float() - zp) * qw.scale[:, g_idx[c]].float()
    return out


def _our_logits_and_check_weights(out: Path, ids: torch.Tensor) -> torch.Tensor:
    from lmfoundry.checkpoint.folder import CheckpointReader, decode_linear
    from lmfoundry.runtime.loader import load_model

    model, _ = load_model(out)
    reader = CheckpointReader(out)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qw = decode_linear(reader.prefixed(name), reader.plan.scheme_for(name))
        torch.testing.assert_close(model.get_submodule(name).weight.float(), _reference_dense(qw), rtol=0, atol=0)
    return model(ids)


def test_actorder_static_checkpoint_matches_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_folder(tmp_path / "src")
    calib = write_text(tmp_path / "c.txt", 8000)
    out = tmp_path / "static"
    manifest = _quantize(src, out, calib, actorder="static")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _our_logits_and_check_weights(out, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not any("g_idx" in k for k in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert manifest["layers"]["model.layers.0"]["self_attn.q_proj"]["gptq_loss"] > 0


def test_actorder_dynamic_checkpoint_g_idx(tmp_path):
    """desc_act with weight_g_idx: our loader honours g_idx (weights equal the per-column reference
    dequantization). compressed-tensors 0.20 (used by transformers) removed actorder=group and
    ignores weight_g_idx; the checkpoint declares actorder=group so transformers refuses it
    loudly instead of computing wrong weights."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_folder(tmp_path / "src")
    calib = write_text(tmp_path / "c.txt", 8000)
    out = tmp_path / "dynamic"
    manifest = _quantize(src, out, calib, actorder="dynamic")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.weight_g_idx" in weight_map
    assert any("weight_g_idx" in w for w in manifest["warnings"])
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = _our_logits_and_check_weights(out, ids)
    assert torch.isfinite(ours).all()
    # the g_idx is not trivial (otherwise this test would prove nothing)
    from lmfoundry.checkpoint.folder import CheckpointReader

    g_idx = CheckpointReader(out).get(["model.layers.0.self_attn.q_proj.weight_g_idx"])
    g_idx = g_idx["model.layers.0.self_attn.q_proj.weight_g_idx"].long()
    assert not torch.equal(g_idx, torch.arange(g_idx.numel()) // 32)
    with pytest.raises(Exception, match="actorder"):
        AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)


# ------------------------------------------------------------------- attention-weighted K/V


def test_kv_hessian_weighted_by_received_attention():
    """With the layer's calibration known, k/v share an attention-weighted Hessian (q keeps the
    plain one); with the option off all three share one, as before."""
    from lmfoundry.quantizers.base import LayerCalibration
    from lmfoundry.quantizers.hessian import received_attention

    layer, cos, sin, config = tiny_decoder_layer(seed=1)
    x = torch.randn(2, 10, config.hidden_size)
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    q = GPTQQuantizer({"token_cap": 0})
    q.calib = LayerCalibration([x], cos, sin)
    hooks = q.calibration_hooks(layer, dict.fromkeys(names), 0)
    LayerCalibration([x], cos, sin).run(layer, hooks=hooks)
    h = q._hessians
    assert h["self_attn.k_proj"] is h["self_attn.v_proj"] is not h["self_attn.q_proj"]
    xn = layer.input_layernorm(x).reshape(-1, config.hidden_size).detach()
    w = received_attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
    torch.testing.assert_close(h["self_attn.q_proj"].hessian(), 2 * xn.t() @ xn / 20, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h["self_attn.k_proj"].hessian(), 2 * (xn * w[:, None]).t() @ xn / 20,
                               rtol=1e-4, atol=1e-5)
    off = GPTQQuantizer({"kv_attention_weights": "false"})
    off.calib = q.calib
    off.calibration_hooks(layer, dict.fromkeys(names), 0)
    assert off._hessians["self_attn.q_proj"] is off._hessians["self_attn.k_proj"]
