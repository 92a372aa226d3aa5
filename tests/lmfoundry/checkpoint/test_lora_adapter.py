"""PEFT LoRA folders read against a base: what is served (splits, scales) and every refusal, each
one line naming the problem, decided from the config and the safetensors header."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import write_lora_adapter
from safetensors.torch import load_file, save_file
from toy import toy_config

from lmfoundry.checkpoint.lora_adapter import check_adapter, read_adapter
from lmfoundry.errors import UserError

BASE = toy_config()  # hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 259


def edit_config(folder: Path, **fields) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def edit_tensors(folder: Path, fn) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def refused(folder: Path, *needles: str, base=BASE, max_rank: int | None = 16) -> str:
    with pytest.raises(UserError) as err:
        check_adapter(folder, base, max_rank)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_a_plain_adapter_reads_with_its_scales(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=8, alpha=16, targets=("q_proj", "down_proj"),
                                alpha_pattern={"down_proj": 4})
    adapter = read_adapter(folder, BASE, max_rank=8)
    assert adapter.rank == 8 and adapter.targets == ("mlp.down_proj", "self_attn.q_proj")
    assert len(adapter.linears) == 4  # two modules in each of two layers
    q = adapter.linears["model.layers.1.self_attn.q_proj"]
    assert q.scale == 2.0 and q.a.shape == (8, 64) and q.b.shape == (64, 8)
    assert adapter.linears["model.layers.0.mlp.down_proj"].scale == 0.5  # alpha_pattern: 4 / 8
    raw = load_file(str(folder / "adapter_model.safetensors"))
    assert torch.equal(q.b, raw["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"])


def test_rslora_scales_by_the_square_root(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=4, alpha=8, targets=("v_proj",), use_rslora=True)
    assert read_adapter(folder, BASE).linears["model.layers.0.self_attn.v_proj"].scale == 8 / math.sqrt(4)


def test_fused_targets_split_into_their_linears(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=4, targets=("qkv_proj", "gate_up_proj"))
    adapter = read_adapter(folder, BASE)
    raw = load_file(str(folder / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"]
    parts = [adapter.linears[f"model.layers.0.self_attn.{m}_proj"] for m in "qkv"]
    assert [p.b.shape[0] for p in parts] == [64, 32, 32]
    assert torch.equal(torch.cat([p.b for p in parts]), b)
    assert all(torch.equal(p.a, parts[0].a) for p in parts)
    assert {"mlp.gate_proj", "mlp.up_proj"} <= set(adapter.targets)


def test_other_kinds_of_adapter_are_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE)
    edit_config(folder, use_dora=True)
    refused(folder, "DoRA", "not implemented")
    edit_config(folder, use_dora=False, bias="all")
    refused(folder, "bias", "not implemented")
    edit_config(folder, bias="none", modules_to_save=["lm_head"])
    refused(folder, "modules_to_save", "not implemented")
    edit_config(folder, modules_to_save=None, peft_type="IA3")
    refused(folder, "peft_type 'IA3'", "only LoRA")


def test_dora_magnitudes_in_the_file_are_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}))
    refused(folder, "DoRA magnitude")


def test_a_rank_over_the_maximum_is_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, rank=32)
    refused(folder, "rank 32", "--max-lora-rank 16")
    assert check_adapter(folder, BASE, max_rank=32) == 32


def test_a_target_the_base_lacks_is_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight": torch.zeros(8, 64),
        "base_model.model.model.layers.0.self_attn.c_attn.lora_B.weight": torch.zeros(64, 8)}))
    refused(folder, "self_attn.c_attn", "does not have")


def test_an_adapter_for_another_hidden_size_is_refused(tmp_path):
    other = toy_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    folder = write_lora_adapter(tmp_path / "a", other)
    refused(folder, "another base", "hidden size 64")


def test_an_adapter_for_another_vocabulary_is_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                                             "base_model.model.lm_head.lora_B.weight": torch.zeros(32000, 8)}))
    refused(folder, "another base", "vocabulary of 32000", "259")


def test_lm_head_and_embedding_adapters_are_not_implemented(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
                                             "base_model.model.lm_head.lora_B.weight": torch.zeros(259, 8)}))
    refused(folder, "LoRA on lm_head is not implemented")
    folder = write_lora_adapter(tmp_path / "b", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 259),
                                             "base_model.model.model.embed_tokens.lora_embedding_B": torch.zeros(64, 8)}))
    refused(folder, "model.embed_tokens is not implemented")


def test_more_layers_than_the_base_is_another_base(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", toy_config(num_hidden_layers=4), targets=("o_proj",))
    refused(folder, "model.layers.2", "2 layers", "another base")


def test_missing_or_unsafe_files_are_refused(tmp_path):
    refused(tmp_path / "nothing", "not a folder")
    folder = write_lora_adapter(tmp_path / "a", BASE)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    refused(folder, "adapter_model.bin is a pickle")
    (folder / "adapter_model.bin").unlink()
    refused(folder, "no adapter_model.safetensors")
    (folder / "adapter_config.json").write_text("{not json")
    refused(folder, "not valid JSON")
    (folder / "adapter_config.json").unlink()
    refused(folder, "no adapter_config.json")


def test_half_a_pair_and_non_float_weights_are_refused(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.pop("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"))
    refused(folder, "model.layers.1.self_attn.q_proj", "no lora_B")
    folder = write_lora_adapter(tmp_path / "b", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()}))
    refused(folder, "I8")


def test_non_finite_weights_are_refused_when_read(tmp_path):
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    edit_tensors(folder, lambda t: t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].fill_(float("nan")))
    with pytest.raises(UserError, match="inf or NaN"):
        read_adapter(folder, BASE)


def test_a_mixture_of_experts_base_is_refused(tmp_path):
    moe = toy_config(num_local_experts=4, num_experts_per_tok=2, model_type="mixtral")
    folder = write_lora_adapter(tmp_path / "a", BASE, targets=("q_proj",))
    refused(folder, "mixture-of-experts", base=moe)
