"""`lmfoundry inspect` of a checkpoint: the source as the manifest names it (no local path), the
run's time and peak RSS from the run record (not hashed, so never a verification failure), and
manifests written before the run record was split off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import run_cli, tiny_model_folder, write_text

from lmfoundry.manifest import RUN_RECORD


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    from lmfoundry.cli import main

    root = tmp_path_factory.mktemp("inspect")
    model, calib = tiny_model_folder(root / "model", "llama"), write_text(root / "calib.txt")
    out = root / "q"
    main(["quantize", str(model), "-o", str(out), "--quiet", "--method", "rtn", "--scheme", "w4a16",
          "--group-size", "32", "--calib", str(calib), "--num-samples", "2", "--seq-len", "16"])
    return out


def _inspect(folder: Path, capsys) -> tuple[int, dict]:
    code, out, err = run_cli(["inspect", str(folder), "--json"], capsys)
    assert "Traceback" not in err
    return code, json.loads(out)


def _copy(artifact: Path, dest: Path) -> Path:
    return Path(shutil.copytree(artifact, dest))


def test_summary_names_sources_and_shows_the_run(artifact, capsys) -> None:
    code, summary = _inspect(artifact, capsys)
    assert code == 0 and summary["verified"] is True
    assert summary["source model"].startswith("1 weights file(s), config sha256 ")
    assert "of calib.txt " in summary["calibration"]
    run = json.loads((artifact / RUN_RECORD).read_text())
    assert summary["peak RSS"] == f"{run['peak_rss_bytes'] / 2**20:.0f} MiB"
    assert summary["run"] == f"{run['wall_s']:.1f} s on cpu"
    root = str(artifact.parent)  # the folder the model, text and checkpoint lie in
    assert not [v for k, v in summary.items() if k != "artifact" and isinstance(v, str) and root in v]


def test_run_record_is_not_verified_but_is_read_defensively(artifact, tmp_path, capsys) -> None:
    """Changed or unreadable, the run record is no verification failure (it is not part of the
    checkpoint's content); the table shows "?" for what it cannot read."""
    out = _copy(artifact, tmp_path / "edited")
    (out / RUN_RECORD).write_text(json.dumps({"peak_rss_bytes": 3 * 2**20, "wall_s": 1.5, "device": "cuda:0"}))
    code, summary = _inspect(out, capsys)
    assert code == 0 and summary["verified"] and (summary["peak RSS"], summary["run"]) == ("3 MiB", "1.5 s on cuda:0")
    (out / RUN_RECORD).write_text("[1, 2")
    code, summary = _inspect(out, capsys)
    assert code == 0 and summary["verified"] and (summary["peak RSS"], summary["run"]) == ("?", "?")
    (out / RUN_RECORD).unlink()
    code, summary = _inspect(out, capsys)
    assert code == 0 and summary["verified"] and summary["peak RSS"] == "?"


def test_run_record_linking_out_of_the_folder_fails_verification(artifact, tmp_path, capsys) -> None:
    """Later stages copy every file of an artifact: a run record that is a link to a file elsewhere
    is refused like any other unlisted file."""
    out = _copy(artifact, tmp_path / "linked")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"peak_rss_bytes": 1}))
    (out / RUN_RECORD).unlink()
    (out / RUN_RECORD).symlink_to(secret)
    code, summary = _inspect(out, capsys)
    assert code == 1 and summary["problems"] == [f"{RUN_RECORD}: not in manifest (not a regular file)"]
    assert summary["peak RSS"] == "?"


def test_manifest_from_before_the_run_record(artifact, tmp_path, capsys) -> None:
    """An artifact written before the split: the spec and measurements were in the manifest."""
    out = _copy(artifact, tmp_path / "old")
    (out / RUN_RECORD).unlink()
    manifest = json.loads((out / "lmfoundry.json").read_text())
    manifest["source_model"] = {"spec": "/data/models/tiny", "path": "/data/models/tiny", **manifest["source_model"]}
    manifest.update(peak_rss_bytes=5 * 2**20, wall_s=2.0, device="cpu")
    (out / "lmfoundry.json").write_text(json.dumps(manifest))
    code, summary = _inspect(out, capsys)
    assert code == 0 and summary["verified"]
    assert (summary["source model"], summary["peak RSS"], summary["run"]) == ("/data/models/tiny", "5 MiB", "2.0 s on cpu")
