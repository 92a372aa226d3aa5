"""Building bundles: SASS checks, reproducible cubins, repacked weights, CLI errors."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest
import torch

from lmfoundry.compile import sass
from lmfoundry.compile.aot import run_jobs
from lmfoundry.compile.bundle import build_engine
from lmfoundry.compile.kernel_selection import select_kernels
from lmfoundry.compile.source import load_checkpoint
from lmfoundry.kernels import tiled_layout


def test_w8a8_for_ampere(make_checkpoint, tmp_path):
    ckpt = make_checkpoint(scheme="w8a8", weights=False)
    result = build_engine(ckpt, ["ampere"], tmp_path / "engine", progress=False)
    kernels = result.kernels
    assert {k["sm"] for k in kernels} == {"sm_80"}
    gemm = [k for k in kernels if k["kernel"] == "w8a8_gemm"]
    assert gemm and all("IMMA" in k["sass"]["mma"] for k in gemm)
    prefill = next(k for k in kernels if k["kernel"] == "paged_prefill")
    assert "HMMA" in prefill["sass"]["mma"]
    decode = next(k for k in kernels if k["kernel"] == "paged_decode_split")
    assert "HMMA" in decode["sass"]["mma"] and decode["sass"]["expected_any_of"] == ["HMMA"]
    assert_spill_free(kernels)
    fused = [f["name"] for f in result.manifest["fusions"] if f["applied"]]
    assert "input_layernorm+qkv_proj.input_quant" in fused and "self_attn.qkv_proj" in fused
    # Each covered GEMM shape appears in the manifest.
    shapes = {(c["shape"]["N"], c["shape"]["K"]) for k in gemm for c in k["covers"]}
    assert shapes == {(256, 128), (128, 128), (512, 128), (128, 256)}
    assert json.loads((tmp_path / "engine" / "engine.json").read_text())["kernels"] == kernels


def assert_spill_free(kernels: list[dict]) -> None:
    """Every kernel's registers as cuobjdump reports them, and no local memory (register spills) at
    the tile tables' configs: a spilling tile is correct but several times slower on the GPU."""
    for k in kernels:
        use = k["sass"]
        assert 0 < use["registers"] <= 255, (k["key"], use)
        assert use["local_bytes"] == 0 and use["stack_bytes"] == 0, (k["key"], k["config"], use)


def _job(out_dir, key="repro"):
    return {"id": 0, "key": key, "capability": 80, "sm": "sm_80", "kernel": "silu_mul", "types": {"act": "bf16"},
            "semantics": {}, "config": {"constexprs": {"BLOCK": 256}, "num_warps": 4, "num_stages": 1},
            "aligned": ["INTER"], "out_dir": str(out_dir)}


def test_cubins_are_byte_reproducible(tmp_path):
    """Two builds in different folders and fresh Triton caches give identical files."""
    outs = []
    for i in range(2):
        reply, = run_jobs([_job(tmp_path / f"out{i}")], 1, tmp_path / f"cache{i}", tmp_path / "log")
        assert reply["ok"], reply
        outs.append({ext: (tmp_path / f"out{i}" / f"repro.{ext}").read_bytes() for ext in ("cubin", "ptx", "json")})
    assert outs[0] == outs[1]
    assert str(tmp_path).encode() not in outs[0]["json"] + outs[0]["ptx"]


def test_bundles_are_byte_reproducible_across_processes(make_checkpoint, tmp_path):
    """Two `compile` runs of the same checkpoint, each in a process of its own, write the same bytes
    in every kernel and weights file (the repacked weights' safetensors header included: its
    metadata once came out in a per-process hash order)."""
    import subprocess
    import sys

    ckpt = make_checkpoint(scheme="w8a8")
    bundles = []
    for i in range(2):
        out = tmp_path / f"engine{i}"
        subprocess.run([sys.executable, "-m", "lmfoundry.cli", "compile", str(ckpt), "--arch", "hopper", "-o", str(out),
                        "--quiet"], check=True, capture_output=True)
        bundles.append({p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
                        if p.is_file() and p.name != "engine.json"})
    assert bundles[0].keys() == bundles[1].keys() and "weights/model.safetensors" in bundles[0]
    assert [k for k in bundles[0] if bundles[0][k] != bundles[1][k]] == []


