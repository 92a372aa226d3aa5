"""Issue 46, data loss: no verb writes into, over, or through a link to one of its own inputs.

Each verb that writes (quantize, compile, export, eval-gate) is driven with an `-o` that reaches an
input in each of the four ways; each must be refused with one `error:` line, exit 2, before
anything is written, and leave the input byte for byte as it was.

| verb | way | before the fix |
|---|---|---|
| export | -o is one of the checkpoint's shards | rc 0, the shard overwritten, `inspect` fails its sha256 |
| export | -o a symlink to the checkpoint's lmfoundry.json | rc 0, the manifest replaced by GGUF bytes |
| compile | -o CKPT/engine | bundle inside the checkpoint, which then no longer verifies |
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import assert_one_error, run_cli

from lmfoundry.errors import UserError
from lmfoundry.output_paths import refuse_overlap

QUANT = ["--quiet", "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "16"]
WAYS = ["same", "inside", "symlink", "hardlink"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (and `folder` itself if a file) with its bytes' sha256."""
    if folder.is_file():
        return {folder.name: hashlib.sha256(folder.read_bytes()).hexdigest()}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def copied(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True)
    return dest


def output_for(way: str, input_folder: Path, tmp: Path, *, file_output: bool, shard: str) -> Path:
    """An -o that reaches `input_folder` in `way`: the input (a shard of it, for a file output),
    a path inside it, a symlink to it, or a path holding a hard link to one of its files."""
    if way == "same":
        return input_folder / shard if file_output else input_folder
    if way == "inside":
        return input_folder / ("out.gguf" if file_output else "engine")
    if way == "symlink":
        link = tmp / "link"
        link.symlink_to(input_folder / shard if file_output else input_folder)
        return link
    assert way == "hardlink"
    if file_output:
        os.link(input_folder / shard, tmp / "hard.gguf")
        return tmp / "hard.gguf"
    (tmp / "out").mkdir()
    os.link(input_folder / shard, tmp / "out" / "eval-gate.json")
    return tmp / "out"


def assert_refused_and_intact(run: Callable[[], tuple[int, str, str]], input_folder: Path, *needles: str) -> None:
    before = snapshot(input_folder)
    code, _, err = run()
    assert_one_error(code, err, *needles)
    assert code == 2
    assert snapshot(input_folder) == before


WHY = {"same": "is the input", "inside": "lies inside the input folder", "symlink": "through a symbolic link",
       "hardlink": "is a link to the input's"}


@pytest.mark.parametrize("way", WAYS)
def test_export_never_writes_over_its_checkpoint(way, artifact, tmp_path, capsys) -> None:
    ckpt = copied(artifact, tmp_path / "ckpt")
    shard = "lmfoundry.json" if way == "symlink" else sorted(p.name for p in ckpt.glob("*.safetensors"))[-1]
    out = output_for(way, ckpt, tmp_path, file_output=True, shard=shard)
    assert_refused_and_intact(lambda: run_cli(["export", str(ckpt), "-o", str(out), "--overwrite", "--quiet"], capsys),
                              ckpt, WHY[way])
    assert run_cli(["inspect", str(ckpt)], capsys)[0] == 0


@pytest.mark.parametrize("way", WAYS)
def test_compile_never_writes_into_its_checkpoint(way, artifact, tmp_path, capsys) -> None:
    ckpt = copied(artifact, tmp_path / "ckpt")
    out = output_for(way, ckpt, tmp_path, file_output=False, shard="config.json")
    assert_refused_and_intact(lambda: run_cli(["compile", str(ckpt), "--arch", "hopper", "-o", str(out), "--quiet"],
                                              capsys), ckpt, WHY[way])
    assert not (tmp_path / "ckpt-engine").exists()


@pytest.mark.parametrize("way", WAYS)
def test_quantize_never_writes_into_its_model(way, model, calib, tmp_path, capsys) -> None:
    src = copied(model, tmp_path / "model")
    out = output_for(way, src, tmp_path, file_output=False, shard="config.json")
    assert_refused_and_intact(lambda: run_cli(["quantize", str(src), "-o", str(out), *QUANT, "--calib", str(calib),
                                               "--overwrite"], capsys), src, WHY[way])


def test_quantize_never_writes_over_its_calibration_text_or_recipe(model, calib, tmp_path, capsys) -> None:
    text = shutil.copy(calib, tmp_path / "calib.txt")
    assert_refused_and_intact(lambda: run_cli(["quantize", str(model), "-o", str(tmp_path), *QUANT, "--calib", text,
                                               "--overwrite"], capsys), tmp_path, "holds the input")
    recipe = tmp_path / "r" / "recipe.yaml"
    recipe.parent.mkdir()
    recipe.write_text("quantize:\n  method: rtn\n")
    assert_refused_and_intact(lambda: run_cli(["quantize", str(model), "-o", str(recipe.parent), "--recipe",
                                               str(recipe), *QUANT, "--calib", str(calib), "--overwrite"], capsys),
                              recipe.parent, "holds the input")


@pytest.mark.parametrize("way", WAYS)
def test_eval_gate_never_writes_its_report_into_an_input(way, artifact, model, tmp_path, capsys) -> None:
    ckpt = copied(artifact, tmp_path / "ckpt")
    out = output_for(way, ckpt, tmp_path, file_output=False, shard="lmfoundry.json")
    assert_refused_and_intact(lambda: run_cli(["eval-gate", str(ckpt), "--baseline", str(model), "-o", str(out),
                                               "--quiet", "--no-cache"], capsys), ckpt, WHY[way])


# ---- the rule itself ----------------------------------------------------------------------------------
def test_refuse_overlap_allows_siblings_and_reports_each_way(tmp_path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 10)
    refuse_overlap(tmp_path / "in-engine", [src])  # a sibling: fine
    refuse_overlap(tmp_path / "new" / "deeper", [src, None, tmp_path / "missing"])  # absent inputs are skipped
    refuse_overlap(tmp_path, [src], holds_inputs_ok=True)  # eval-gate may write beside its inputs
    with pytest.raises(UserError, match="holds the input"):
        refuse_overlap(tmp_path, [src])
    with pytest.raises(UserError, match="is the input .* itself$|is the input"):
        refuse_overlap(src / "a.bin", [src / "a.bin"])
    (tmp_path / "chain1").symlink_to(tmp_path / "chain2")
    (tmp_path / "chain2").symlink_to(tmp_path / "chain1")
    with pytest.raises(UserError, match="loop of symbolic links"):
        refuse_overlap(tmp_path / "chain1" / "x", [src])
