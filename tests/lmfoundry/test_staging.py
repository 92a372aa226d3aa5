"""Staging names carry the builder's pid; the stages of dead builders are swept, a live builder's
(a pid that may be reused: kept all the same) and anything not named as a stage are left alone;
inside `sigterm_raises` a SIGTERM leaves through the caller's cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from lmfoundry import staging

DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above the kernel's maximum: no process


def test_dead_builders_stages_are_swept_live_ones_kept(tmp_path) -> None:
    final = tmp_path / "entry"
    mine = staging.stage_path(final)
    assert mine.parent == tmp_path and mine.name.startswith(f".entry.partial-{os.getpid()}-")
    mine.mkdir()
    dead_dir = tmp_path / f".entry.partial-{DEAD_PID}-0a1b2c"
    (dead_dir / "sub").mkdir(parents=True)
    dead_file = tmp_path / f".lib.so.partial-{DEAD_PID}-ff00"
    dead_file.write_bytes(b"half")
    other_entry = tmp_path / f".other.partial-{DEAD_PID}-abcd"
    other_entry.mkdir()
    untouched = [tmp_path / "entry", tmp_path / ".entry.lock", tmp_path / f".entry.partial-{DEAD_PID}",
                 tmp_path / f".entry.tmp-{DEAD_PID}-ab"]
    for p in untouched:
        p.mkdir()
    assert staging.sweep_dead_stages(tmp_path, "entry") == [dead_dir]  # only that entry's
    assert other_entry.is_dir() and dead_file.is_file()
    assert sorted(staging.sweep_dead_stages(tmp_path)) == sorted([dead_file, other_entry])
    assert mine.is_dir() and all(p.is_dir() for p in untouched)
    assert staging.sweep_dead_stages(tmp_path / "missing") == []


def test_pid_alive() -> None:
    assert staging.pid_alive(os.getpid()) and staging.pid_alive(1)  # pid 1: init, always there
    assert not staging.pid_alive(DEAD_PID) and not staging.pid_alive(2**80)


CHILD = """
import shutil, sys, time
from pathlib import Path
from lmfoundry.staging import sigterm_raises, stage_path
with sigterm_raises():
    stage = stage_path(Path(sys.argv[1]))
    try:
        stage.mkdir()
        print(stage, flush=True)
        time.sleep(60)
    except BaseException:
        shutil.rmtree(stage)
        raise
"""


def test_sigterm_leaves_through_the_cleanup(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "entry")], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    stage = Path(proc.stdout.readline().strip())
    assert stage.is_dir()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert not stage.exists()


def test_sigterm_raises_restores_the_default_and_keeps_a_callers_handler() -> None:
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    with staging.sigterm_raises():
        assert signal.getsignal(signal.SIGTERM) is staging._leave
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    def own(signum, frame):
        return None

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with staging.sigterm_raises():
            assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)
