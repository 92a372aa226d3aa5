"""uvicorn settings shared by `lmfoundry serve` and in-thread servers (tests, notebooks,
in-process benchmarks), and a runner for the latter.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no deadline for a
request's headers: a client that connects and sends nothing, or half a request line, holds its
connection forever. `header_deadline_protocol` adds one (nginx's client_header_timeout); the app
bounds the body's arrival itself (`create_app(read_timeout=...)`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, then again for its body
DEFAULT_KEEP_ALIVE = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
LINGER_SECONDS = 10.0  # at most this long discarding a closed request's upload (nginx: lingering_time)
LINGER_QUIET_SECONDS = 2.0  # ... and closed sooner after this long without data (lingering_timeout)


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
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=header_deadline_protocol(read_timeout),
                          timeout_keep_alive=keep_alive, **kwargs)  # type: ignore[arg-type]


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                    read_timeout: float = DEFAULT_READ_TIMEOUT, keep_alive: float = DEFAULT_KEEP_ALIVE
                    ) -> Iterator[str]:
    """Start `app` on host:port (0: a free port) and yield its base URL; stop it on exit."""
    server = uvicorn.Server(uvicorn_config(app, host, port, read_timeout=read_timeout, keep_alive=keep_alive))
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
