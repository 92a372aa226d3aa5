"""Fixtures the CLI reliability tests share: a tiny random Llama folder, calibration text, and a
real quantized artifact of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text

QUANT = ["--quiet", "--scheme", "w4a16", "--group-size", "32", "--num-samples", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("c") / "c.txt")


@pytest.fixture(scope="module")
def artifact(model, calib, tmp_path_factory) -> Path:
    """A real quantized artifact with its lmfoundry.json (copied by the tests that modify one)."""
    from lmfoundry.cli import main

    out = tmp_path_factory.mktemp("a") / "q"
    main(["quantize", str(model), "-o", str(out), *QUANT, "--calib", str(calib)])
    return out
