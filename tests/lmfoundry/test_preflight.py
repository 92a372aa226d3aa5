"""The pre-flight doctor: blocking problems are found before any calibration work."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from helpers import tiny_model_folder, write_text
from safetensors.torch import load_file, save_file

from lmfoundry.calibration.job import QuantizeJob, run_job
from lmfoundry.checkpoint.folder import CheckpointReader
from lmfoundry.commands.doctor import doctor
from lmfoundry.errors import UserError
from lmfoundry.preflight import FAIL, diagnose, parse_arch, parse_bytes
from lmfoundry.recipe import Recipe


def rec(**q):
    return Recipe().with_overrides(**q)


def failed(report):
    return {c.name for c in report.checks if c.status == FAIL}


@pytest.fixture
def model(tmp_path):
    return str(tiny_model_folder(tmp_path / "float"))


def test_q_and_k_quantized_but_not_v_is_blocking(model, tmp_path):
    r = rec(method="rtn", scheme="w8a16", per_channel=True, ignore=["lm_head", "re:.*v_proj$"])
    report = diagnose(model, r)
    assert failed(report) == {"fused modules"}
    detail = next(c.detail for c in report.checks if c.name == "fused modules")
    assert "layer 0 qkv_proj" in detail and "v_proj: not quantized" in detail
    # quantize runs the doctor first and writes nothing
    r = r.with_overrides(source=str(write_text(tmp_path / "c.txt")), num_samples=2, seq_len=16)
    with pytest.raises(UserError, match="fused modules"):
        run_job(QuantizeJob(model, tmp_path / "out", r, progress=False))
    assert not (tmp_path / "out").exists()
    # the same plan with v included passes
    assert not failed(diagnose(model, rec(method="rtn", scheme="w8a16", per_channel=True)))


def test_gate_without_up_is_blocking(model):
    r = rec(method="rtn", scheme="w4a16", group_size=32, targets=["re:.*(q|k|v|o|gate|down)_proj$"])
    assert failed(diagnose(model, r)) == {"fused modules"}


def test_fp8_for_ampere_is_blocking(model):
    r = rec(method="fp8", scheme="fp8-dynamic")
    assert failed(diagnose(model, r, arch="ampere")) == {"target arch"}
    assert failed(diagnose(model, r, arch="a100")) == {"target arch"}
    for ok in ("hopper", "sm_89", "ada", "blackwell"):
        assert not failed(diagnose(model, r, arch=ok)), ok
    # int8 W8A8 runs on ampere, not on turing
    w8a8 = rec(method="smoothquant", scheme="w8a8")
    assert not failed(diagnose(model, w8a8, arch="ampere"))
    assert failed(diagnose(model, w8a8, arch="turing")) == {"target arch"}


def test_kv_scheme_without_scales_is_blocking(model, tmp_path):
    r = rec(method="rtn", scheme="w8a16", per_channel=True, kv_cache="fp8")
    r = r.with_overrides(source=str(write_text(tmp_path / "c.txt")), num_samples=2, seq_len=16, batch_size=2)
    out = tmp_path / "kv"
    run_job(QuantizeJob(model, out, r, progress=False))
    assert not failed(diagnose(str(out), Recipe()))
    reader = CheckpointReader(out)
    path = reader.index["model.layers.0.self_attn.k_scale"]
    tensors = load_file(str(path))
    del tensors["model.layers.0.self_attn.k_scale"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = diagnose(str(out), Recipe())
    assert failed(report) == {"kv scales"}
    assert "model.layers.0.self_attn.k_scale" in next(c.detail for c in report.checks if c.name == "kv scales")


def test_method_scheme_mismatch_and_invalid_kv_strategy(model, tmp_path):
    assert "method x scheme" in failed(diagnose(model, rec(method="fp8", scheme="w8a8")))
    assert "method x scheme" in failed(diagnose(model, rec(method="smoothquant", scheme="w4a16", group_size=32)))
    bad_kv = rec(method="rtn", scheme="w8a16", per_channel=True, kv_cache="int8", kv_strategy="channel")
    assert failed(diagnose(model, bad_kv)) >= {"kv cache"}
    # quantize's pre-flight judges the plan and quantizer the job built, and blocks before any output
    with pytest.raises(UserError, match="pre-flight checks failed.*kv cache"):
        run_job(QuantizeJob(model, tmp_path / "out", bad_kv, progress=False))
    assert not (tmp_path / "out").exists()


def test_int8_kv_warns_about_vllm(model):
    report = diagnose(model, rec(method="rtn", scheme="w8a16", per_channel=True, kv_cache="int8"))
    assert any(c.status == "warn" and "vLLM" in c.detail for c in report.checks)
    assert report.verdict().startswith("verdict: READY")


def test_memory_estimates_and_gpu_mem(model):
    r = rec(method="rtn", scheme="w8a16", per_channel=True)
    report = diagnose(model, r, gpu_mem=parse_bytes("1GiB"), ctx=256)
    serve = report.estimates["serving"]
    # tiny llama: 2 layers x 2 (K, V) x 2 KV heads x 32 dims x 2 bytes
    assert serve["kv_per_token"] == 2 * 2 * 2 * 32 * 2 and serve["kv_at_ctx"] == serve["kv_per_token"] * 256
    assert serve["weights"] > 0 and not failed(report)
    assert failed(diagnose(model, r, gpu_mem=parse_bytes("100KiB"), ctx=256)) == {"serving memory"}
    assert report.estimates["calibration"]["total"] > 0


def test_cli_prints_table_and_exits_nonzero_on_blocking(model):
    runner = CliRunner()
    res = runner.invoke(doctor, [model, "--method", "fp8", "--scheme", "fp8-static", "--arch", "ampere"])
    assert "target arch" in res.output and "verdict: BLOCKED" in res.output
    assert isinstance(res.exception, UserError) and res.exception.exit_code != 0
    res = runner.invoke(doctor, [model, "--method", "fp8", "--scheme", "fp8-static", "--arch", "hopper",
                                 "--gpu-mem", "80GiB", "--kv-cache", "fp8"])
    assert res.exit_code == 0, res.output
    assert "verdict: READY" in res.output and "kv scales" in res.output


def test_parsers():
    assert parse_arch("hopper") == ("hopper", 90)
    assert parse_arch("sm_89")[1] == 89 and parse_arch("sm90a")[1] == 90 and parse_arch("8.0")[1] == 80
    assert parse_arch("sm_100")[1] == 100 and parse_arch("120")[1] == 120
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("24GB") == 24 * 10**9 and parse_bytes("2") == 2 * 2**30
    with pytest.raises(UserError):
        parse_arch("pascalish")
    with pytest.raises(UserError):
        parse_bytes("lots")


def _status(report, name):
    return next((c.status, c.detail) for c in report.checks if c.name == name)


def test_tensor_parallel_splits_of_a_smollm2_shaped_model(tmp_path):
    """SmolLM2-135M's shape (hidden 576, 9 / 3 heads of 64, intermediate 1536), W4A16 g64."""
    from lmfoundry.preflight import OK, WARN

    aligned = str(tiny_model_folder(tmp_path / "aligned", "llama", hidden_size=512, intermediate_size=1024,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=64))
    assert _status(diagnose(aligned, rec(method="rtn", scheme="w4a16", group_size=64), tp=2), "tensor parallel 2")[0] == OK

    folder = str(tiny_model_folder(tmp_path / "smol", "llama", hidden_size=576, intermediate_size=1536,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64))
    r = rec(method="rtn", scheme="w4a16", group_size=64)
    # even unsplit, 576 inputs are not a multiple of Marlin's 128-wide tile
    status, detail = _status(diagnose(folder, r, tp=1), "tensor parallel 1")
    assert status == WARN and "qkv_proj: 960 x 576" in detail
    status, detail = _status(diagnose(folder, r, tp=2), "tensor parallel 2")
    assert status == FAIL and "9 attention heads" in detail
    # tp 3: 3 heads and one KV head per rank; o_proj gets 192 inputs per rank: whole groups of 64,
    # but not a multiple of Marlin's 128-wide tile
    status, detail = _status(diagnose(folder, r, tp=3), "tensor parallel 3")
    assert status == WARN and "o_proj: 576 x 192" in detail
    # groups of 128 would be split on o_proj's 192 inputs per rank: blocking (scales cannot split)
    r128 = rec(method="rtn", scheme="w4a16", group_size=128)
    status, detail = _status(diagnose(folder, r128, tp=3), "tensor parallel 3")
    assert status == FAIL and "o_proj: 192 inputs per rank split its groups of 128" in detail
    result = CliRunner().invoke(doctor, [folder, "--scheme", "w4a16", "--group-size", "64", "--tp", "2"])
    assert result.exit_code != 0 and "tensor parallel 2" in result.output
