"""Fixtures the CLI reliability tests share: a tiny random Llama folder and calibration text."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_model_folder, write_text


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    return write_text(tmp_path_factory.mktemp("c") / "c.txt")
