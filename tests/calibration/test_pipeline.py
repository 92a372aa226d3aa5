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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied and a tied head
@pytest.mark.parametrize("head,group", [("w8a16", None), ("w4a16", 32)])
def test_the_lm_head_is_quantized_apart_and_loads_in_transformers(tmp_path, arch, head, group):
    """`lm_head`: the head becomes a group of its own in quantization_config (the linears keep
    theirs); a tied head is written apart from the embedding, which stays float, and the config
    unties them; transformers and our loader read the same head, the RTN of the source's."""
    from lmfoundry.checkpoint.folder import CheckpointReader
    from lmfoundry.quantformat.scheme import make_scheme
    from lmfoundry.quantizers.rtn import rtn_quantize_weight

    src = tiny_model_folder(tmp_path / "src", arch)
    tied = json.loads((src / "config.json").read_text())["tie_word_embeddings"]
    out = tmp_path / "out"
    run_job(QuantizeJob(str(src), out, recipe(tmp_path, method="rtn", group_size=32, lm_head=head), progress=False))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False and "lm_head" not in qc["ignore"]
    groups = {tuple(g["targets"]): g["weights"] for g in qc["config_groups"].values()}
    assert groups[("Linear",)]["num_bits"] == 4 and groups[("Linear",)]["group_size"] == 32
    assert groups[("lm_head",)]["num_bits"] == int(head[1])
    assert groups[("lm_head",)]["strategy"] == ("channel" if group is None else "group")
    reader = CheckpointReader(out)
    assert reader.has("lm_head.weight_packed") and reader.has("model.embed_tokens.weight")

    ours, ref, model, hf = logits_pair(out)
    source = CheckpointReader(src)
    head_source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    want = rtn_quantize_weight(source.get([head_source])[head_source].float(),
                               make_scheme(head, group_size=group or 0).weights, torch.float32)
    assert torch.allclose(model.lm_head.weight.float(), want.dequantize(torch.float32), rtol=0, atol=1e-6)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    embed = source.get(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(hf.state_dict()["lm_head.weight"].float(), model.lm_head.weight.float())
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5
