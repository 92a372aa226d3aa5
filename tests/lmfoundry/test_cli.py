"""Bad input gets one clear line, a non-zero exit, no traceback and no output folder."""

import subprocess
import sys

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main


def run_cli(args, capsys):
    """(exit code, stderr) of an in-process CLI run."""
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("m") / "tiny", "llama")


def quantize_args(model, out, *extra):
    return ["quantize", str(model), "-o", str(out), "--quiet", "--scheme", "w4a16", "--group-size", "32",
            "--num-samples", "2", "--seq-len", "16", *extra]


def test_ok_then_inspect_and_tamper(model, tmp_path, capsys):
    out = tmp_path / "q"
    calib = write_text(tmp_path / "c.txt")
    main(quantize_args(model, out, "--calib", str(calib)))
    assert "peak RSS" in capsys.readouterr().out
    code, _ = run_cli(["inspect", str(out)], capsys)
    assert code == 0
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, err = run_cli(["inspect", str(out)], capsys)
    assert code == 1 and shard.name in err and "sha256 mismatch" in err


def _bad_cases(model, tmp_path):
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    (truncated / "config.json").write_text((model / "config.json").read_text())
    blob = (model / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((model / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not really")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    return {
        "missing path": ([str(tmp_path / "nope")], "no such file"),
        "truncated safetensors": ([str(truncated)], "truncated"),
        "pickle checkpoint": ([str(pickled)], "pickle"),
        "unsupported architecture": ([str(gpt2)], "unsupported architecture GPT2LMHeadModel"),
        "unknown scheme": ([str(model), "--scheme", "w4a4"], "unknown scheme"),
        "empty calibration": ([str(model), "--calib", str(empty)], "empty"),
        "group size": ([str(model), "--group-size", "48"], "does not divide the input dimension"),
    }


@pytest.mark.parametrize("case", ["missing path", "truncated safetensors", "pickle checkpoint",
                                  "unsupported architecture", "unknown scheme", "empty calibration", "group size"])
def test_bad_input(case, model, tmp_path, capsys):
    args, expected = _bad_cases(model, tmp_path)[case]
    out = tmp_path / "out"
    base = ["quantize", args[0], "-o", str(out), "--quiet", "--scheme", "w4a16", "--group-size", "32",
            "--num-samples", "2", "--seq-len", "16", *args[1:]]
    code, err = run_cli(base, capsys)
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.partial*"))


def test_unknown_method_and_subprocess_has_no_traceback(model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "quantize", str(model), "-o", str(tmp_path / "o"),
                           "--method", "magic"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "magic" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "lmfoundry.cli", "quantize", str(tmp_path / "absent"), "-o",
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "no such file" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_help_lists_commands(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    for cmd in ("quantize", "inspect", "eval"):
        assert cmd in out


def test_allow_pickle_converts_once(tmp_path, capsys, monkeypatch, model):
    import torch
    from safetensors.torch import load_file

    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "pickled"
    src.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(str(model / "model.safetensors")), src / "pytorch_model.bin")
    out = tmp_path / "q"
    code, err = run_cli(quantize_args(src, out), capsys)
    assert code == 2 and "--allow-pickle" in err and not out.exists()
    code, err = run_cli(quantize_args(src, out, "--allow-pickle"), capsys)
    assert code == 0, err
    assert (out / "lmfoundry.json").exists()
    assert list((tmp_path / "cache" / "models").glob("pickle-*/model.safetensors"))


@pytest.mark.parametrize("args,expected", [
    (["quantize", "x", "-o", "y", "--bogus"], "No such option '--bogus'"),
    (["serve"], "Missing argument 'MODEL'"),
    (["eval", "ppl", "m", "--ctx", "abc"], "'abc' is not a valid integer"),
    (["nosuch"], "No such command 'nosuch'"),
])
def test_usage_errors_are_one_line(args, expected, capsys):
    code, err = run_cli(args, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and expected in lines[0] and "--help" in lines[0], err
