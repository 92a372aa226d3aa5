"""`serve`'s engine process builds its engine from the runtime alone: it imports neither click
nor the CLI's modules (the engine factory is runtime code, not the verb's), checked in a real
engine process started from the very `EngineSpec` that `serve` hands to it."""

from __future__ import annotations

import pytest
from engine_probes import modules_after_build
from toy import save_toy_checkpoint

from lmfoundry.commands.serve import serve
from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec

pytestmark = pytest.mark.timeout(240)


class _Captured(Exception):
    pass


def test_the_engine_process_imports_neither_click_nor_the_cli(tmp_path, monkeypatch) -> None:
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    specs: list[EngineSpec] = []

    def capture(self, spec, **kwargs) -> None:  # serve's engine client, stopped before it starts a process
        specs.append(spec)
        raise _Captured

    monkeypatch.setattr(EngineCoreClient, "__init__", capture)
    with pytest.raises(_Captured):
        serve.main([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                    "--dtype", "float32", "--skip-verify"], standalone_mode=False)
    monkeypatch.undo()
    assert len(specs) == 1
    listing = tmp_path / "modules.txt"
    client = EngineCoreClient(EngineSpec(modules_after_build, (specs[0], str(listing))))
    try:
        assert client.is_alive and client.info.max_model_len == 256
    finally:
        client.shutdown()
    modules = listing.read_text().split()
    assert "lmfoundry.runtime.engine.llm_engine" in modules  # the listing is the built engine's process
    assert "click" not in modules
    assert not [m for m in modules if m == "lmfoundry.commands" or m.startswith("lmfoundry.commands.")]
