"""`serve --lora`: every refusal is one `error:` line before the model is loaded, and vLLM's
`--lora-modules NAME=PATH ...` starts a server whose /v1/models lists the adapters."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import assert_one_error, run_cli, start_serve, stop_serve, wait_for_url, write_lora_adapter
from safetensors.torch import load_file, save_file
from toy import save_toy_checkpoint, toy_config

from lmfoundry.commands.lora_options import parse_spec, split_positionals
from lmfoundry.errors import UserError


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy") / "toy", seed=0)


@pytest.fixture
def adapter(tmp_path):
    return write_lora_adapter(tmp_path / "ad", toy_config(), rank=8)


def serve_refused(capsys, *args: str, needles: tuple[str, ...]) -> None:
    code, _, err = run_cli(["serve", *args], capsys)
    assert code == 2
    assert_one_error(code, err, *needles)


def test_an_adapter_that_does_not_fit_is_one_line(base, adapter, tmp_path, capsys) -> None:
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", "--max-lora-rank", "4",
                  needles=("--lora x:", "rank 8", "exceeds --max-lora-rank 4"))
    other = write_lora_adapter(tmp_path / "other", toy_config(hidden_size=96, num_attention_heads=6), rank=8)
    serve_refused(capsys, str(base), "--lora", f"o={other}", needles=("another base", "hidden size 64"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", needles=("DoRA", "not implemented"))


def test_a_target_the_base_lacks_and_another_vocabulary_are_one_line(base, adapter, tmp_path, capsys) -> None:
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.model.layers.0.mlp.fc1.lora_B.weight": torch.zeros(128, 8)}, str(weights))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", needles=("mlp.fc1", "does not have"))
    save_file({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(50000, 8)}, str(weights))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", needles=("another base", "vocabulary of 50000"))


def test_bad_lora_options_are_one_line(base, adapter, capsys) -> None:
    serve_refused(capsys, str(base), "--lora", str(adapter), needles=("expected NAME=PATH",))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", "--lora", f"x={adapter}", needles=("given twice",))
    serve_refused(capsys, str(base), "--lora", f"toy={adapter}", needles=("served model's name",))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", "--lora", f"y={adapter}", "--max-loras", "1",
                  needles=("--max-loras 1", "fewer"))
    serve_refused(capsys, str(base), "--lora", f"x={adapter}", "--tp", "2", needles=("--tp", "not implemented"))
    serve_refused(capsys, str(base), "--lora", f"x={base}", needles=("no adapter_config.json",))
    serve_refused(capsys, str(base), "extra", needles=("unexpected extra argument",))


def test_slots_past_the_machines_memory_are_one_line_before_the_model_loads(base, adapter, capsys) -> None:
    """--max-loras 100000000: the slots' bytes, counted from the config before anything loads,
    are refused naming how many would fit (it was the allocator's traceback after the load)."""
    import psutil

    from lmfoundry.capacity.arithmetic import lora_bytes
    from lmfoundry.model.config import ModelConfig

    code, _, err = run_cli(["serve", str(base), "--lora", f"x={adapter}", "--max-loras", "100000000"], capsys)
    assert_one_error(code, err, "--max-loras 100000000: 100000000 adapter slots of rank 16 need",
                     "of memory available; at most")
    most = int(err.split("at most ")[1].split()[0])
    slot = lora_bytes(ModelConfig.from_file(base), 1, 16)
    assert 0 < most * slot <= psutil.virtual_memory().total  # the limit named is what the memory holds


def test_vllm_lora_modules_forms() -> None:
    assert parse_spec('{"name": "sql", "path": "/a", "base_model_name": "m"}', "--lora-modules") == ("sql", "/a")
    assert parse_spec("sql=/a=b", "--lora") == ("sql", "/a=b")
    with pytest.raises(UserError, match="JSON form"):
        parse_spec('{"name": "sql"}', "--lora-modules")
    # click hands `--lora-modules a=P b=Q` one value and leaves the rest positional
    assert split_positionals("base", ("b=/q", "c=/r"), ("a=/p",)) == ("base", ("a=/p", "b=/q", "c=/r"))
    assert split_positionals("b=/q", ("base",), ("a=/p",)) == ("base", ("a=/p", "b=/q"))
    with pytest.raises(UserError, match="one MODEL"):
        split_positionals("b=/q", ("c=/r",), ("a=/p",))


def test_serve_with_vllm_lora_modules_lists_and_runs_the_adapters(base, tmp_path) -> None:
    a = write_lora_adapter(tmp_path / "a", toy_config(), rank=8, seed=1)
    b = write_lora_adapter(tmp_path / "b", toy_config(), rank=4, seed=2, targets=("q_proj",))
    proc = start_serve([str(base), "--port", "0", "--max-model-len", "128", "--kv-cache-gb", "0.01",
                        "--lora-modules", f"a={a}", f"b={b}", "--max-loras", "3"])
    try:
        url = wait_for_url(proc)
        models = httpx.get(f"{url}/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("toy", None), ("a", "toy"), ("b", "toy")]
        texts = {}
        for model in ("toy", "a", "b"):
            r = httpx.post(f"{url}/completions", timeout=60, json={"model": model, "prompt": "hello", "max_tokens": 8,
                                                                   "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
            texts[model] = r.json()["choices"][0]["text"]
        assert len(set(texts.values())) == 3  # each adapter changes the output
    finally:
        stop_serve(proc)
