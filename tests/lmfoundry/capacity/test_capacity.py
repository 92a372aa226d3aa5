"""`lmfoundry plan`: every number checked against hand arithmetic on Llama-3-8B/70B-shaped configs.

The configs are written to tmp folders from their published shape values (no weights needed). The
expected values are spelled out as products of those shape values, with the totals written as
literals so a change in any convention shows up as a failing test rather than a moved reference.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from lmfoundry.capacity.arithmetic import (
    CapacityEstimate,
    QuantSpec,
    default_quant_specs,
    kv_bytes_per_token,
    sharding,
    weight_bytes,
)
from lmfoundry.capacity.inputs import CapacityInputs, checkpoint_quant, load_bench
from lmfoundry.capacity.report import build_report, render
from lmfoundry.cli import main
from lmfoundry.errors import UserError
from lmfoundry.gpus import load_gpus
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.params import param_counts

LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
SMOLLM2 = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
GIB = 1 << 30
H100_BYTES = 81559 * (1 << 20)


def write_model(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture
def llama8b(tmp_path):
    return write_model(tmp_path / "llama3-8b", LLAMA3_8B)


@pytest.fixture
def llama70b(tmp_path):
    return write_model(tmp_path / "llama3-70b", LLAMA3_70B)


def run_cli(args, capsys):
    """Run `lmfoundry plan ARGS` through the real entry point; (exit code, stdout, stderr)."""
    code = 0
    try:
        main(["plan", *[str(a) for a in args]])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- hand arithmetic


def test_llama3_8b_parameter_count_by_part():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    counts = param_counts(cfg)
    assert counts["embeddings"] == 128256 * 4096 == 525_336_576
    # q, o: 4096x4096; k, v: (8 heads x 128) x 4096, per layer, 32 layers
    assert counts["attention"] == 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096) == 1_342_177_280
    assert counts["mlp"] == 32 * 3 * 4096 * 14336 == 5_637_144_576
    assert counts["norms"] == 2 * 4096 * 32 + 4096 == 266_240
    assert counts["lm_head"] == 525_336_576
    assert counts["total"] == 8_030_261_248  # the published "8.03B"


def test_llama3_8b_weight_bytes_per_precision():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    specs = default_quant_specs()
    sixteen_bit_rest = 2 * 525_336_576 * 2 + 266_240 * 2  # embeddings + lm_head + norms, 2 B each
    linear_params_per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336  # 218,103,808
    out_rows_per_layer = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096  # 43,008 scales per channel

    assert weight_bytes(cfg, specs["bf16"])["total"] == 8_030_261_248 * 2
    # int4 g128 symmetric: half a byte per weight + one 16-bit scale per 128 weights
    int4_layer = linear_params_per_layer // 2 + linear_params_per_layer // 128 * 2
    assert int4_layer == 112_459_776
    assert weight_bytes(cfg, specs["int4"])["total"] == 32 * int4_layer + sixteen_bit_rest == 5_700_591_616
    # asymmetric: plus a 4-bit zero point per scale
    asym = default_quant_specs(asymmetric=True)["int4"]
    zp_layer = linear_params_per_layer // 128 // 2
    assert weight_bytes(cfg, asym)["total"] == 5_700_591_616 + 32 * zp_layer == 5_727_854_592
    # int8 / fp8 per-channel: one byte per weight + a 16-bit scale per output row
    per_channel = 32 * (linear_params_per_layer + 2 * out_rows_per_layer) + sixteen_bit_rest
    assert per_channel == 9_083_953_152
    assert weight_bytes(cfg, specs["int8"])["total"] == per_channel
    assert weight_bytes(cfg, specs["fp8"])["total"] == per_channel
    # --group-size 64 on int8: one scale per 64 weights
    int8_g64 = default_quant_specs(group_size=64)["int8"]
    expected = 32 * (linear_params_per_layer + linear_params_per_layer // 64 * 2) + sixteen_bit_rest
    assert weight_bytes(cfg, int8_g64)["total"] == expected


def test_llama3_8b_kv_bytes_per_token():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    assert kv_bytes_per_token(cfg, "bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(cfg, "fp8") == 64 * 1024
    assert kv_bytes_per_token(cfg, "int8") == 64 * 1024
    assert kv_bytes_per_token(cfg, "bf16") * 8192 == GIB  # 1 GiB per 8k-token sequence
    # tp 4: 2 KV heads per GPU; tp 16 > 8 KV heads: one (replicated) head per GPU
    assert kv_bytes_per_token(cfg, "bf16", tp=4) == 2 * 32 * 2 * 128 * 2
    assert sharding(cfg, 16).kv_replication == 2
    assert kv_bytes_per_token(cfg, "bf16", tp=16) == 2 * 32 * 1 * 128 * 2
    assert kv_bytes_per_token(cfg, "bf16", tp=32) == 2 * 32 * 1 * 128 * 2


def test_llama3_70b_weights_about_140_gb_and_tensor_parallel_split():
    cfg = ModelConfig.from_dict(LLAMA3_70B)
    counts = param_counts(cfg)
    assert counts["attention"] == 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192)
    assert counts["mlp"] == 80 * 3 * 8192 * 28672
    assert counts["total"] == 70_553_706_496
    bf16 = weight_bytes(cfg, default_quant_specs()["bf16"])
    assert bf16["total"] == 141_107_412_992
    assert bf16["total"] / 1e9 == pytest.approx(140, rel=0.01)
    assert kv_bytes_per_token(cfg, "bf16") == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    # tp 4: everything but the (replicated) norms splits four ways
    norms = (2 * 8192 * 80 + 8192) * 2
    per_gpu = weight_bytes(cfg, default_quant_specs()["bf16"], tp=4)
    assert per_gpu["norms"] == norms
    assert per_gpu["total"] == (141_107_412_992 - norms) // 4 + norms == 35_278_831_616


def test_param_counts_match_transformers_modules():
    """Our counting rules (tied embeddings, q/k/v bias, q/k norm) against real HF modules."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shapes = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    cases = [
        ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
        ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
        ("qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
        ("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=48, tie_word_embeddings=False)),
    ]
    for model_type, config_cls, model_cls, extra in cases:
        hf_cfg = config_cls(**shapes, **extra)
        with torch.device("meta"):
            model = model_cls(hf_cfg)
        expected = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
        ours = ModelConfig.from_dict({"model_type": model_type, **shapes, **extra})
        assert param_counts(ours)["total"] == expected, (model_type, extra)


def test_quant_spec_layouts_by_hand():
    w = QuantSpec("int4", 4, "group", group_size=128)
    assert w.linear_bytes(256, 512) == 256 * 512 // 2 + 256 * 4 * 2
    # a ragged last group still needs its own scale
    assert QuantSpec("int4", 4, "group", group_size=128).num_scales(10, 576) == 10 * 5
    g = QuantSpec("int4", 4, "group", group_size=128, zero_points=True, g_idx=True)
    assert g.linear_bytes(256, 512) == 256 * 512 // 2 + 1024 * 2 + 1024 // 2 + 512 * 4
    b = QuantSpec("fp8", 8, "block", block=(128, 128))
    assert b.linear_bytes(300, 256) == 300 * 256 + 3 * 2 * 2
    assert QuantSpec("fp8", 8, "tensor").linear_bytes(64, 64) == 64 * 64 + 2


def test_memory_fit_on_h100_by_hand(llama8b):
    report = build_report(CapacityInputs(model=str(llama8b), gpu="h100-80gb", context=8192))
    sel = report["selected"]
    weights = 8_030_261_248 * 2
    # peak activations: 8192 tokens x (2 hidden + gate/up + product) x 2 B, plus fp32 logits of 256 rows
    acts = 8192 * (2 * 4096 + 3 * 14336) * 2 + 256 * 128256 * 4
    assert sel["activation_bytes"] == acts
    usable = int(H100_BYTES * 0.9)
    room = usable - weights - acts - GIB
    assert sel["kv_room_bytes"] == room
    assert sel["kv_bytes_per_sequence"] == GIB
    assert sel["max_sequences"] == room // GIB == 54
    assert sel["kv_tokens"] == room // (128 * 1024)
    # the table covers 4 weight precisions x 3 KV dtypes, and fp8 KV doubles the sequences
    assert len(report["table"]) == 12
    row = next(r for r in report["table"] if (r["weights"], r["kv"]) == ("bf16", "fp8"))
    assert row["max_sequences"] == room // (GIB // 2)


def test_70b_does_not_fit_one_h100_and_suggests_tp(llama70b):
    report = build_report(CapacityInputs(model=str(llama70b), gpu="h100"))
    assert report["selected"]["max_sequences"] == 0
    assert any("--tp 2" in n for n in report["notes"])
    report = build_report(CapacityInputs(model=str(llama70b), gpu="h100", tp=4, kv="fp8"))
    sel = report["selected"]
    assert sel["weight_bytes"] == 35_278_831_616
    assert sel["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 1
    assert sel["max_sequences"] == sel["kv_room_bytes"] // (2 * 80 * 2 * 128 * 8192)


# ----------------------------------------------------------------------------- cost


def test_cost_per_million_and_breakeven_by_hand():
    plan = CapacityEstimate(throughput=1000.0, gpu_hour_price=2.0, gpus=1, api_price=1.0)
    # $2/h over 3.6 M tokens/h
    assert plan.cost_per_million(1.0) == pytest.approx(2.0 / 3.6)
    assert plan.cost_per_million(0.2) == pytest.approx(2.0 / (3.6 * 0.2))
    assert plan.monthly == pytest.approx(2.0 * 730)
    assert plan.breakeven_tokens_per_month == pytest.approx(1460 / 1.0 * 1e6)
    assert plan.breakeven_utilization == pytest.approx(1.46e9 / (1000 * 3600 * 730))
    assert plan.advice().startswith("Self-host") and "1.46 B" in plan.advice()
    # API cheaper than a fully busy GPU
    assert CapacityEstimate(1000.0, 2.0, 1, 0.5).advice().startswith("Use the API: even 100% busy")
    # break-even needs > 80 % utilization
    assert "unless you can keep" in CapacityEstimate(1000.0, 2.0, 1, 0.65).advice()
    # tp GPUs are all paid for
    assert CapacityEstimate(1000.0, 2.0, 4, 1.0).cost_per_million(1.0) == pytest.approx(4 * 2.0 / 3.6)


def test_bench_file_picks_best_level_or_requested(tmp_path):
    bench = tmp_path / "bench.json"
    levels = [
        {"concurrency": 1, "output_tokens_per_s": 90.0, "ttft_s": {"p50": 0.1}, "requests": 8},
        {"concurrency": 16, "output_tokens_per_s": 180.5, "requests": 64},
        {"concurrency": 64, "output_tokens_per_s": 150.0, "requests": 64},
    ]
    bench.write_text(json.dumps({"url": "http://x", "model": "m", "levels": levels}))
    assert load_bench(str(bench), None)[0] == 180.5
    assert load_bench(str(bench), 64)[0] == 150.0
    with pytest.raises(UserError, match="levels: 1, 16, 64"):
        load_bench(str(bench), 8)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"levels": []}))
    with pytest.raises(UserError, match="no 'levels'"):
        load_bench(str(bad), None)


