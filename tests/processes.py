"""For the tests that run real processes and signal them (serve, the engine process): wait for a
condition by polling with a generous deadline (a loaded 2-core machine can take seconds for what
takes milliseconds elsewhere; a fixed sleep is either flaky or slow), tell whether a process is
gone, and a private temporary folder whose path is short enough for the Unix sockets made in it
(at most 107 bytes; pytest's tmp_path can be longer)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil


def wait_until(condition: Callable[[], object], timeout: float = 60.0) -> bool:
    """Whether `condition()` became true within `timeout` seconds (polled every 50 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


def gone(process: int | psutil.Process) -> bool:
    """Whether the process has exited (a zombie not yet reaped by its parent counts as gone)."""
    try:
        proc = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@contextlib.contextmanager
def short_tmp() -> Iterator[Path]:
    """A private temporary folder under the system's, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="lmf-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
