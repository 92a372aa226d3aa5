"""A live server on 127.0.0.1 over a toy model and byte tokenizer, run by uvicorn in a thread.

By default its engine runs in a process of its own (`EngineCoreClient`), as under `serve`;
`in_process=True` steps it in a thread of the test process instead (`AsyncLLMEngine`), for the
few tests that reach into the engine object (replace its step, read its block manager)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
from fastapi import FastAPI
from toy import toy_engine

from lmfoundry.runtime.engine import AsyncLLMEngine, EngineClient
from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec
from lmfoundry.runtime.server.app import ApiOptions, create_app
from lmfoundry.runtime.server.background import serve_in_thread


class Live:
    def __init__(self, url: str, engine: EngineClient, app: FastAPI) -> None:
        self.url, self.engine, self.app = url, engine, app  # app: for tests that walk its route table


@contextmanager
def live_server(api_key: str | None = None, in_process: bool = False, step_delay: float = 0.0,
                options: ApiOptions | None = None, **engine_kwargs) -> Iterator[Live]:
    """`step_delay` seconds are added to every engine step (requests that must outlive a deadline);
    `options`: the app's HTTP options (what serve's CORS, metrics and request-field flags set)."""
    cfg = dict(num_kv_blocks=256, block_size=8, max_model_len=256, max_num_seqs=8, max_waiting_requests=8)
    cfg.update(engine_kwargs)
    engine: EngineClient
    if in_process:
        engine = AsyncLLMEngine(toy_engine(seed=2, step_delay=step_delay, **cfg))
    else:
        engine = EngineCoreClient(EngineSpec(toy_engine, kwargs=dict(seed=2, step_delay=step_delay, **cfg)))
    try:
        app = create_app(engine, "toy", api_key=api_key, options=options or ApiOptions())
        with serve_in_thread(app) as url:
            yield Live(url, engine, app)
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