def test_cli_cost_section_from_bench(llama8b, tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"levels": [{"concurrency": 32, "output_tokens_per_s": 2000.0}]}))
    code, out, err = run_cli(
        [llama8b, "--bench", bench, "--gpu-hour-price", "3", "--api-price", "1.0", "--json"], capsys
    )
    assert code == 0, err
    cost = json.loads(out)["cost"]
    assert cost["throughput"] == 2000.0
    assert cost["cost_per_million"]["100%"] == pytest.approx(3 / (2000 * 3600) * 1e6)
    assert cost["cost_per_million"]["50%"] == pytest.approx(2 * 3 / (2000 * 3600) * 1e6)
    assert cost["breakeven_tokens_per_month"] == pytest.approx(3 * 730 / 1.0 * 1e6)
    assert json.loads(out)["advice"].startswith("Self-host")


# ----------------------------------------------------------------------------- inputs


def test_checkpoint_quantization_sets_default_weights(tmp_path):
    cfg = {
        **LLAMA3_8B,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": False,
                        "strategy": "group",
                        "group_size": 64,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
    }
    folder = write_model(tmp_path / "w4a16-g64", cfg)
    ckpt, _ = checkpoint_quant(cfg)
    assert ckpt.precision == "int4" and ckpt.spec.group_size == 64 and ckpt.spec.zero_points
    assert not ckpt.quantize_lm_head
    report = build_report(CapacityInputs(model=str(folder)))
    assert report["settings"]["weights"] == "int4"
    layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336
    scales = layer // 64
    expected = 32 * (layer // 2 + scales * 2 + scales // 2) + 2 * 525_336_576 * 2 + 266_240 * 2
    assert report["selected"]["weight_bytes"] == expected
    # an explicit --weights still wins
    assert build_report(CapacityInputs(model=str(folder), weights="bf16"))["settings"]["weights"] == "bf16"


def test_an_lm_head_group_of_its_own_is_counted_at_its_precision(tmp_path):
    """`quantize --lm-head w8a16` writes the head's group after the linears' (any order is read):
    the linears stay int4 g128, the head counts int8 per row plus one 16-bit scale a row."""
    w4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    w8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
    groups = {"group_0": {"targets": ["lm_head"], "weights": w8}, "group_1": {"targets": ["Linear"], "weights": w4}}
    cfg = {**LLAMA3_8B, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                "config_groups": groups, "ignore": []}}
    ckpt, notes = checkpoint_quant(cfg)
    assert notes == [] and ckpt.precision == "int4" and ckpt.spec.group_size == 128
    assert ckpt.quantize_lm_head and ckpt.lm_head_spec.bits == 8 and ckpt.lm_head_spec.strategy == "channel"
    report = build_report(CapacityInputs(model=str(write_model(tmp_path / "head-w8", cfg))))
    vocab, hidden = LLAMA3_8B["vocab_size"], LLAMA3_8B["hidden_size"]
    assert report["weights"]["int4"]["model_bytes"]["lm_head"] == vocab * hidden + vocab * 2