def test_resource_usage_reports_spills(tmp_path):
    """An INT8 GEMM tile of 128 x 256 int32 accumulators on one warp cannot live in registers:
    cuobjdump's count must show the spill (so `assert_spill_free` on the bundles can fail); the
    table's 64 x 64 tile on 4 warps does not spill."""
    def job(i, key, warps, bm, bn):
        return {"id": i, "key": key, "capability": 80, "sm": "sm_80", "kernel": "w8a8_gemm",
                "types": {"a": "i8", "bscale": "bf16", "out": "bf16", "acc": "i32"},
                "semantics": {"A_PER_TOKEN": True, "B_PER_CHANNEL": True, "HAS_BIAS": False, "ACC_INT": True},
                "config": {"constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP_AB": 0},
                           "num_warps": warps, "num_stages": 2},
                "aligned": ["K", "N", "stride_am", "stride_bn", "stride_om"], "out_dir": str(tmp_path / "out")}

    spill, fits = run_jobs([job(0, "spill", 1, 128, 256), job(1, "fits", 4, 64, 64)], 1, tmp_path / "cache", tmp_path / "log")
    assert spill["ok"] and fits["ok"], (spill, fits)
    assert spill["resources"]["stack_bytes"] + spill["resources"]["local_bytes"] > 1024, spill["resources"]
    assert fits["resources"]["stack_bytes"] == fits["resources"]["local_bytes"] == 0 < fits["resources"]["registers"]


def test_a_failing_job_is_reported(tmp_path):
    job = _job(tmp_path / "out")
    job["types"] = {"act": "fp8e4nv"}  # Triton refuses e4m3 on sm_80
    reply, = run_jobs([job], 1, tmp_path / "cache", tmp_path / "log")
    assert not reply["ok"] and "fp8e4nv" in reply["error"]


def test_sass_check_demands_wgmma_on_hopper():
    sass.check("w4a16_gemm", "sm_90a", ("HGMMA",), ["HGMMA", "HMMA"])
    with pytest.raises(sass.BuildCheckError, match="no wgmma"):
        sass.check("w4a16_gemm", "sm_90a", ("HGMMA",), ["HMMA"])
    with pytest.raises(sass.BuildCheckError, match="no MMA at all"):
        sass.check("w8a8_gemm", "sm_80", ("IMMA",), [])
    assert sass.mma_opcodes("  HFMA2.MMA R1 ;\n HGMMA.64x64x16.F32.BF16 gdesc ;") == ["HGMMA"]


def _tiled(d, name):
    return tiled_layout.TiledLinear.from_tensors({k[len(name) + 1:]: v for k, v in d.items() if k.startswith(name + ".")})


