"""The API process's side of the engine process (`EngineCoreClient`) on the ways a start ends
early: a failed start is its one line (and exit code) with no traceback from the engine's exit,
a second signal during the cleanup does not cut it short, and folders left by killed processes
are swept by the next start (only those: a live owner's stays)."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from processes import short_tmp

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine import core_client
from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec, sweep_abandoned_folders

pytestmark = pytest.mark.timeout(240)

FACTORIES = """
import atexit, os, signal, time
from lmfoundry.errors import UserError

def fail_then_exit_slowly(seconds):
    # the engine is still in its interpreter's exit when the API process hears why it failed
    atexit.register(time.sleep, seconds)
    raise UserError("the bundle's rank0/engine.json is not the one its engine.json records", exit_code=4)

def load_deaf(marker):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a load stuck in a C call: only SIGKILL ends it
    open(marker, "w").close()
    time.sleep(300)
"""


@pytest.fixture
def tmp(monkeypatch):
    """The temporary folder the client's folders go to."""
    with short_tmp() as folder:
        monkeypatch.setattr(tempfile, "tempdir", str(folder))
        yield folder


@pytest.fixture
def factories(tmp, monkeypatch):
    """A module of engine factories only this path finds (the engine process takes it)."""
    code = tmp / "code"
    code.mkdir()
    (code / "lmf_client_factories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.syspath_prepend(str(code))
    sys.modules.pop("lmf_client_factories", None)
    return importlib.import_module("lmf_client_factories")


@pytest.fixture
def started(monkeypatch):
    """The engine processes the clients start."""
    processes: list[subprocess.Popen] = []
    real = subprocess.Popen

    def recorded(*args, **kwargs):
        processes.append(real(*args, **kwargs))
        return processes[-1]

    monkeypatch.setattr(core_client.subprocess, "Popen", recorded)
    yield processes
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _engine_folders(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("lmfoundry-engine-*"))


def test_a_failed_start_is_its_line_and_exit_code_with_nothing_after_it(tmp, factories, started, capfd):
    """The engine said why it failed and is leaving; the client used to SIGTERM it at once, which
    landed in its exit ("Exception ignored in atexit callback ... SystemExit: 143" under serve's
    one-line error). It now lets the engine leave by itself."""
    with pytest.raises(UserError, match="rank0/engine.json is not the one") as failed:
        EngineCoreClient(EngineSpec(factories.fail_then_exit_slowly, (1.0,)))
    assert failed.value.exit_code == 4  # a bundle's failed check, as every verb exits with it
    (engine,) = started
    assert engine.returncode == 0  # left by itself, not by a signal
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert _engine_folders(tmp) == []


def test_a_second_signal_during_the_cleanup_does_not_cut_it_short(tmp, factories, started):
    """Ctrl-C while the model loads, and again while the client stops an engine that does not
    leave on SIGTERM: the second signal waits for the cleanup (SIGKILL after the grace, the folder
    removed), then is delivered. It used to end the cleanup, leaving the engine and its folder."""
    marker = tmp / "loading"
    first = threading.Event()

    def leave(signum, frame):
        first.set()
        raise SystemExit(128 + signum)

    def signal_twice() -> None:
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        if first.wait(30):
            time.sleep(0.5)  # inside the client's 2 s wait for the deaf engine
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, leave)
    sender = threading.Thread(target=signal_twice, daemon=True)
    try:
        sender.start()
        with pytest.raises(SystemExit):
            EngineCoreClient(EngineSpec(factories.load_deaf, (str(marker),)))
        sender.join(60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    (engine,) = started
    assert engine.poll() is not None  # killed and reaped, not left loading
    assert _engine_folders(tmp) == []


def _stale_socket(path: Path) -> None:
    """A Unix socket file nobody listens on any more (what a killed ZeroMQ bind leaves)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def test_folders_of_killed_processes_are_swept_and_only_those(tmp, factories):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp / f"lmfoundry-engine-{dead.pid}-abcd1234"
    abandoned.mkdir()
    _stale_socket(abandoned / "commands")
    live_owner = tmp / f"lmfoundry-engine-{os.getpid()}-live0000"  # this process: alive
    live_owner.mkdir()
    other_namespace = tmp / f"lmfoundry-engine-{dead.pid}-ns000000"  # a pid from elsewhere, socket answering
    other_namespace.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(other_namespace / "commands"))
    listener.listen(1)
    old_format = tmp / "lmfoundry-engine-q1w2e3r4"  # before the pid was in the name
    old_format.mkdir()
    young_old_format = tmp / "lmfoundry-engine-z9x8c7v6"
    young_old_format.mkdir()
    hour_ago = time.time() - 3600
    os.utime(old_format, (hour_ago, hour_ago))
    not_a_folder = tmp / f"lmfoundry-engine-{dead.pid}-file0000"
    not_a_folder.write_text("")
    try:
        assert sorted(sweep_abandoned_folders(str(tmp))) == sorted([abandoned, old_format])
    finally:
        listener.close()
    assert not abandoned.exists() and not old_format.exists()
    assert live_owner.is_dir() and other_namespace.is_dir() and young_old_format.is_dir() and not_a_folder.is_file()


def test_a_start_sweeps_what_killed_processes_left(tmp, factories, started):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    abandoned = tmp / f"lmfoundry-engine-{dead.pid}-abcd1234"
    abandoned.mkdir()
    with pytest.raises(UserError):
        EngineCoreClient(EngineSpec(factories.fail_then_exit_slowly, (0.0,)))
    assert _engine_folders(tmp) == []