def test_gptq_and_fp8_checkpoint_configs():
    gptq, _ = checkpoint_quant({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    assert gptq.precision == "int4" and gptq.spec.g_idx and gptq.spec.zero_points
    fp8, _ = checkpoint_quant(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert fp8.precision == "fp8" and fp8.spec.block == (128, 128)
    ct_fp8, _ = checkpoint_quant(
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
                },
                "ignore": [],
            }
        }
    )
    assert ct_fp8.precision == "fp8" and ct_fp8.spec.strategy == "channel" and ct_fp8.quantize_lm_head


def test_smollm2_name_reads_cache_config_and_counts_tied_embeddings_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "empty"))
    code, out, err = run_cli(["smollm2-135m"], capsys)
    assert code != 0 and "lmfoundry quantize smollm2-135m" in err
    assert len(err.strip().splitlines()) == 1

    write_model(tmp_path / "cache" / "models" / "smollm2-135m", SMOLLM2)
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(["smollm2-135m", "--json", "--weights", "int4"], capsys)
    assert code == 0, err
    report = json.loads(out)
    # 49152 x 576 embedding (tied: once) + 30 layers x (attention + MLP + 2 norms) + final norm
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576
    assert report["params"]["total"] == 49152 * 576 + 30 * layer + 576 == 134_515_008
    assert report["params"]["lm_head"] == 0
    assert report["kv"]["bf16"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    # 576 is not a multiple of 128: the plan says so
    assert any("group 128 does not divide in_features 576" in n for n in report["notes"])


def test_config_json_path_and_lenient_architectures(tmp_path):
    path = write_model(tmp_path / "m", LLAMA3_8B) / "config.json"
    assert build_report(CapacityInputs(model=str(path)))["params"]["total"] == 8_030_261_248
    gemma = {**LLAMA3_8B, "model_type": "gemma", "head_dim": 256, "num_key_value_heads": 16}
    del gemma["tie_word_embeddings"]
    report = build_report(CapacityInputs(model=str(write_model(tmp_path / "g", gemma))))
    assert report["model"]["tied_embeddings"]  # Gemma's default
    assert any("Llama layout" in n for n in report["notes"])
    with pytest.raises(UserError, match="mixture-of-experts"):
        build_report(CapacityInputs(model=str(write_model(tmp_path / "moe", {**LLAMA3_8B, "num_local_experts": 8}))))
    with pytest.raises(UserError, match="unsupported model_type 'gpt2'"):
        build_report(CapacityInputs(model=str(write_model(tmp_path / "gpt2", {**LLAMA3_8B, "model_type": "gpt2"}))))


def test_gpu_table_has_sources_and_sane_values():
    gpus = load_gpus()
    assert {"h100-80gb", "h200", "a100-40gb", "a100-80gb", "l4"} <= set(gpus)
    for key, row in gpus.items():
        assert row["source"] and ("http" in row["source"] or "datasheet" in row["source"]), key
        assert row["memory_source"], key
        assert 0.9 * row["memory_gb"] * 1000**3 <= row["memory_mib"] * 2**20 <= 1.1 * row["memory_gb"] * 1024**3, key
        assert row["bandwidth_gbs"] > 0 and row["bf16_tflops"] > 0, key
        if row["fp8_tflops"] is not None:
            assert row["fp8_tflops"] == pytest.approx(2 * row["bf16_tflops"], rel=0.02), key


# ----------------------------------------------------------------------------- CLI


def test_cli_human_output(llama8b, capsys):
    code, out, err = run_cli([llama8b, "--weights", "int4", "--kv", "fp8"], capsys)
    assert code == 0, err
    assert "128.0 KiB" in out  # bf16 rows of the table
    assert "64.0 KiB/token" in out  # the selected fp8 KV
    selected = [line for line in out.splitlines() if line.startswith("* ")]
    assert len(selected) == 1 and selected[0].split()[1:3] == ["int4", "fp8"]
    code, out, _ = run_cli(["--list-gpus"], capsys)
    assert code == 0 and "h200" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "h300"], "unknown GPU 'h300'; known: h100-80gb"),
        (["--context", "0"], "--context must be a positive"),
        (["--context", "-5"], "--context must be a positive"),
        (["--context", "abc"], "--context must be an integer"),
        (["--tp", "3"], "--tp 3 does not divide the 32 attention heads"),
        (["--tp", "0"], "--tp must be a positive"),
        (["--gpu-util", "0"], "--gpu-util must be in (0, 1]"),
        (["--gpu-util", "1.2"], "--gpu-util must be in (0, 1]"),
        (["--weights", "int3"], "unknown --weights 'int3'"),
        (["--kv", "fp4"], "unknown --kv 'fp4'"),
        (["--gpu-hour-price", "2"], "--gpu-hour-price needs a throughput"),
        (["--throughput", "100", "--api-price", "1"], "--api-price is compared with self-hosting"),
        (["--throughput", "0"], "--throughput must be positive"),
        (["--throughput", "100", "--gpu-hour-price", "-1"], "--gpu-hour-price must be positive"),
        (["--concurrency", "4"], "--concurrency picks a level of --bench"),
        (["--bench", "/nonexistent/bench.json"], "no such file"),
        (["--group-size", "big"], "--group-size must be a positive integer"),
    ],
)
def test_cli_bad_flags_give_one_line_errors(llama8b, capsys, args, message):
    code, out, err = run_cli([llama8b, *args], capsys)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


