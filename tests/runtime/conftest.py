"""Fixtures of the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def hopper_engine(tmp_path_factory) -> Path:
    """One W4A16 (asymmetric, g32) bundle built for hopper only, shared by the loader tests."""
    from lmfoundry.compile.bundle import build_engine

    root = tmp_path_factory.mktemp("hopper")
    ckpt = write_checkpoint(root / "ckpt", "w4a16", bits=4, group=32, symmetric=False)
    build_engine(ckpt, ["hopper"], root / "engine", progress=False)
    return root / "engine"
