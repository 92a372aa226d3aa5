"""An engine client that steps the engine in a thread of this process, for tests, notebooks and
in-process benchmarks that want the engine object at hand. `serve` runs the engine in a process
of its own instead (`EngineCoreClient`): the same `EngineClient` interface, the same streams.

Only the stepping thread touches the engine's state: callers post "add" and "abort" commands,
which it applies between steps. torch releases the GIL in its kernels, so the event loop keeps
serving HTTP while a step runs.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import AsyncIterator, Callable

from lmfoundry.runtime.engine.client import EngineClient, EngineDead, EngineRequest
from lmfoundry.runtime.engine.core import EngineCore
from lmfoundry.runtime.engine.llm_engine import LLMEngine
from lmfoundry.runtime.engine.offline import Prompt
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams


class AsyncLLMEngine(EngineClient):
    """`start=True`: the engine steps in a background thread of its own. `start=False`: the caller
    gives it a thread with `run_here`. PyTorch's CPU ops parallelize (OpenMP) well only from the
    thread whose worker team is already spinning: stepped from a second thread, a 2-thread decode
    step measured slower than a 1-thread one, which is why `serve` gives the engine a process
    whose main thread does nothing else."""

    def __init__(self, engine: LLMEngine, start: bool = True) -> None:
        super().__init__(engine.info.capacity)
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self._core = EngineCore(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._running_here = False
        self._next_id = 0
        if start:
            self._thread = threading.Thread(target=self._run, name="lmfoundry-engine", daemon=True)
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running (it stops only on shutdown)."""
        return self._thread.is_alive() if self._thread is not None else self._running_here and not self._stop

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
                 ) -> AsyncIterator[StepEvent]:
        """Validate and submit a request (offline-style: the engine detokenizes it); iterate its
        events until it finishes."""
        ids = self.engine.encode(prompt)
        self.engine.check_request(ids, params)
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        return self.submit(EngineRequest(request_id, ids, params, time.monotonic())).__aiter__()

    def run_here(self, keep_running: Callable[[], bool]) -> None:
        """Step the engine in the calling thread until `keep_running()` is false (checked between
        steps and at least once a second while idle) or `shutdown` is called."""
        self._running_here = True
        try:
            self._run(keep_running)
        finally:
            self._running_here = False

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self, keep_running: Callable[[], bool] = lambda: True) -> None:
        while not self._stop and keep_running():
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                self.deliver(self._core.apply(command))
            if not self._core.has_work:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self.deliver(self._core.step())
            except EngineDead as exc:  # every stream ends with it; the loop stops (is_alive False)
                self._stop = True
                self.fail_all(exc)
                raise
