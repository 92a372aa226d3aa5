"""The caller's side of an engine that steps somewhere else: in its own process
(`EngineCoreClient`, what `serve` runs) or in a thread of this one (`AsyncLLMEngine`).

A server talks to the engine only through `EngineClient`: `info` and `tokenizer` to validate and
encode a request once at the API boundary, `submit` an `EngineRequest` (which the engine trusts:
it does not check it again) and iterate its `RequestStream`, `abort`, `stats` for /metrics,
`is_alive` for /health. Both clients share the stream bookkeeping here, so the server behaves the
same over either.

The waiting queue is bounded: a request is refused with `QueueFull` when the unfinished sequences
would exceed max_num_seqs running plus max_waiting_requests waiting.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

from lmfoundry.runtime.engine.outputs import EmbeddingResult, LoRAResult, StepEvent
from lmfoundry.runtime.engine.sampling_params import SamplingParams


class QueueFull(Exception):
    """The engine's waiting queue is full; retry later (HTTP 429)."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (its other requests keep running): HTTP 500."""


class EngineDead(RuntimeError):
    """The engine stopped (its process died): every request in flight fails, new ones get HTTP 503."""


class ShuttingDown(EngineDead):
    """The server is stopping and did not finish this request within its drain time (HTTP 503)."""


@dataclass(frozen=True)
class EngineRequest:
    """A request validated at the API boundary (`RequestValidator`); the engine adds it as it is."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class EngineInfo:
    """What a caller needs to know of the engine to validate and account for requests."""

    vocab_size: int
    max_model_len: int
    max_position_embeddings: int
    hidden_size: int
    eos_token_ids: frozenset[int]
    capacity: int  # sequences unfinished at once: max_num_seqs running + max_waiting_requests waiting
    # what runs, read from the loaded model (runtime/engine/weight_format.py): serve prints it,
    # /v1/models and /metrics export it
    dtype: str = ""  # the execution dtype in effect, e.g. "bfloat16"
    device: str = "cpu"
    cpu_isa: str | None = None  # the CPU kernels' vector path (amx, avx512, avx2), on a CPU device
    weight_format: str = ""  # e.g. "w4a16 g64 (int4 C product)"
    loras: tuple[str, ...] = ()  # LoRA adapters loaded at start (requests name them as their model)
    max_loras: int = 0  # adapter slots (0: LoRA off)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_seqs: int


class RequestStream:
    """The events of one submitted request. Leaving the iteration early (client gone, task
    cancelled) aborts the request, which frees its blocks."""

    def __init__(self, owner: "EngineClient", request_id: str, events: asyncio.Queue) -> None:
        self.owner, self.request_id, self._events = owner, request_id, events
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[Any]:  # StepEvents (or one EmbeddingResult)
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


class EngineClient(abc.ABC):
    """Stream bookkeeping shared by the clients; subclasses move commands to the engine
    (`_send`) and deliver what it produces (`deliver`)."""

    info: EngineInfo
    tokenizer: Any

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()

    # ---- caller side ------------------------------------------------------------------------
    @property
    def num_unfinished_seqs(self) -> int:
        with self._lock:
            return sum(s.num_seqs for s in self._streams.values())

    @property
    @abc.abstractmethod
    def is_alive(self) -> bool:
        """Whether the engine is stepping (or waiting for work)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, float]:
        """The engine's counters and gauges (`LLMEngine.stats`), as of its last step."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine; requests still in it are dropped."""

    @abc.abstractmethod
    def _send(self, command: tuple) -> None:
        """Hand ("add", EngineRequest), ("abort", request_id), ("embed", ...) or ("lora", ...) to the engine."""

    def submit(self, request: EngineRequest) -> RequestStream:
        """Enqueue a validated request now (raising QueueFull, EngineDead or ValueError for a
        duplicate id at once, before any response is started); iterate the returned stream for
        its events. Must be called from the event loop that will consume the stream."""
        stream = self._open(request.request_id, request.params.n)
        self._send(("add", request))
        return stream

    def embed(self, request_id: str, prompts: list[list[int]]) -> RequestStream:
        """Ask for the embeddings of validated prompts; the stream yields one EmbeddingResult."""
        stream = self._open(request_id, 1)
        self._send(("embed", request_id, prompts))
        return stream

    def lora(self, request_id: str, op: str, name: str, path: str | None = None) -> RequestStream:
        """Load ("load", name, path) or unload ("unload", name) a LoRA adapter between steps; the
        stream yields one `LoRAResult`. Takes no queue capacity."""
        stream = self._open(request_id, 0)
        self._send(("lora", request_id, op, name, path))
        return stream

    def _open(self, request_id: str, num_seqs: int) -> RequestStream:
        if not self.is_alive:
            raise EngineDead("the engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), num_seqs)
        with self._lock:
            if sum(s.num_seqs for s in self._streams.values()) + num_seqs > self.capacity:
                raise QueueFull(f"the queue is full ({self.capacity} sequences); retry later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
        return RequestStream(self, request_id, stream.queue)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if self.is_alive:
            self._send(("abort", request_id))

    # ---- engine side ------------------------------------------------------------------------
    def deliver(self, items: Iterable[tuple[str, StepEvent | EmbeddingResult | LoRAResult | BaseException]]) -> None:
        """Hand one step's events (or a request's failure) to their streams, from any thread: one
        wake-up of each event loop per step, not one per event."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue  # aborted by its caller meanwhile
                if isinstance(item, BaseException) or item.request_finished:
                    del self._streams[request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def fail_all(self, exc: BaseException) -> list[str]:
        """Fail every request in flight with `exc` (the engine is gone); returns their ids."""
        with self._lock:
            ids = list(self._streams)
        self.deliver((request_id, exc) for request_id in ids)
        return ids

    def stop_all(self, exc: BaseException) -> int:
        """Fail every request in flight with `exc` and abort it in the engine (a server that stops
        before they finish); returns how many there were."""
        ids = self.fail_all(exc)
        if self.is_alive:
            for request_id in ids:
                self._send(("abort", request_id))
        return len(ids)


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


async def merge_events(gens: list[AsyncIterator[StepEvent]], streams: list[RequestStream]
                       ) -> AsyncIterator[tuple[int, StepEvent]]:
    """Interleave several requests' events (the n choices of one API request), tagged with the
    request's index; closing this iterator early aborts all of them."""
    try:
        if len(gens) == 1:
            async for ev in gens[0]:
                yield 0, ev
            return
        queue: asyncio.Queue = asyncio.Queue()
        done_marker = object()

        async def pump(i: int) -> None:
            try:
                async for ev in gens[i]:
                    queue.put_nowait((i, ev))
            except Exception as exc:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, done_marker))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens))]
        try:
            remaining = len(gens)
            while remaining:
                i, item = await queue.get()
                if item is done_marker:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for st in streams:
            st.abort()  # no-op for finished requests; frees the blocks of abandoned ones
