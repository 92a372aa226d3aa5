"""Run an ASGI app with uvicorn in a background thread (tests, notebooks, in-process benchmarks)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import uvicorn


@contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> Iterator[str]:
    """Start `app` on host:port (0: a free port) and yield its base URL; stop it on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
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
