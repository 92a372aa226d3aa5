"""The conversion cache (`models/`): an entry is used only for the input its SOURCE record names,
so entries swapped with each other are converted again rather than served for the wrong input;
the staging folders of killed conversions are swept by the next conversion of that entry."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from helpers import tiny_model_folder
from safetensors.torch import load_file

from lmfoundry.checkpoint import sources

DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above the kernel's maximum: no process


def pickle_folder(root: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model folder whose weights are a pickle (pytorch_model.bin), and those weights."""
    folder = tiny_model_folder(root / f"pickled{seed}", "llama", seed=seed)
    state = load_file(str(folder / "model.safetensors"))
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder, state


def weights(folder: Path) -> torch.Tensor:
    return load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]


def test_swapped_entries_are_converted_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    (one, w1), (two, w2) = pickle_folder(tmp_path, 1), pickle_folder(tmp_path, 2)
    a, b = sources.resolve_model(one, allow_pickle=True), sources.resolve_model(two, allow_pickle=True)
    assert a != b and weights(a).equal(w1["model.embed_tokens.weight"])
    assert f"sha256 {sources.pickle_digest(one)}" in (a / sources.SOURCE).read_text().splitlines()
    os.replace(a, tmp_path / "aside")
    os.replace(b, a)
    os.replace(tmp_path / "aside", b)
    assert weights(a).equal(w2["model.embed_tokens.weight"])  # the name now holds the other model
    assert sources.resolve_model(one, allow_pickle=True) == a
    assert weights(a).equal(w1["model.embed_tokens.weight"])  # converted again, not served
    assert sources.resolve_model(two, allow_pickle=True) == b and weights(b).equal(w2["model.embed_tokens.weight"])
    (a / sources.SOURCE).unlink()  # an entry without its record (an older version's) is converted again too
    assert sources.resolve_model(one, allow_pickle=True) == a and (a / sources.SOURCE).is_file()
    assert sorted(p.name for p in a.parent.iterdir() if not p.name.endswith(".lock")) == sorted([a.name, b.name])


def test_a_killed_conversions_stage_is_swept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    folder, _ = pickle_folder(tmp_path, 3)
    name = f"pickle-{sources.pickle_digest(folder)[:16]}"
    models = tmp_path / "cache" / "models"
    dead = models / f".{name}.partial-{DEAD_PID}-0a1b2c3d4e5f"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half")
    live = models / f".{name}.partial-{os.getppid()}-0a1b2c3d4e5f"  # a running process: our parent
    live.mkdir()
    assert sources.resolve_model(folder, allow_pickle=True) == models / name
    assert not dead.exists() and live.is_dir()
