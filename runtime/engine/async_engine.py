"""The engine behind a server: a background thread steps the engine while asyncio callers
submit requests and consume per-step events.

Only the engine thread touches the engine's state: callers post "add" and "abort" commands, which
it applies between steps. torch releases the GIL in its kernels, so the event loop keeps serving
HTTP while a step runs.

A request that fails inside a step (see `LLMEngine.step`) is failed alone: its stream raises
`RequestFailed`, the others keep streaming.

The waiting queue is bounded: a request is refused with `QueueFull` when the unfinished sequences
would exceed max_num_seqs running plus max_waiting_requests waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from lmfoundry.runtime.engine.llm_engine import LLMEngine, Prompt
from lmfoundry.runtime.engine.outputs import StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (its other requests keep running): HTTP 500."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_seqs: int


class RequestStream:
    """The events of one submitted request. Leaving the iteration early (client gone, task
    cancelled) aborts the request, which frees its blocks."""

    def __init__(self, owner: "AsyncLLMEngine", request_id: str, events: asyncio.Queue) -> None:
        self.owner, self.request_id, self._events = owner, request_id, events
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[StepEvent]:
        try:
            while not self.finished:
                item = await self._events.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.request_finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLMEngine:
    """`start=True`: the engine steps in a background thread of its own. `start=False`: the caller
    gives it a thread with `run_here` — `serve` gives it the main thread, because PyTorch's CPU
    ops parallelize (OpenMP) well only from the thread whose worker team is already spinning:
    stepped from a second thread, a 2-thread decode step measured slower than a 1-thread one."""

    def __init__(self, engine: LLMEngine, start: bool = True) -> None:
        self.engine = engine
        cfg = engine.config
        self.capacity = cfg.max_num_seqs + cfg.max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._running_here = False
        if start:
            self._thread = threading.Thread(target=self._run, name="lmfoundry-engine", daemon=True)
            self._thread.start()

    # ---- caller side ------------------------------------------------------------------------
    @property
    def num_unfinished_seqs(self) -> int:
        with self._lock:
            return sum(s.num_seqs for s in self._streams.values())

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validate a request up front (raises ValueError), so HTTP errors precede any streaming."""
        self.engine.check_request(prompt_ids, params)

    def submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> "RequestStream":
        """Validate and enqueue a request now (raising ValueError or QueueFull at once, before any
        response is started); iterate the returned stream for its events. Must be called from
        the event loop that will consume the stream."""
        ids = self.engine.encode(prompt)
        self.check(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        with self._lock:
            if sum(s.num_seqs for s in self._streams.values()) + params.n > self.capacity:
                raise QueueFull(f"the queue is full ({self.capacity} sequences); retry later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        self._post(("add", request_id, ids, params, time.monotonic()))
        return RequestStream(self, request_id, stream.queue)

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StepEvent]:
        """Submit a request and yield its events until it finishes."""
        async for ev in self.submit(prompt, params, request_id):
            yield ev

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._post(("abort", request_id))

    @property
    def is_alive(self) -> bool:
        """Whether the engine loop is running (it stops only on shutdown)."""
        return self._thread.is_alive() if self._thread is not None else self._running_here and not self._stop

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

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread ----------------------------------------------------------------------
    def _deliver(self, request_id: str, item: StepEvent | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.request_finished):
                del self._streams[request_id]
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, ids, params, arrival = cmd
                with self._lock:
                    wanted = request_id in self._streams
                if not wanted:
                    continue  # aborted before it started
                try:
                    self.engine.add_request(request_id, ids, params, arrival)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    self._deliver(request_id, exc)
            else:
                self.engine.abort(cmd[1])

    def _run(self, keep_running: Callable[[], bool] = lambda: True) -> None:
        while not self._stop and keep_running():
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("engine step failed; aborting all running requests")
                for request_id in self.engine.abort_all():
                    self._deliver(request_id, RuntimeError(f"engine failure: {exc}"))
                continue
            for ev in events:
                if ev.error is not None:
                    log.error("request %s failed; the others keep running", ev.request_id, exc_info=ev.error)
                    failure = RequestFailed(f"the request failed in the engine: {ev.error}")
                    failure.__cause__ = ev.error
                    self._deliver(ev.request_id, failure)
                else:
                    self._deliver(ev.request_id, ev)
