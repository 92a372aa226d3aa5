"""The engine process's housekeeping after start-up (`runtime/engine/core.py`)."""

from __future__ import annotations

import gc

from lmfoundry.runtime.engine.core import freeze_heap


def test_freeze_heap_leaves_objects_alive_and_out_of_collections() -> None:
    frozen_before = gc.get_freeze_count()
    owner = {"weights": list(range(1000))}
    freeze_heap()
    try:
        assert gc.get_freeze_count() > frozen_before
        assert owner["weights"][-1] == 999
    finally:
        gc.unfreeze()
