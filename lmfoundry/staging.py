"""The staging folders and files that builders of cache entries and bundles write into before one
rename puts the result in place, and the sweep of those a dead builder left behind.

A build's own cleanup (an exception, Ctrl-C, SIGTERM through `sigterm_raises`) removes its stage;
SIGKILL, the out-of-memory killer or a power cut run no cleanup at all, and their stage would stay
in the cache forever. So every stage is named `.<final name>.partial-<pid>-<random>`, and a later
builder in the same folder removes the stages whose process no longer exists. A live pid may be a
reused one: its stage is kept until that process is gone too, which costs disk, never a build.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_STAGE = re.compile(r"\.(?P<name>.+)\.partial-(?P<pid>\d+)-[0-9a-f]+")


def stage_path(final: Path) -> Path:
    """A fresh staging name beside `final` (same folder: the result is put in place by rename),
    carrying this process's id for `sweep_dead_stages`."""
    return final.parent / f".{final.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (another user's counts: it cannot be signalled, but it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # no process can have that id
        return False
    return True


def sweep_dead_stages(parent: Path, name: str | None = None) -> list[Path]:
    """Remove the stages in `parent` (only those of final name `name`, when given) whose builder
    process is gone; returns what was removed. Anything else in `parent` is left alone."""
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = _STAGE.fullmatch(entry.name)
        if m is None or (name is not None and m["name"] != name) or pid_alive(int(m["pid"])):
            continue
        remove(entry)
        removed.append(entry)
    return removed


def remove(path: Path) -> None:
    """Remove `path` whatever it is (a folder with its files; a file or link itself), as far as
    possible: what cannot be removed is left for a later sweep."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _leave(signum: int, _frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: a second SystemExit would cut the cleanup short
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM leaves through the caller's cleanup (SystemExit 143) instead of
    ending the process where it stands, so a build stopped by a service manager or by `serve`'s
    shutdown removes its stage. Off the main thread (where no handler can be set) a no-op; a
    handler the caller installed is kept."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, _leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
