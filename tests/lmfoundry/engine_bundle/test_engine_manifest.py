"""The engine-bundle format has one owner (issue 58): lmfoundry/engine_bundle/ spells its file and
folder names, and compile, the runtime and evals write and read a bundle through it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lmfoundry.engine_bundle.engine_manifest import (
    ENGINE_FORMAT,
    MANIFEST_NAME,
    holds_lmfoundry_bundle,
    own_weights,
    rank_folder,
    record_in_manifest,
    weights_folder,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[3]
OWNER = ROOT / "lmfoundry" / "engine_bundle"
# a bundle's manifest or weights folder spelled out (`engine / "weights"`, `"engine.json"`)
SPELLED = re.compile(r"""["']engine\.json["']|/ *["']weights["']""")


def _sources() -> list[Path]:
    """Every Python source file of the repository but the tests' and the format's own."""
    skip = {"tests", "build", "dist"}
    tops = [p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in skip]
    return [f for top in tops for f in top.rglob("*.py") if OWNER not in f.parents]


def test_the_format_is_spelled_only_in_its_package():
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for f in _sources()
             for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if SPELLED.search(line)]
    assert not found, "spell the bundle layout through lmfoundry.engine_bundle:\n" + "\n".join(found)


def test_recording_a_verdict_keeps_every_other_field(tmp_path):
    manifest = {"format": ENGINE_FORMAT, "weights": {"files": {"config.json": {"sha256": "ab"}}}, "kernels": []}
    write_manifest(tmp_path, manifest)
    before = (tmp_path / MANIFEST_NAME).read_text()
    assert json.loads(before) == manifest and before.endswith("\n")
    record_in_manifest(tmp_path, "promotion", {"verdict": "pass"})
    assert json.loads((tmp_path / MANIFEST_NAME).read_text()) == {**manifest, "promotion": {"verdict": "pass"}}
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME]  # no temporary file left behind


def test_only_a_manifest_of_our_format_is_a_bundle_to_rebuild(tmp_path):
    assert not holds_lmfoundry_bundle(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("not json")
    assert not holds_lmfoundry_bundle(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "someone-else/1"}))
    assert not holds_lmfoundry_bundle(tmp_path)
    write_manifest(tmp_path, {"format": ENGINE_FORMAT})
    assert holds_lmfoundry_bundle(tmp_path)


def test_a_tensor_parallel_bundle_reads_its_config_from_rank_0(tmp_path):
    write_manifest(tmp_path, {"format": ENGINE_FORMAT})
    assert weights_folder(tmp_path) == own_weights(tmp_path)
    write_manifest(tmp_path, {"format": ENGINE_FORMAT, "tensor_parallel": {"size": 2, "ranks": []}})
    assert weights_folder(tmp_path) == own_weights(tmp_path / rank_folder(0))
