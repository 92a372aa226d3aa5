"""What the engine reports it runs (`EngineInfo` via runtime/engine/weight_format.py): the dtype in
effect, the device and CPU path, and the weight format read from the loaded modules after the
serving swaps, on real quantized checkpoints of the toy model."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from toy import save_toy_checkpoint

from lmfoundry.cli import cli
from lmfoundry.model.linears import dense_linear
from lmfoundry.quantformat.scheme import make_scheme
from lmfoundry.runtime.cpu.isa import isa
from lmfoundry.runtime.cpu.native.int4_gemm import load_int4_gemm
from lmfoundry.runtime.cpu.native.int8_gemm import load_int8_gemm
from lmfoundry.runtime.engine import EngineConfig, LLMEngine
from lmfoundry.runtime.engine.weight_format import describe_weights, scheme_label
from lmfoundry.runtime.loader import load_model

SCHEMES = {"w4a16": ["--scheme", "w4a16", "--group-size", "32"], "w8a16": ["--scheme", "w8a16", "--per-channel"],
           "w8a8": ["--scheme", "w8a8"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("weight-format")
    # 4 KV heads: every linear has a multiple of 64 outputs, as the int4 C product's unpacking needs
    out = {"float": str(save_toy_checkpoint(root / "float", seed=6, num_key_value_heads=4))}
    for name, args in SCHEMES.items():
        result = CliRunner().invoke(cli, ["quantize", out["float"], "-o", str(root / name), "--method", "rtn",
                                          "--num-samples", "4", "--seq-len", "64", "--quiet", "--skip-doctor", *args])
        assert result.exit_code == 0, result.output
        out[name] = str(root / name)
    return out


def info(folder: str, dtype: torch.dtype):
    return LLMEngine.from_pretrained(folder, dtype, EngineConfig(num_kv_blocks=16, block_size=4)).info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_checkpoint_runs_dense_in_the_dtype_asked(folders, dtype: torch.dtype) -> None:
    got = info(folders["float"], dtype)
    name = str(dtype).removeprefix("torch.")
    assert (got.dtype, got.device, got.cpu_isa) == (name, "cpu", isa())
    assert got.weight_format == {"float32": "fp32 dense", "bfloat16": "bf16 dense"}[name]


def test_weight_only_codes_stay_packed_in_bf16_and_are_dequantized_in_float32(folders) -> None:
    """`--dtype float32` keeps dense dequantized weights; bfloat16 keeps the codes, in our C products
    where they are built (AVX-512 BF16), PyTorch's int4pack / int8pack elsewhere."""
    four = "int4 C product" if load_int4_gemm() is not None else "int4pack"
    eight = "int8 C product" if load_int8_gemm() is not None else "int8pack"
    assert info(folders["w4a16"], torch.bfloat16).weight_format == f"w4a16 g32 ({four})"
    assert info(folders["w8a16"], torch.bfloat16).weight_format == f"w8a16 per-channel ({eight})"
    assert info(folders["w4a16"], torch.float32).weight_format == "w4a16 g32 (dequantized to fp32 dense)"
    assert info(folders["w8a8"], torch.bfloat16).weight_format == "w8a8 per-channel (int8 GEMM)"


def test_a_model_of_several_forms_lists_each_with_its_count(folders) -> None:
    model, _ = load_model(folders["w4a16"], dtype=torch.bfloat16)  # before the serving swap: int4pack
    layer = model.model.layers[1].mlp
    layer.down_proj = dense_linear(layer.down_proj.dequantized_weight(), None)
    assert describe_weights(model) == "w4a16 g32 (int4pack) x13; w4a16 g32 (dequantized to bf16 dense) x1"


def test_scheme_labels_use_the_cli_words() -> None:
    assert scheme_label(make_scheme("w4a16", group_size=128, symmetric=False, actorder="static")) == \
        "w4a16 g128 asym act-order"
    assert scheme_label(make_scheme("w8a16", per_channel=True)) == "w8a16 per-channel"
    assert scheme_label(make_scheme("w8a8-static")) == "w8a8 per-channel static"
    assert scheme_label(make_scheme("fp8-dynamic")) == "fp8 per-channel"
    assert scheme_label(make_scheme("fp8-static")) == "fp8 per-tensor static"
