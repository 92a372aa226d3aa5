"""Issue 25: inputs that ended in a traceback, a hang or a silently wrong artifact. Each is now
one `error:` line, exit 2, and nothing left that looks complete (tiny models built offline).

| case | before | after |
|------|--------|-------|
| YAML alias chain ("billion laughs") in a recipe's options / gate | exit 0, 170 MiB lmfoundry.json | refused, naming the line |
| target `re:.*no_such_module$` | config.json declares quantization, nothing quantized | refused, naming the target |
| target `re:((unclosed` | re.error traceback | refused, naming the pattern |
| +inf in one weight | exit 0, that linear's weight_scale inf | refused, naming the tensor |
| `vocab_size: -5`, `hidden_size` missing / "lots", `num_hidden_layers` "4" / 4.5 / 1e9, `num_attention_heads: 0` | checkpoint written / KeyError / ZeroDivisionError / minutes of silence | refused, naming the field |
| num_hidden_layers larger than the layers stored; embedding of another vocab size | part of the model quantized / traceback | refused |
| a weight stored as I32, or with a shape the config does not imply | reinterpreted and quantized / traceback | refused, naming the tensor |
| `--method rtn --option bogus_knob=1`, `--option dampening_frac=banana` | exit 0 / ValueError traceback | refused |
| `plan --group-size 0` | a plan printed | refused |
| `--num-samples 1000000000` | memory past 3 GiB, no message | refused at once |
| no tokenizer files; tokenizer.json whose `model` is not an object | traceback | refused |
| a full disk while writing the checkpoint | `No space left on device` traceback | one line, nothing left |
| `repetition_penalty: 1e-300` | HTTP 500 and a traceback | 400 (refused by validation) |
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_one_error, run_cli, run_cli_on_a_small_disk
from safetensors.torch import load_file, save_file

QUANT = ["--quiet", "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "16"]


def quantize(model: Path, calib: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    code, _, err = run_cli(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib), *extra], capsys)
    return code, err


def edited_config(model: Path, tmp_path: Path, **changes) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(model, copy)
    cfg = json.loads((copy / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def edited_weights(model: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(model, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


BOMB = "\n".join([
    "a: &a [x, x, x, x, x, x, x, x, x]",
    "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]",
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]",
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]",
])


@pytest.mark.parametrize("section", ["options", "gate"])
def test_yaml_alias_chains_are_refused(section, model, calib, tmp_path, capsys) -> None:
    body = "\n".join("    " + line for line in BOMB.splitlines())
    text = (f"quantize:\n  method: rtn\n  options:\n{body}\n" if section == "options"
            else f"quantize:\n  method: rtn\ngate:\n  defaults:\n{body}\n")
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(text)
    code, err = quantize(model, calib, tmp_path / "out", capsys, "--recipe", str(recipe))
    assert_one_error(code, err, "aliases")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target,needle", [("re:.*no_such_module$", "matches no linear"),
                                           ("re:((unclosed", "not a valid regular expression")])
def test_bad_targets_are_refused(target, needle, model, calib, tmp_path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"quantize:\n  method: rtn\n  targets: ['{target}']\n")
    code, err = quantize(model, calib, tmp_path / "out", capsys, "--recipe", str(recipe))
    assert_one_error(code, err, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_weights_are_refused_by_name(value, model, calib, tmp_path, capsys) -> None:
    def poison(t):
        t["model.layers.1.mlp.up_proj.weight"][3, 7] = value

    code, err = quantize(edited_weights(model, tmp_path, poison), calib, tmp_path / "out", capsys)
    assert_one_error(code, err, "model.layers.1.mlp.up_proj.weight", "non-finite")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes,needle", [
    ({"vocab_size": -5}, "vocab_size must be in"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"hidden_size": "lots"}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": "4"}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": 4.5}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": 1000000000}, "num_hidden_layers must be in"),
    ({"num_attention_heads": 0}, "num_attention_heads must be in"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"num_hidden_layers": 3}, "holds 2 decoder layer(s)"),
    ({"num_hidden_layers": 1}, "more than the 1 decoder layers"),
    ({"vocab_size": 300}, "vocab_size and hidden_size imply"),
])
def test_config_fields_are_checked(changes, needle, model, calib, tmp_path, capsys) -> None:
    code, err = quantize(edited_config(model, tmp_path, **changes), calib, tmp_path / "out", capsys)
    assert_one_error(code, err, needle)
    assert not (tmp_path / "out").exists()


def test_doctor_with_a_billion_layers_answers_at_once(model, tmp_path, capsys) -> None:
    code, _, err = run_cli(["doctor", str(edited_config(model, tmp_path, num_hidden_layers=10**9)),
                            "--scheme", "w4a16", "--group-size", "32"], capsys)
    assert_one_error(code, err, "num_hidden_layers")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                         t["model.layers.0.self_attn.q_proj.weight"].view(torch.int32)}), "is stored as int32"),
    (lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                         t["model.layers.0.mlp.down_proj.weight"][:, :64].contiguous()}), "config.json implies"),
])
def test_tensors_the_config_does_not_imply_are_refused(edit, needle, model, calib, tmp_path, capsys) -> None:
    code, err = quantize(edited_weights(model, tmp_path, edit), calib, tmp_path / "out", capsys)
    assert_one_error(code, err, needle)


@pytest.mark.parametrize("method,option,needle", [
    ("rtn", "bogus_knob=1", "unknown option(s) bogus_knob"),
    ("gptq", "dampening_frac=banana", "wrong type"),
    ("smoothquant", "bogus=1", "unknown option(s) bogus"),
])
def test_options_are_checked_for_every_method(method, option, needle, model, calib, tmp_path, capsys) -> None:
    scheme = ["--scheme", "w8a8"] if method == "smoothquant" else []
    code, err = quantize(model, calib, tmp_path / "out", capsys, "--method", method, "--option", option, *scheme)
    assert_one_error(code, err, needle)


def test_plan_refuses_group_size_zero(model, capsys) -> None:
    code, _, err = run_cli(["plan", str(model), "--group-size", "0"], capsys)
    assert_one_error(code, err, "--group-size")


def test_a_billion_samples_is_refused_before_any_allocation(model, calib, tmp_path, capsys) -> None:
    args = ["quantize", str(model), "-o", str(tmp_path / "out"), "--quiet", "--method", "gptq", "--scheme", "w4a16",
            "--group-size", "32", "--seq-len", "16", "--calib", str(calib), "--num-samples", "1000000000"]
    code, _, err = run_cli(args, capsys)
    assert_one_error(code, err, "--num-samples 1000000000")


@pytest.mark.parametrize("fault", ["missing", "model not an object"])
def test_tokenizer_faults_are_one_line(fault, model, calib, tmp_path, capsys) -> None:
    copy = tmp_path / "tok"
    shutil.copytree(model, copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
        if fault == "missing":
            (copy / name).unlink(missing_ok=True)
    if fault == "model not an object":
        tj = json.loads((copy / "tokenizer.json").read_text())
        tj["model"] = 5
        (copy / "tokenizer.json").write_text(json.dumps(tj))
    code, err = quantize(copy, calib, tmp_path / "out", capsys)
    assert_one_error(code, err, "tokenizer")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_a_full_disk_is_one_line_and_leaves_nothing(error, model, calib, tmp_path, capsys, monkeypatch) -> None:
    from safetensors import SafetensorError

    import lmfoundry.checkpoint.folder as checkpoint

    def full(*args, **kwargs):
        if error == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", args[1])
        # what safetensors really raises (issue 46: a traceback): its own type, the OS's words inside
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "out"
    code, err = quantize(model, calib, out, capsys)
    assert_one_error(code, err, "no space left on the device", "MiB")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no staging folder


@pytest.mark.parametrize("size", ["16k", pytest.param("200k", marks=pytest.mark.slow)])
def test_quantize_onto_a_really_full_disk(size, model, calib, tmp_path) -> None:
    """Issue 46: a real tmpfs too small for the checkpoint (at its first shard, and part-way)."""
    small = tmp_path / "small"
    small.mkdir()
    code, err, left = run_cli_on_a_small_disk(["quantize", str(model), "-o", str(small / "out"), *QUANT,
                                               "--calib", str(calib)], small, size)
    assert_one_error(code, err, "no space left on the device")
    assert code == 2 and left == []


def test_repetition_penalty_that_would_overflow_is_refused() -> None:
    from lmfoundry.runtime.engine.sampling_params import SamplingParams

    for value in (1e-300, 1e300, 0.0):
        with pytest.raises(ValueError, match="repetition_penalty must be a number in"):
            SamplingParams(repetition_penalty=value).validate()
    SamplingParams(repetition_penalty=1.3).validate()


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight"])
def test_serving_a_misshapen_tensor_is_one_line(name, model, tmp_path) -> None:
    from lmfoundry.errors import UserError
    from lmfoundry.runtime.loader import load_model

    def cut(t):
        t[name] = t[name][..., :64].contiguous()

    with pytest.raises(UserError, match=f"{name} is stored with shape"):
        load_model(edited_weights(model, tmp_path, cut))


# ---- issue 46: loops of links, non-finite and out-of-range numbers -------------------------------
LOOP_VERBS = {
    "compile": ["compile", "{m}", "--arch", "hopper", "--quiet"],  # was RuntimeError: Symlink loop
    "compile-cpu": ["compile", "{m}", "--arch", "cpu", "--quiet"],
    "quantize": ["quantize", "{m}", "-o", "{tmp}/out", *QUANT],
    "export": ["export", "{m}", "-o", "{tmp}/m.gguf", "--quiet"],
    "serve": ["serve", "{m}", "--port", "0"],
    "eval-ppl": ["eval", "ppl", "{m}"],
    "doctor": ["doctor", "{m}"],
}


@pytest.mark.parametrize("verb", sorted(LOOP_VERBS))
def test_a_model_that_is_a_loop_of_links_is_one_line(verb, tmp_path, capsys) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    args = [a.format(m=tmp_path / "a", tmp=tmp_path) for a in LOOP_VERBS[verb]]
    code, _, err = run_cli(args, capsys)
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("cpu: "))  # serve's ISA line
    assert_one_error(code, err, "a loop of symbolic links")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("flags,needle", [
    (["--overhead-gib", "nan"], "--overhead-gib must be a finite number"),  # was ValueError: cannot convert NaN
    (["--overhead-gib", "inf"], "--overhead-gib must be a finite number"),
    (["--overhead-gib", "1e308"], "--overhead-gib must be in [0, "),  # was OverflowError
    (["--throughput", "inf", "--gpu-hour-price", "2"], "--throughput must be a finite number"),
    (["--gpu-util", "nan"], "--gpu-util must be a finite number"),
    (["--gpu-hour-price", "-inf", "--throughput", "10"], "--gpu-hour-price must be a finite number"),
])
def test_plan_refuses_non_finite_and_overflowing_numbers(flags, needle, model, capsys) -> None:
    code, _, err = run_cli(["plan", str(model), *flags], capsys)
    assert_one_error(code, err, needle)


def test_a_group_larger_than_any_layer_is_said_as_such(model, calib, tmp_path, capsys) -> None:
    """Issue 46: 99999999999999999999999 was refused as if it were a divisibility problem."""
    code, err = quantize(model, calib, tmp_path / "out", capsys, "--group-size", "99999999999999999999999")
    assert_one_error(code, err, "is larger than the input dimension")
    code, out, err = run_cli(["plan", str(model), "--weights", "int4", "--group-size", "99999999999999999999999"],
                             capsys)
    assert code == 0 and "is larger than every layer's in_features" in out and "does not divide" not in out, out


def test_compile_cpu_refuses_a_step_of_zero_tokens(model, tmp_path, capsys) -> None:
    """Issue 46: `--max-tokens 0` read as "the default" and built a step."""
    code, _, err = run_cli(["compile", str(model), "--arch", "cpu", "--max-tokens", "0", "-o", str(tmp_path / "e")],
                           capsys)
    assert_one_error(code, err, "--max-tokens")
    assert not (tmp_path / "e").exists()
