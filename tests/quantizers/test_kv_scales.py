"""KV-cache quantization: storage error within the bound its scale implies, attention over a
quantized cache within the bound that error implies, calibrated scales in compressed-tensors
layout, and the loader's refusal of a declared KV scheme without scales.

Per element, with scale s (absmax / qmax, so nothing clips):
  int8: |k^ - k| <= s / 2
  fp8 e4m3 (3 mantissa bits): |k^ - k| <= max(|k| 2^-4, s 2^-10)   (normal / subnormal range)
plus fp32 roundoff. A score q.k/sqrt(D) then moves by at most d = sum_d |q_d| e_k,d / sqrt(D);
softmax weights move by a factor within [e^-2d, e^2d], so sum |p' - p| <= e^(2d) - 1, and each
output element moves by at most (e^(2d) - 1) max|v^| + max e_v.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_model_folder, write_text
from safetensors.torch import load_file, save_file

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.errors import UserError
from lmfoundry.model.attention_math import causal_attention
from lmfoundry.model.kv_quant import kv_round_trip_from_checkpoint, kv_scales_from_absmax
from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.base import LayerCalibration
from lmfoundry.quantizers.kv_scales import calibrate_kv_scales
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model

U = 2.0**-24


def kv_args(kind: str, strategy: str) -> QuantArgs:
    return QuantArgs(8, "float" if kind == "fp8" else "int", True, strategy, None)


def element_bound(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    s = s.expand(x.shape[-2], 1)
    if kind == "int8":
        b = (s / 2).expand_as(x)
    else:
        b = torch.maximum(x.abs() * 2.0**-4, (s * 2.0**-10).expand_as(x))
    return b + 4 * U * (x.abs() + s)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_attention_over_quantized_cache_within_bound(kind, strategy):
    torch.manual_seed(0)
    b, t, hq, hkv, d = 2, 24, 4, 2, 16
    q = torch.randn(b, t, hq, d)
    head_gain = torch.tensor([1.0, 6.0]).reshape(1, 1, hkv, 1)  # heads with different ranges
    k = torch.randn(b, t, hkv, d) * head_gain
    v = torch.randn(b, t, hkv, d) * head_gain
    per_head = strategy == "attn_head"
    reduce = (lambda x: x.abs().amax(dim=(0, 1, 3))) if per_head else (lambda x: x.abs().amax().reshape(1))
    args = kv_args(kind, strategy)
    k_scale = kv_scales_from_absmax(reduce(k), args.type, torch.float32, per_head)
    v_scale = kv_scales_from_absmax(reduce(v), args.type, torch.float32, per_head)
    assert k_scale.shape == ((hkv, 1, 1) if per_head else (1,))
    rt = kv_round_trip_from_checkpoint(args, k_scale, v_scale)
    k_hat, v_hat = rt(k, v)
    ek, ev = element_bound(k, k_scale, kind), element_bound(v, v_scale, kind)
    assert ((k_hat - k).abs() <= ek).all() and ((v_hat - v).abs() <= ev).all()
    assert (k_hat != k).any()  # it really quantized

    out = torch.full((b, t, hq, d), float("nan"))
    out.copy_(causal_attention(q, k_hat, v_hat))
    ref = causal_attention(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all()
    group = hq // hkv
    for h in range(hq):
        g = h // group
        # delta[b, i] = max over visible keys j <= i of sum_d |q| e_k / sqrt(D)
        contrib = torch.einsum("bid,bjd->bij", q[:, :, h].abs().double(), ek[:, :, g].double()) / math.sqrt(d)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        delta = contrib.masked_fill(~mask, 0).amax(dim=-1)  # [b, t]
        vmax = v_hat[:, :, g].abs().double().amax(dim=1, keepdim=True)  # [b, 1, d]
        evmax = ev[:, :, g].double().amax(dim=1, keepdim=True)
        bound = torch.expm1(2 * delta)[..., None] * vmax + evmax + 1e-5 * ref[:, :, h].abs() + 1e-6
        assert ((out[:, :, h].double() - ref[:, :, h]).abs() <= bound).all()


def test_scale_rounding_never_clips():
    absmax = torch.tensor([3.0001, 0.0, 1e-3])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        s = kv_scales_from_absmax(absmax, "int", dtype, per_head=True)
        assert s.dtype == dtype and s.shape == (3, 1, 1)
        assert (s.float().flatten() * 127 >= absmax).all() and (s > 0).all()


def test_calibrated_scales_are_absmax_of_post_rotary_kv(tmp_path):
    model, _ = load_model(tiny_model_folder(tmp_path / "m"))
    layer = model.model.layers[0]
    ids = torch.randint(4, 250, (3, 20), generator=torch.Generator().manual_seed(1))
    x = model.model.embed_tokens(ids).detach()
    cos, sin = model.model.rotary_emb(torch.arange(20)[None], x.dtype)
    calib = LayerCalibration([x[:2], x[2:]], cos, sin)
    with torch.no_grad():
        _, k, v = layer.self_attn.project_qkv(layer.input_layernorm(x), cos, sin)
    for kind, qmax in (("int8", 127.0), ("fp8", 448.0)):
        ks, vs = calibrate_kv_scales(layer, calib, kv_args(kind, "attn_head"), torch.float32)
        assert torch.allclose(ks.flatten(), k.abs().amax(dim=(0, 1, 3)) / qmax)
        assert torch.allclose(vs.flatten(), v.abs().amax(dim=(0, 1, 3)) / qmax)
        ks, _ = calibrate_kv_scales(layer, calib, kv_args(kind, "tensor"), torch.float32)
        assert ks.shape == (1,) and torch.allclose(ks, k.abs().max() / qmax)
    assert layer.self_attn.kv_round_trip is None  # the observer was removed


def quantize_with_kv(tmp_path, kv: str, strategy: str = "tensor"):
    folder = tiny_model_folder(tmp_path / "float")
    rec = Recipe().with_overrides(method="rtn", scheme="w8a16", per_channel=True, kv_cache=kv, kv_strategy=strategy)
    rec = rec.with_overrides(source=str(write_text(tmp_path / "c.txt")), num_samples=4, seq_len=32, batch_size=2)
    out = tmp_path / f"kv-{kv}-{strategy}"
    run_job(QuantizeJob(str(folder), out, rec, progress=False))
    return folder, out


@pytest.mark.parametrize("kv,strategy", [("int8", "tensor"), ("fp8", "attn_head")])
def test_pipeline_writes_kv_scales_and_runtime_uses_them(tmp_path, kv, strategy):
    folder, out = quantize_with_kv(tmp_path, kv, strategy)
    reader = CheckpointReader(out)
    kvs = reader.config["quantization_config"]["kv_cache_scheme"]
    assert kvs["type"] == ("float" if kv == "fp8" else "int") and kvs["strategy"] == strategy
    shape = (2, 1, 1) if strategy == "attn_head" else (1,)
    for i in range(2):
        t = reader.prefixed(f"model.layers.{i}.self_attn")
        assert t["k_scale"].shape == shape and t["v_scale"].shape == shape
        assert (t["k_scale"] > 0).all() and (t["v_scale"] > 0).all()
    model, _ = load_model(out)
    rt = model.model.layers[1].self_attn.kv_round_trip
    assert rt is not None and torch.equal(rt.k_scale, reader.prefixed("model.layers.1.self_attn")["k_scale"].float())
    ids = torch.randint(4, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    ref, _ = load_model(folder)
    with torch.no_grad():
        y, y0 = model(ids), ref(ids)
        for layer in model.model.layers:
            layer.self_attn.kv_round_trip = None
        y_nokv = model(ids)
    assert not torch.equal(y, y_nokv)  # the cache round trip is applied
    assert float((y - y0).norm() / y0.norm()) < 0.1


def drop_tensor(folder, name):
    reader = CheckpointReader(folder)
    path = reader.index[name]
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_loader_refuses_declared_kv_scheme_without_scales(tmp_path):
    _, out = quantize_with_kv(tmp_path, "fp8")
    drop_tensor(out, "model.layers.1.self_attn.v_scale")
    with pytest.raises(UserError, match="v_scale is missing"):
        load_model(out)


def test_invalid_kv_schemes_refused():
    with pytest.raises(UserError, match="int8 and fp8"):
        kv_round_trip_from_checkpoint(QuantArgs(4, "int", True, "tensor", None), torch.ones(1), torch.ones(1))
    with pytest.raises(UserError, match="symmetric"):
        kv_round_trip_from_checkpoint(QuantArgs(8, "int", False, "tensor", None), torch.ones(1), torch.ones(1))
    with pytest.raises(UserError, match="positive"):
        kv_round_trip_from_checkpoint(kv_args("fp8", "tensor"), torch.zeros(1), torch.ones(1))
