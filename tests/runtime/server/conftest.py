"""A live server on 127.0.0.1 over a toy model and byte tokenizer, run by uvicorn in a thread."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest

from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine
from lmfoundry.runtime.engine.toy import byte_tokenizer, toy_model
from lmfoundry.runtime.server.app import create_app
from lmfoundry.runtime.server.background import serve_in_thread


class Live:
    def __init__(self, url: str, engine: AsyncLLMEngine) -> None:
        self.url, self.engine = url, engine


@contextmanager
def live_server(api_key: str | None = None, **engine_kwargs) -> Iterator[Live]:
    cfg = dict(num_kv_blocks=256, block_size=8, max_model_len=256, max_num_seqs=8, max_waiting_requests=8)
    cfg.update(engine_kwargs)
    engine = AsyncLLMEngine(LLMEngine(toy_model(seed=2), byte_tokenizer(), EngineConfig(**cfg)))
    try:
        with serve_in_thread(create_app(engine, "toy", api_key=api_key)) as url:
            yield Live(url, engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server() -> Iterator[Live]:
    with live_server() as live:
        yield live


@pytest.fixture
def make_server():
    """live_server as a fixture, for tests that need their own server settings."""
    return live_server
