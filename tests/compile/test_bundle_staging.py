"""`compile`'s staging folder (`.ENGINE.partial-PID-RANDOM`): a build stopped with SIGTERM removes
its own; one killed outright leaves it, and the next build of the same output removes it (a live
build's is kept, another output's is not touched)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmfoundry.compile import bundle
from lmfoundry.errors import UserError

DEAD_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above the kernel's maximum: no process

# build_engine with the kernel compilation replaced by a wait: the build is inside its stage when
# the test signals it
CHILD = """
import sys, time
from pathlib import Path
from lmfoundry.compile import bundle

def waiting(jobs, workers, cache, log_path, on_done=lambda r: None):
    Path(sys.argv[3]).touch()
    time.sleep(120)

bundle.run_jobs = waiting
bundle.build_engine(sys.argv[1], ["hopper"], sys.argv[2], progress=False)
"""


def stages(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name)


def test_a_sigterm_build_removes_its_stage(make_checkpoint, tmp_path) -> None:
    ckpt = make_checkpoint(weights=False)
    out, started = tmp_path / "out" / "engine", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(ckpt), str(out), str(started)],
                            env=dict(os.environ, PYTHONSAFEPATH="1", OMP_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), proc.stderr.read() if proc.poll() is not None else "the build did not start"
    assert len(stages(out.parent)) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert not (tmp_path / "out").exists()  # its stage, and the parent made for -o


def test_the_next_build_sweeps_a_killed_builds_stage(make_checkpoint, tmp_path, monkeypatch) -> None:
    out = tmp_path / "engine"
    dead = tmp_path / f".engine.partial-{DEAD_PID}-0a1b2c3d"
    (dead / "kernels").mkdir(parents=True)
    live = tmp_path / f".engine.partial-{os.getppid()}-4e5f6a7b"  # a running process: our parent
    live.mkdir()
    another = tmp_path / f".other-engine.partial-{DEAD_PID}-8c9d0e1f"  # another output's: not this build's
    another.mkdir()

    def failing(jobs, workers, cache, log_path, on_done=lambda r: None):
        Path(log_path).write_text("planted\n")
        return [{"id": j["id"], "ok": False, "error": "planted"} for j in jobs]

    monkeypatch.setattr(bundle, "run_jobs", failing)  # the stages are swept before any kernel is compiled
    with pytest.raises(UserError, match="planted") as err:
        bundle.build_engine(make_checkpoint(weights=False), ["hopper"], out, progress=False)
    Path(str(err.value).rsplit("details: ", 1)[1].rstrip(")")).unlink()
    assert stages(tmp_path) == sorted([live.name, another.name]) and not out.exists()
