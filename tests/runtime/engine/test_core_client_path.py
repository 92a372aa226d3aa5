"""The engine process (what `serve` starts) takes its caller's sys.path, less any checkout root:
started in a checkout's root, it must not import that checkout's `kernels/` or `lmfoundry/`."""

from __future__ import annotations

import sys

import helpers
import pytest
from helpers import plant_checkout

from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec

pytestmark = pytest.mark.timeout(180)


def test_engine_process_started_in_a_checkout_keeps_it_off_its_path(tmp_path, monkeypatch):
    """The caller runs in a checkout root with '' first on its path (`python -c`, a notebook) and
    no PYTHONSAFEPATH; the engine process still has neither the root nor '' on its path, and still
    finds a factory that only the caller's path reaches (tests/helpers.py)."""
    monkeypatch.chdir(plant_checkout(tmp_path / "checkout"))
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    client = EngineCoreClient(EngineSpec(helpers.engine_off_the_checkout, kwargs=dict(num_kv_blocks=16)))
    try:
        assert client.is_alive and client.info.vocab_size == 259
    finally:
        client.shutdown()
    assert client.process.returncode == 0
