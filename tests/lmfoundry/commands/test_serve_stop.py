"""Issue 57: every way `serve` stops leaves no process and no engine folder.

| case                                        | before                                      | after                                     |
|---------------------------------------------|---------------------------------------------|-------------------------------------------|
| SIGINT while the model loads, SIGINT        | ignored: serve loaded and served on, engine | one line "stopped by SIGINT", exit 130,   |
| inherited ignored (a shell's `serve &`)     | and folder with it                          | nothing left                              |
| SIGTERM while the model loads               | exit 143 without a word                     | one line "stopped by SIGTERM", exit 143   |
| SIGTERM, then SIGINT and SIGTERM again      | a signal in the cleanup cut it short        | nothing left                              |
| SIGKILL to serve while the model loads      | the engine loaded on for seconds            | the engine leaves at once, and its folder |
| SIGTERM while a request drains              | (a folder reported left)                    | exit 0, the request complete, nothing left|

Each runs `serve` as a user does, with TMPDIR a private folder, so that another run's engine
folders are never taken for this one's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import post_in_background, wait_for_url
from processes import gone, short_tmp, wait_until
from toy import save_toy_checkpoint

pytestmark = pytest.mark.timeout(300)

SERVE = ["--port", "0", "--kv-cache-gb", "0.05", "--dtype", "float32", "--skip-verify", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy") / "toy", seed=2)


@pytest.fixture
def tmp():
    """serve's TMPDIR."""
    with short_tmp() as folder:
        yield folder


class Serve:
    """`lmfoundry serve` in a subprocess (stderr merged into stdout), and what it started."""

    def __init__(self, toy: Path, tmp: Path, ignore_sigint: bool = False) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp))
        cmd = [sys.executable, "-m", "lmfoundry.cli", "serve", str(toy), *SERVE]
        if ignore_sigint:  # what `serve ... &` in a shell script does: SIGINT ignored, inherited
            cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.tmp = tmp
        self.engine: psutil.Process | None = None

    def wait_for_engine(self) -> psutil.Process:
        """The engine process, as soon as it exists (the model is then loading)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            children = [p for p in psutil.Process(self.proc.pid).children() if "engine_main" in " ".join(p.cmdline())]
            if children:
                self.engine = children[0]
                return self.engine
            time.sleep(0.01)
        raise AssertionError("serve started no engine process")

    def output(self) -> str:
        return self.proc.stdout.read()

    def assert_nothing_left(self) -> None:
        assert self.engine is not None
        assert wait_until(lambda: gone(self.engine), 30), "the engine process outlived serve"
        assert wait_until(lambda: not list(self.tmp.glob("lmfoundry-*")), 30), list(self.tmp.iterdir())

    def kill(self) -> None:
        """What is left of a failed test's processes."""
        if self.proc.poll() is None:
            self.proc.kill()
        if self.engine is not None and not gone(self.engine):
            self.engine.kill()


def _one_stop_line(out: str, signame: str) -> None:
    assert "serving on" not in out and "Traceback" not in out and "Exception ignored" not in out, out
    assert [line for line in out.splitlines() if "stopped" in line] == [
        f"stopped by {signame} before serving: the engine process and its folder are gone"], out


@pytest.mark.parametrize("signum, ignored", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT-inherited-ignored"])
def test_a_signal_while_the_model_loads_stops_serve_in_one_line(toy, tmp, signum, ignored) -> None:
    serve = Serve(toy, tmp, ignore_sigint=ignored)
    try:
        serve.wait_for_engine()
        serve.proc.send_signal(signum)
        assert serve.proc.wait(60) == 128 + signum
        _one_stop_line(serve.output(), signal.Signals(signum).name)
        serve.assert_nothing_left()
    finally:
        serve.kill()


def test_signals_again_during_the_stop_leave_nothing(toy, tmp) -> None:
    serve = Serve(toy, tmp)
    try:
        serve.wait_for_engine()
        serve.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        serve.proc.send_signal(signal.SIGINT)
        serve.proc.send_signal(signal.SIGTERM)
        code = serve.proc.wait(60)
        # the stop's line, or, a signal landing after the cleanup, that signal's own end
        assert code in (128 + signal.SIGTERM, -signal.SIGTERM, -signal.SIGINT), code
        assert "Traceback" not in serve.output()
        serve.assert_nothing_left()
    finally:
        serve.kill()


def test_sigkill_while_the_model_loads_takes_the_engine_and_its_folder(toy, tmp) -> None:
    serve = Serve(toy, tmp)
    try:
        engine = serve.wait_for_engine()
        serve.proc.kill()
        serve.proc.wait(30)
        assert wait_until(lambda: gone(engine), 30), "the engine outlived a killed serve"
        assert wait_until(lambda: not list(tmp.glob("lmfoundry-engine-*")), 10)
    finally:
        serve.kill()


def test_sigterm_while_a_request_drains_completes_it_and_leaves_nothing(toy, tmp) -> None:
    serve = Serve(toy, tmp)
    try:
        url = wait_for_url(serve.proc).removesuffix("/v1")
        serve.wait_for_engine()
        caller, result = post_in_background(f"{url}/v1/completions",
                                            {"prompt": "x", "max_tokens": 800, "ignore_eos": True}, timeout=120)
        running = re.compile(r"^lmfoundry_num_requests_running\{[^}]*\} 1\.0$", re.M)
        assert wait_until(lambda: running.search(httpx.get(f"{url}/metrics").text) is not None, 30)
        serve.proc.send_signal(signal.SIGTERM)
        caller.join(120)
        assert serve.proc.wait(60) == 0
        r = result["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 800, r.text
        serve.assert_nothing_left()
    finally:
        serve.kill()
