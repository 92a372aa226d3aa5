"""`quantize --resume`: a run killed with SIGKILL after layer k continues from layer k and writes
the same bytes as an uninterrupted run; stale work folders of dead processes are cleaned up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.calibration.journal import JOURNAL

LAYERS = 8


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    model = tiny_model_folder(root / "model", "llama", num_hidden_layers=LAYERS, hidden_size=256,
                              intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return model, write_text(root / "calib.txt", n_words=20000)


def _args(model: Path, calib: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lmfoundry.cli", "quantize", str(model), "-o", str(out), "--quiet", "--method",
            "gptq", "--scheme", "w4a16", "--group-size", "32", "--num-samples", "16", "--seq-len", "128",
            "--calib", str(calib), *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _artifact_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of the checkpoint, the manifest included, but the run record (which records
    times and the resume)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "lmfoundry-run.json"}


@pytest.mark.slow
def test_sigkill_then_resume_is_byte_identical(inputs, tmp_path: Path) -> None:
    model, calib = inputs
    whole = tmp_path / "whole"
    subprocess.run(_args(model, calib, whole), env=_env(), check=True, capture_output=True)

    out = tmp_path / "resumed"
    proc = subprocess.Popen(_args(model, calib, out), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    work = tmp_path / f".{out.name}.partial-{proc.pid}"
    deadline = time.monotonic() + 300
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            done = json.loads((work / JOURNAL).read_text())["done"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert 3 <= done < LAYERS and work.is_dir() and not out.exists()

    res = subprocess.run(_args(model, calib, out, "--resume"), env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    resumed_at = json.loads((out / "lmfoundry-run.json").read_text())["resumed_from_layer"]
    assert resumed_at >= 3  # the journal may have advanced between the read and the kill
    assert _artifact_bytes(out) == _artifact_bytes(whole)
    assert not work.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]


def test_stale_work_folders_of_dead_processes_are_removed(inputs, tmp_path: Path) -> None:
    model, calib = inputs
    out = tmp_path / "out"
    # a process id above the kernel's maximum: no process has it (a recently exited pid could be reused)
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    stale = tmp_path / f".{out.name}.partial-{dead_pid}"
    stale.mkdir()
    (stale / "model-00001-of-00010.safetensors").write_bytes(b"left by a killed run")
    stale_staging = tmp_path / f".{out.name}.new-{dead_pid}-0a1b2c"
    stale_staging.mkdir()
    foreign = tmp_path / ".other.partial-1"  # another output's folder: not ours to touch
    foreign.mkdir()
    args = _args(model, calib, out)
    args[args.index("--num-samples") + 1] = "2"
    res = subprocess.run(args, env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert not stale.exists() and not stale_staging.exists() and foreign.is_dir() and (out / "config.json").is_file()
    assert json.loads((out / "lmfoundry-run.json").read_text())["resumed_from_layer"] == 0


def test_resume_with_other_settings_starts_over(inputs, tmp_path: Path) -> None:
    """A journal of a run with other inputs (here: another seed) is not continued."""
    from lmfoundry.calibration.journal import LayerJournal, run_key

    work = tmp_path / "work"
    work.mkdir()
    journal = LayerJournal(work, run_key({"seed": 1}))

    class Writer:
        tmp, weight_map, total_bytes = work, {}, 0

    from lmfoundry.calibration.pipeline import PipelineReport

    journal.record(2, Writer, PipelineReport(), None)
    assert LayerJournal.open(work, run_key({"seed": 1})).done == 2
    assert LayerJournal.open(work, run_key({"seed": 2})).done == 0
