"""End-to-end quantize on tiny random models: checkpoint format, interop, manifest, atomicity."""

import json

import pytest
import torch
from helpers import tiny_model_folder, write_text
from transformers import AutoModelForCausalLM

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.errors import UserError
from lmfoundry.manifest import read_manifest, verify_files
from lmfoundry.recipe import Recipe
from lmfoundry.runtime.loader import load_model


def recipe(tmp_path, **q):
    rec = Recipe().with_overrides(**q)
    rec = rec.with_overrides(source=str(write_text(tmp_path / "calib.txt")), num_samples=4, seq_len=32)
    return rec


def logits_pair(folder):
    ours, tok = load_model(folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return ours(ids), hf(ids).logits.float(), ours, hf


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheme,kw", [("w4a16", {"group_size": 32}), ("w8a16", {"per_channel": True}),
                                        ("w4a16", {"group_size": 64, "symmetric": False})])
def test_quantize_loads_in_transformers(tmp_path, arch, scheme, kw):
    src = tiny_model_folder(tmp_path / "src", arch)
    out = tmp_path / "out"
    run_job(QuantizeJob(str(src), out, recipe(tmp_path, method="rtn", scheme=scheme, **kw), progress=False))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    if not kw.get("symmetric", True):
        # transformers 5.x registers the zero point unpacked and re-initializes the packed one it
        # finds (upstream: vllm-project/llm-compressor#1618, compressed-tensors#458); vLLM reads it.
        # So check the format against compressed-tensors' own decompressor instead.
        assert_decompresses_like_compressed_tensors(out, cfg)
        return
    ours, ref, model, hf = logits_pair(out)
    # the decompressed weights are exactly ours
    hf_sd = hf.state_dict()
    for name, p in model.state_dict().items():
        if name.endswith("proj.weight"):
            assert torch.equal(hf_sd[name], p), name
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5
    m = read_manifest(out)
    assert m["calibration"]["token_ids_sha256"] and m["recipe"]["quantize"]["scheme"] == scheme
    assert verify_files(out, m) == []
    assert len(m["layers"]) == 2 and all("weight_rel_error" in v for v in m["layers"]["model.layers.0"].values())


def assert_decompresses_like_compressed_tensors(folder, cfg):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    model, _ = load_model(folder)
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    tensors = {}
    for f in folder.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    checked = 0
    for name, module in model.named_modules():
        if f"{name}.weight_packed" in tensors:
            local = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
            dec = PackedQuantizationCompressor.decompress(local, scheme)
            assert torch.equal(dec["weight"], module.weight), name
            checked += 1
    assert checked == 14


def test_propagation_modes_and_layer_errors(tmp_path, monkeypatch):
    """A calibration-driven quantizer runs the activation passes; both propagation modes work."""
    import lmfoundry.quantizers.methods as methods
    from lmfoundry.quantizers.rtn import RTNQuantizer

    class DataRTN(RTNQuantizer):
        needs_calibration = True

    monkeypatch.setattr(methods, "get_quantizer", lambda method, options=None: DataRTN(options))
    src = tiny_model_folder(tmp_path / "src", "llama")
    outs = {}
    for mode in ("quantized", "float"):
        rec = recipe(tmp_path, method="rtn", scheme="w4a16", group_size=32)
        rec = rec.with_overrides(propagate=mode)
        run_job(QuantizeJob(str(src), tmp_path / mode, rec, progress=False))
        outs[mode] = read_manifest(tmp_path / mode)["layers"]
        assert read_manifest(tmp_path / mode)["calibration"]["used"] is True
    for mode, layers in outs.items():
        errs = [layers[f"model.layers.{i}"]["output_rel_error"] for i in range(2)]
        assert all(0 < e < 0.5 for e in errs), (mode, errs)
    # layer 0 sees the same inputs either way; layer 1 differs by what was propagated
    l0 = [outs[m]["model.layers.0"]["output_rel_error"] for m in ("quantized", "float")]
    l1 = [outs[m]["model.layers.1"]["output_rel_error"] for m in ("quantized", "float")]
    assert l0[0] == pytest.approx(l0[1]) and l1[0] != l1[1]


@pytest.mark.parametrize("propagate,expected", [("quantized", {"sequential": 2, "run": 0}),
                                                 ("float", {"sequential": 0, "run": 4})])
def test_gptq_runs_one_sequential_pass_per_layer(tmp_path, monkeypatch, propagate, expected):
    """GPTQ with quantized propagation costs one pass per layer (not a float + a quantized pass);
    float propagation still needs both (its next-layer inputs are the float outputs)."""
    from lmfoundry.quantizers.base import LayerCalibration

    calls = {"sequential": 0, "run": 0}
    run, run_sequential = LayerCalibration.run, LayerCalibration.run_sequential

    def counting(key, fn):
        def wrapper(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(LayerCalibration, "run", counting("run", run))
    monkeypatch.setattr(LayerCalibration, "run_sequential", counting("sequential", run_sequential))
    src = tiny_model_folder(tmp_path / "src", "llama")
    rec = recipe(tmp_path, method="gptq", scheme="w4a16", group_size=32)
    rec = rec.with_overrides(propagate=propagate)
    run_job(QuantizeJob(str(src), tmp_path / "out", rec, progress=False))
    assert calls == expected
    layers = read_manifest(tmp_path / "out")["layers"]
    assert all(layers[f"model.layers.{i}"]["self_attn.q_proj"]["gptq_loss"] > 0 for i in range(2))


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    src = tiny_model_folder(tmp_path / "src", "llama")
    import lmfoundry.calibration.pipeline as pipeline

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "load_layer", boom)
    with pytest.raises(KeyboardInterrupt):
        run_job(QuantizeJob(str(src), tmp_path / "out", recipe(tmp_path, method="rtn", scheme="w4a16", group_size=32),
                     progress=False))
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial*"))


def test_refuses_existing_output_and_quantized_input(tmp_path):
    src = tiny_model_folder(tmp_path / "src", "llama")
    rec = recipe(tmp_path, method="rtn", scheme="w4a16", group_size=32)
    run_job(QuantizeJob(str(src), tmp_path / "out", rec, progress=False))
    with pytest.raises(UserError, match="not empty"):
        run_job(QuantizeJob(str(src), tmp_path / "out", rec, progress=False))
    with pytest.raises(UserError, match="already quantized"):
        run_job(QuantizeJob(str(tmp_path / "out"), tmp_path / "out2", rec, progress=False))
