"""The key of `quantize --resume`'s journal is the source's content: a copy made with `cp -p` that
changed one weight (same file names, sizes and modification times) is another run, whose journal a
resume must not continue with layers quantized from the old weights."""

from __future__ import annotations

from pathlib import Path

from helpers import copy_with_one_weight_changed, tiny_model_folder, write_text

from lmfoundry.calibration import job
from lmfoundry.cli import main


def test_a_changed_weight_under_kept_names_sizes_and_mtimes_is_another_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_CACHE", str(tmp_path / "cache"))
    first = tiny_model_folder(tmp_path / "first", "llama")
    second = copy_with_one_weight_changed(first, tmp_path / "second")
    same = copy_with_one_weight_changed(first, tmp_path / "same-bytes")  # the same change: the same content
    calib = write_text(tmp_path / "calib.txt")
    keys: dict[str, str] = {}
    real = job._work_folder

    def recording(out: Path, key: str, resume: bool):
        keys[out.name] = key
        return real(out, key, resume)

    monkeypatch.setattr(job, "_work_folder", recording)
    for model in (first, second, same):
        main(["quantize", str(model), "-o", str(tmp_path / f"out-{model.name}"), "--quiet", "--method", "rtn",
              "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--calib", str(calib)])
    assert keys["out-first"] != keys["out-second"]
    assert keys["out-second"] == keys["out-same-bytes"]  # content, not the folder it lies in

