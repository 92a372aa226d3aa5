"""Fixtures of the compile tests: tiny checkpoints written on demand (`checkpoints.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from checkpoints import write_checkpoint


@pytest.fixture
def make_checkpoint(tmp_path):
    counter = iter(range(1000))

    def make(**kw: Any) -> Path:
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", **kw)

    return make
