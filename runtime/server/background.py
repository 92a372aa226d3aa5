"""uvicorn settings shared by `lmfoundry serve` and in-thread servers (tests, notebooks,
in-process benchmarks), and a runner for the latter.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no deadline for a
request's headers: a client that connects and sends nothing, or half a request line, holds its
connection forever. `header_deadline_protocol` adds one (nginx's client_header_timeout); the app
bounds the body's arrival itself (`create_app(read_timeout=...)`).

Stopping: uvicorn's own shutdown waits for the connections in flight up to a timeout and then
cancels them, which drops a stream without a word, and after a SIGTERM it raises the signal again,
which kills the process before it can stop its engine. `GracefulServer` stops in a bounded drain
instead (see its docstring).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Awaitable, Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, then again for its body
DEFAULT_KEEP_ALIVE = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
LINGER_SECONDS = 10.0  # at most this long discarding a closed request's upload (nginx: lingering_time)
LINGER_QUIET_SECONDS = 2.0  # ... and closed sooner after this long without data (lingering_timeout)
DEFAULT_SHUTDOWN_TIMEOUT = 15.0  # seconds the requests in flight may still run once a stop is asked
# Seconds the failed requests' last bytes (an error body, a final SSE event) get to reach their
# clients after the drain, and then again for uvicorn to close the connections left.
RESPONSE_GRACE_SECONDS = 2.0

Drain = Callable[[float, Callable[[], bool]], Awaitable[Any]]


class _LingeringTransport:
    """The connection's transport, whose `close` half-closes and lets the protocol discard what
    the client still sends before the real close (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 client_sending: Callable[[], bool]) -> None:
        self._transport = transport
        self._loop = loop
        self._client_sending = client_sending
        self.lingering = False
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        if not (self._client_sending() and self._transport.can_write_eof()):
            self._transport.close()  # nothing more is coming (an idle keep-alive, shutdown): close now
            return
        self.lingering = True
        self._transport.write_eof()  # sent after what is still buffered: the response arrives whole
        self._transport.resume_reading()  # uvicorn pauses reading while a request body is unread
        self._deadline = self._loop.time() + LINGER_SECONDS
        self.heard()

    def heard(self) -> None:
        """Data arrived while lingering: wait up to the quiet period more, within the deadline."""
        if self._timer is not None:
            self._timer.cancel()
        delay = min(LINGER_QUIET_SECONDS, self._deadline - self._loop.time())
        self._timer = self._loop.call_later(max(delay, 0.0), self._transport.close)

    def abort(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport.abort()

    def connection_lost(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all
    arrived `header_timeout` seconds after it opened or after its previous response, and closing
    lingeringly (`_LingeringTransport`)."""

    header_timeout = DEFAULT_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(  # type: ignore[assignment]
            transport, self.loop, lambda: self.conn.their_state in (h11.SEND_BODY, h11.ERROR))
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:  # type: ignore[attr-defined]
            self.transport.heard()  # type: ignore[attr-defined]
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self.transport.connection_lost()  # type: ignore[attr-defined]
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        # h11 leaves IDLE once a request's headers are complete; a request in flight is left alone.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """The h11 protocol class with a deadline of `header_timeout` seconds for request headers."""
    return type("H11WithHeaderDeadline", (_HeaderDeadlineH11,), {"header_timeout": header_timeout})


def uvicorn_config(app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "error",
                   read_timeout: float = DEFAULT_READ_TIMEOUT, keep_alive: float = DEFAULT_KEEP_ALIVE,
                   **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config with the header deadline and keep-alive timeout; `kwargs` go to uvicorn."""
    kwargs.setdefault("timeout_graceful_shutdown", RESPONSE_GRACE_SECONDS)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=header_deadline_protocol(read_timeout),
                          timeout_keep_alive=keep_alive, **kwargs)  # type: ignore[arg-type]


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, stopping in a bounded drain. On the first SIGINT or SIGTERM (or
    `should_exit`) it stops accepting connections and awaits `drain(shutdown_timeout, forced)`:
    the app refuses new requests, lets those in flight finish within the timeout and fails the
    rest with an error their clients see (`OpenAIServer.drain`). The failed responses then get
    RESPONSE_GRACE_SECONDS to be written before uvicorn closes what is left (bounded as well). A
    second signal of either kind ends the drain at once; later ones change nothing. Unlike uvicorn,
    it does not raise the signal again once `run()` returns: the caller still has its engine to
    stop; `stop_signal` says what stopped it."""

    def __init__(self, config: uvicorn.Config, drain: Drain | None = None,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self.stop_signal: int | None = None
        self._end_drain = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.should_exit:
            self._end_drain = True  # not uvicorn's force_exit, which would skip the app's lifespan end
        self.should_exit = True

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()  # no new connections; keep-alive ones get 503 from the app meanwhile
        if self.drain is not None:
            await self.drain(self.shutdown_timeout, lambda: self._end_drain)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESPONSE_GRACE_SECONDS
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def app_drain(app: Any) -> Drain | None:
    """The drain of an app made by `create_app` (None for another app)."""
    return getattr(getattr(getattr(app, "state", None), "server", None), "drain", None)


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                    read_timeout: float = DEFAULT_READ_TIMEOUT, keep_alive: float = DEFAULT_KEEP_ALIVE,
                    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> Iterator[str]:
    """Start `app` on host:port (0: a free port) and yield its base URL; stop it on exit (with
    the drain `GracefulServer` runs, of at most `shutdown_timeout` seconds)."""
    server = GracefulServer(uvicorn_config(app, host, port, read_timeout=read_timeout, keep_alive=keep_alive),
                            app_drain(app), shutdown_timeout)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()
    try:
        yield f"http://{host}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