def test_repacked_weights_concatenate_the_fused_members(make_checkpoint, tmp_path):
    """The bundle holds the tiled layout of each fused GEMM; unrepacking it gives back exactly the
    members' compressed-tensors tensors, concatenated."""
    from safetensors.torch import load_file

    from lmfoundry.compile.repack import repack
    from lmfoundry.engine_bundle.weight_layout import fuse_members

    ckpt = make_checkpoint(scheme="w4a16", group=32, symmetric=False)
    ck = load_checkpoint(ckpt)
    build = select_kernels(ck, [90])
    fused = repack(ck, build, tmp_path / "model.safetensors")
    assert fused["model.layers.1.self_attn.qkv_proj"] == [f"model.layers.1.self_attn.{m}_proj" for m in "qkv"]
    t, src = load_file(tmp_path / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert not any(".q_proj." in n or ".gate_proj." in n or n.endswith(".weight_packed") for n in t)
    pre = "model.layers.0.self_attn."
    members = [pre + f"{m}_proj" for m in "qkv"]
    expect, _ = fuse_members(members, [128, 64, 64], src.__getitem__, src.__contains__)
    back = tiled_layout.unrepack_tiled(_tiled(t, pre + "qkv_proj"))
    assert back.out_features == 256 and back.in_features == 128
    for key in ("weight_packed", "weight_scale", "weight_zero_point"):
        assert torch.equal(getattr(back, key), expect[key]), key
    down = tiled_layout.unrepack_tiled(_tiled(t, "model.layers.1.mlp.down_proj"))
    assert torch.equal(down.weight_packed, src["model.layers.1.mlp.down_proj.weight_packed"])


def test_act_order_is_folded_into_gate_up(make_checkpoint, tmp_path):
    """Act-order (g_idx) checkpoints: every GEMM gets a K permutation that makes groups contiguous;
    down_proj's is applied to the rows of gate/up (its input then arrives permuted), and the
    tiled tensors still unrepack to the checkpoint's exactly, g_idx included."""
    from safetensors.torch import load_file

    from lmfoundry.compile.repack import repack
    from lmfoundry.engine_bundle.weight_layout import ACT_ORDER_FOLD

    ckpt = make_checkpoint(scheme="w4a16", group=32, actorder=True)
    ck = load_checkpoint(ckpt)
    build = select_kernels(ck, [90])
    fold = next(f for f in build.fusions if f.name == ACT_ORDER_FOLD)
    assert fold.applied and fold.members == ["mlp.gate_up_proj", "mlp.down_proj"]
    repack(ck, build, tmp_path / "model.safetensors")
    t, src = load_file(tmp_path / "model.safetensors"), load_file(ckpt / "model.safetensors")
    pre = "model.layers.1.mlp."
    down, gate_up = _tiled(t, pre + "down_proj"), _tiled(t, pre + "gate_up_proj")
    perm = tiled_layout.act_order_perm(src[pre + "down_proj.weight_g_idx"], 32)
    assert down.input_permuted and torch.equal(down.perm, perm)
    assert torch.equal(gate_up.out_perm, torch.cat([perm, perm + 256]))
    qkv = _tiled(t, "model.layers.1.self_attn.qkv_proj")
    assert qkv.perm is not None and not qkv.input_permuted and qkv.out_perm is None
    back = tiled_layout.unrepack_tiled(down)
    for key, name in (("weight_packed", "weight_packed"), ("weight_scale", "weight_scale"), ("weight_g_idx", "weight_g_idx")):
        assert torch.equal(getattr(back, key), src[pre + "down_proj." + name]), key
    back = tiled_layout.unrepack_tiled(gate_up)
    assert torch.equal(back.weight_packed, torch.cat([src[pre + "gate_proj.weight_packed"], src[pre + "up_proj.weight_packed"]]))
    assert torch.equal(back.weight_g_idx, src[pre + "gate_proj.weight_g_idx"])


def _cli(args, capsys):
    from lmfoundry.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


def test_cli_user_errors_are_one_line(make_checkpoint, tmp_path, capsys):
    code, err = _cli(["compile", str(tmp_path / "nope"), "--arch", "hopper"], capsys)
    assert code == 2 and err.count("\n") == 0 and "no such checkpoint" in err
    ckpt = make_checkpoint(weights=False)
    code, err = _cli(["compile", str(ckpt), "--arch", "volta"], capsys)
    assert code == 2 and err.count("\n") == 0 and "unknown arch 'volta'" in err
    fp8 = make_checkpoint(scheme="fp8", weights=False)
    code, err = _cli(["compile", str(fp8), "--arch", "hopper", "--arch", "ampere"], capsys)
    assert code == 2 and err.count("\n") == 0 and "FP8 needs sm_89" in err
    code, err = _cli(["compile", str(ckpt), "--arch", "hopper", "--tune"], capsys)
    if not torch.cuda.is_available():
        assert code == 2 and "--tune needs a CUDA GPU" in err


def smollm2_config(path):
    """SmolLM2-135M's shapes with a W4A16 g64 symmetric quantization_config (config only)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "num_hidden_layers": 30, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}}},
        },
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.slow
def test_default_model_hopper_and_ampere(tmp_path):
    """The "Done when" build: SmolLM2-135M W4A16 g64 for hopper + ampere; ≤ 60 s of 2-core work."""
    ckpt = smollm2_config(tmp_path / "smollm2")
    self0, child0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    result = build_engine(ckpt, ["hopper", "ampere"], tmp_path / "engine", progress=False)
    wall = time.perf_counter() - t0
    self1, child1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (self1.ru_utime + self1.ru_stime - self0.ru_utime - self0.ru_stime
           + child1.ru_utime + child1.ru_stime - child0.ru_utime - child0.ru_stime)
    print(f"\nSmolLM2 hopper+ampere: {len(result.kernels)} kernels, wall {wall:.1f} s, CPU {cpu:.1f} s, "
          f"load {os.getloadavg()[0]:.1f}")
    assert {k["sm"] for k in result.kernels} == {"sm_80", "sm_90a"}
    for k in result.kernels:
        if k["kernel"] == "w4a16_tiled":
            assert ("HGMMA" if k["sm"] == "sm_90a" else "HMMA") in k["sass"]["mma"]
    assert any(k["kernel"] == "w4a16_tiled" and k["config"]["constexprs"]["SPLIT_K"] > 1 for k in result.kernels)
    assert_spill_free(result.kernels)
    assert cpu / 2 <= 60, f"{cpu:.1f} CPU s is more than 60 s on 2 cores"


@pytest.mark.slow
def test_fp8_for_ada_and_hopper(make_checkpoint, tmp_path):
    ckpt = make_checkpoint(scheme="fp8", kv_cache="fp8", weights=False)
    result = build_engine(ckpt, ["ada", "hopper"], tmp_path / "engine", progress=False)
    gemms = {k["sm"]: k["sass"]["mma"] for k in result.kernels if k["kernel"] == "fp8_gemm"}
    assert "QMMA" in gemms["sm_89"] and "QGMMA" in gemms["sm_90a"]
    kv = {k["types"]["kv"] for k in result.kernels if k["kernel"] == "paged_prefill"}
    assert kv == {"fp8e4nv"}
    decode = {k["sm"]: k["sass"]["mma"] for k in result.kernels if k["kernel"] == "paged_decode_split"}
    assert set(decode) == {"sm_89", "sm_90a"} and all("HMMA" in m for m in decode.values())  # fp8 KV -> bf16 MMAs
    assert_spill_free(result.kernels)