def test_cli_bad_model_references(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text("{nope")
    for ref, message in [
        (tmp_path / "missing", "not a known model name"),
        (tmp_path / "empty", "no config.json"),
        (tmp_path / "broken.json", "not valid JSON"),
    ]:
        code, out, err = run_cli([ref], capsys)
        assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err
    code, _, err = run_cli([], capsys)
    assert code != 0 and "missing MODEL_OR_CHECKPOINT" in err


def test_plan_does_not_import_torch():
    code = "import sys, lmfoundry.commands.plan; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_render_mentions_every_precision(llama70b):
    text = render(build_report(CapacityInputs(model=str(llama70b), gpu="h200", tp=2)))
    for precision in ("bf16", "fp8", "int8", "int4"):
        assert f"{precision} GiB" in text
    assert "141.11" in text  # bf16 weights of the whole model in GB
    assert not math.isnan(float(text.split("total GB")[1].split()[0]))


MIXTRAL_8X7B = {
    **LLAMA3_8B,
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "sliding_window": None,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


def test_moe_parameters_total_and_active_by_hand():
    """Mixtral-8x7B: per layer attention 4096·(4096+1024+1024+4096), 8 experts of 3·4096·14336, a
    router of 8·4096 and two norms; embeddings and head 32000·4096 each: the published 46.7 B. A
    token runs 2 of the 8 experts: 12.9 B active."""
    counts = param_counts(ModelConfig.from_dict(MIXTRAL_8X7B))
    per_layer = 4096 * (4096 + 1024 + 1024 + 4096) + 8 * 3 * 4096 * 14336 + 8 * 4096 + 2 * 4096
    assert counts["total"] == 32 * per_layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    assert counts["active"] == counts["total"] - 6 * 32 * 3 * 4096 * 14336 == 12_879_925_248
    qwen = param_counts(ModelConfig.from_dict(QWEN3_30B_A3B))
    # Qwen's model card: "30.5B in total and 3.3B activated" (one decimal, truncated)
    assert math.floor(qwen["total"] / 1e8) / 10 == 30.5 and math.floor(qwen["active"] / 1e8) / 10 == 3.3
    dense = param_counts(ModelConfig.from_dict(LLAMA3_8B))
    assert dense["active"] == dense["total"]


def test_moe_param_counts_match_transformers_modules():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shapes = dict(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    cases = [("mixtral", transformers.MixtralConfig, transformers.MixtralForCausalLM,
              dict(num_local_experts=4, num_experts_per_tok=2)),
             ("qwen3_moe", transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
              dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96, head_dim=48))]
    for model_type, config_cls, model_cls, extra in cases:
        with torch.device("meta"):
            model = model_cls(config_cls(**shapes, **extra))
        expected = sum(p.numel() for p in model.parameters())
        assert param_counts(ModelConfig.from_dict({"model_type": model_type, **shapes, **extra}))["total"] == expected


def test_moe_weights_tensor_parallel_and_decode_ceiling(tmp_path):
    cfg = ModelConfig.from_dict(MIXTRAL_8X7B)
    bf16, w4 = default_quant_specs()["bf16"], default_quant_specs()["int4"]
    full = weight_bytes(cfg, bf16)
    assert full["total"] == 2 * 46_702_792_704
    assert full["mlp"] == 2 * 32 * (8 * 3 * 4096 * 14336 + 8 * 4096)  # the router stays 16-bit
    # tp 2 halves every expert's width; the router and norms are replicated
    half = weight_bytes(cfg, bf16, tp=2)
    assert half["mlp"] == 2 * 32 * (8 * 3 * 4096 * 7168 + 8 * 4096)
    active = weight_bytes(cfg, bf16, active=True)
    assert active["total"] == 2 * 12_879_925_248
    assert weight_bytes(cfg, w4, active=True)["mlp"] < weight_bytes(cfg, w4)["mlp"] / 3
    report = build_report(CapacityInputs(model=str(write_model(tmp_path / "mixtral", MIXTRAL_8X7B)), gpu="h100",
                                     tp=2))
    assert report["model"]["experts"] == {"num_experts": 8, "per_token": 2, "intermediate_size": 14336}
    per_gpu_active = weight_bytes(cfg, bf16, tp=2, active=True)["total"]
    assert report["decode_ceiling_tokens_per_s"] == pytest.approx(report["gpu"]["bandwidth_gbs"] * 1e9 / per_gpu_active)
    text = render(report)
    assert "46.70 B parameters, 12.88 B active: 2 of 8 experts" in text and "a token reads" in text
    odd = ModelConfig.from_dict({**MIXTRAL_8X7B, "intermediate_size": 14344})  # 8 x 1793
    with pytest.raises(UserError, match="each expert's intermediate size 14344"):
        weight_bytes(odd, bf16, tp=16)
