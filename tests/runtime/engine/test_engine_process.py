"""The engine process's own start and end (`engine_process`): it ties its life to the API process
before it imports anything heavy, takes its group along when the API process is killed, and a
signal's exit is neither lost in a finalizer nor a traceback. Each case runs real processes."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from processes import gone, wait_until
from processes import short_tmp as short_tmp_folder

from lmfoundry.child_python import child_env
from lmfoundry.runtime.engine.core_client import ENGINE_MAIN

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")]


@pytest.fixture
def short_tmp():
    with short_tmp_folder() as folder:
        yield folder


class MarksWhenLoaded:
    """Unpickled, it creates `path`: where it stands in spec.pickle, the engine has read its spec
    (and, for a real spec, imported the model code and torch)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def test_an_engine_whose_api_process_is_gone_stops_before_it_reads_its_spec(short_tmp):
    """A killed `serve` left its engine loading the model for seconds (until it had imported
    torch and read its spec); now the parent-death check comes first."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = short_tmp / "lmfoundry-engine-x"
    folder.mkdir()
    with open(folder / "spec.pickle", "wb") as f:
        pickle.dump(([], gone.pid, True), f)
        pickle.dump(MarksWhenLoaded(short_tmp / "spec-was-read"), f)
    engine = subprocess.run([sys.executable, "-c", ENGINE_MAIN, str(folder)], env=child_env(), capture_output=True,
                            text=True, timeout=120)
    assert engine.returncode == 128 + signal.SIGTERM, engine.stderr
    assert not (short_tmp / "spec-was-read").exists()
    assert not folder.exists()
    assert engine.stderr == ""


API = """
import sys
sys.path.append({factories!r})
from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec
import lmf_test_factories
EngineCoreClient(EngineSpec(lmf_test_factories.load_forever, ({marker!r},)))
"""
FACTORIES = """
import subprocess, sys, time

def load_forever(marker):
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a rank, a compile child
    with open(marker, "w") as f:
        f.write(str(helper.pid))
    time.sleep(300)
"""


def test_killing_the_api_process_while_the_engine_loads_takes_the_engine_and_its_group(short_tmp):
    """SIGKILL to the API process while the engine builds (a child of the engine's running):
    the parent-death signal ends the engine through its cleanup, and the engine passes it on to
    its process group, so the child goes too; the engine's folder goes with it."""
    (short_tmp / "lmf_test_factories.py").write_text(textwrap.dedent(FACTORIES))
    marker = short_tmp / "helper-pid"
    tmp = short_tmp / "tmp"
    tmp.mkdir()
    api = subprocess.Popen([sys.executable, "-c", API.format(factories=str(short_tmp), marker=str(marker))],
                           env=dict(child_env(), TMPDIR=str(tmp), OMP_NUM_THREADS="1"))
    started = [api.pid]
    try:
        assert wait_until(lambda: marker.exists() and marker.read_text(), 120), "the engine never built"
        helper = int(marker.read_text())
        (engine,) = psutil.Process(api.pid).children()
        started += [engine.pid, helper]
        assert [p.name for p in tmp.iterdir()] and all(p.name.startswith(f"lmfoundry-engine-{api.pid}-")
                                                       for p in tmp.iterdir())
        api.kill()
        api.wait(30)
        assert wait_until(lambda: gone(engine.pid), 30), "the engine outlived the API process"
        assert wait_until(lambda: gone(helper), 30), "the engine's child outlived it"
        assert wait_until(lambda: not any(tmp.iterdir()), 10)
    finally:
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


SWALLOWED = """
import sys, time
from lmfoundry.runtime.engine import engine_process
engine_process.take_signals()

class Slow:
    def __del__(self):
        print("in finalizer", flush=True)
        time.sleep(20)  # the signal lands here; a finalizer cannot raise

obj = Slow()
del obj
print("after the finalizer", flush=True)
time.sleep(60)
print("not stopped", flush=True)
"""


def test_a_signal_during_a_finalizer_still_ends_the_process_without_a_traceback():
    """The signal's SystemExit raised inside a finalizer is swallowed ("Exception ignored in ...")
    and the process would go on; it is raised again once the finalizer has returned."""
    proc = subprocess.Popen([sys.executable, "-c", SWALLOWED], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in finalizer\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM  # not after its minute of sleep
        out, err = proc.communicate()
        assert "not stopped" not in out
        assert err == ""
    finally:
        if proc.poll() is None:
            proc.kill()


NOTICE_WHILE_THE_PARENT_LOOKS_ALIVE = """
import os, subprocess, sys, time
from lmfoundry.runtime.engine import engine_process
engine_process.take_signals()
engine_process._api_pid.append(os.getppid())  # the parent is alive: getppid() says nothing yet
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(helper.pid, flush=True)
try:
    os.kill(os.getpid(), engine_process.PARENT_DEATH_SIGNAL)
    time.sleep(60)
finally:
    print("cleaned up", flush=True)
"""


def test_the_parent_death_notice_takes_the_group_even_while_the_parent_looks_alive():
    """A killed multi-threaded API process hands its children to one of its threads still exiting,
    so `getppid()` can name it when the parent-death signal lands (CI saw the group outlive the
    engine that way). The notice is its own signal: it takes the group whatever getppid() says."""
    proc = subprocess.Popen([sys.executable, "-c", NOTICE_WHILE_THE_PARENT_LOOKS_ALIVE], env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    helper = 0
    try:
        out, err = proc.communicate(timeout=60)
        helper = int(out.split()[0])
        assert proc.returncode == 128 + signal.SIGTERM
        assert out == f"{helper}\ncleaned up\n" and err == ""
        assert wait_until(lambda: gone(helper), 30), "the engine's child outlived the notice"
    finally:
        for pid in filter(None, (proc.pid, helper)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
