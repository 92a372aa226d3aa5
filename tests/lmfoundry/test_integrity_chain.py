"""The integrity chain between stages: a checkpoint whose files do not match its lmfoundry.json
is refused by every stage that consumes it, before any tensor is read (compile would otherwise
record the tampered weights' hashes as good, and serve or eval-gate would promote them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.cli import main
from lmfoundry.errors import UserError
from lmfoundry.manifest import verify_artifact


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    model = tiny_model_folder(root / "tiny", "llama", head_dim=64)
    out = root / "w4a16"
    main(["quantize", str(model), "-o", str(out), "--quiet", "--method", "rtn", "--scheme", "w4a16",
          "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--calib", str(write_text(root / "c.txt"))])
    return out


@pytest.fixture
def tampered(checkpoint: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(checkpoint, copy)
    shard = next(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight: the header still parses
    shard.write_bytes(bytes(data))
    return copy


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, shard: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("error: ") and f"{shard}: sha256 mismatch" in lines[-1], err


def test_an_intact_checkpoint_passes(checkpoint: Path) -> None:
    verify_artifact(checkpoint)


def test_compile_refuses_before_reading_a_tensor(tampered: Path, tmp_path: Path) -> None:
    from lmfoundry.compile.bundle import build_engine

    shard = next(tampered.glob("*.safetensors")).name
    with pytest.raises(UserError, match=f"{shard}: sha256 mismatch.*refusing to compile"):
        build_engine(tampered, ["hopper"], tmp_path / "engine", progress=False)
    assert not (tmp_path / "engine").exists()


def test_serve_refuses_and_skip_verify_is_the_way_out(tampered: Path, capsys) -> None:
    code, err = run_cli(["serve", str(tampered), "--port", "0"], capsys)
    assert_refused(code, err, next(tampered.glob("*.safetensors")).name)
    assert "refusing to serve" in err


def test_eval_gate_refuses_a_tampered_candidate(tampered: Path, checkpoint: Path, tmp_path: Path, capsys) -> None:
    code, err = run_cli(["eval-gate", str(tampered), "--baseline", str(checkpoint), "-o", str(tmp_path / "g")], capsys)
    assert_refused(code, err, next(tampered.glob("*.safetensors")).name)
    assert not (tmp_path / "g").exists()


def test_an_unlisted_file_is_named(checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "extra"
    shutil.copytree(checkpoint, copy)
    (copy / "planted.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="planted.safetensors: not in manifest"):
        verify_artifact(copy)
