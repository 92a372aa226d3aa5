"""Issue 46: stopping `serve` with SIGTERM or SIGINT, as a user or a service manager does.

| case                                    | before                                     | after                                        |
|-----------------------------------------|--------------------------------------------|----------------------------------------------|
| SIGTERM during a long prefill           | stream dropped without an error; engine    | final SSE error event, exit 0 within the     |
|                                         | process and its /tmp folder outlive serve  | bound, no process or folder left             |
| SIGTERM during decode (stream + whole   | both dropped                               | the drain lets them run; a second signal     |
| response)                               |                                            | fails them: error event / HTTP 503           |
| SIGTERM, drain long enough              | stream cut after 5 s                       | the stream finishes; meanwhile new requests  |
|                                         |                                            | and /health get 503                          |
| SIGINT / SIGTERM while idle             | exit 1 ("Aborted") / killed by the signal  | exit 0, nothing left                         |
| SIGTERM while the model loads           | serve gone, engine process orphaned        | engine stopped, folder removed, exit 143     |
| SIGTERM to a busy `serve --tp 2`        | engine and rank alive after serve exited   | error event, every process and the shared    |
|                                         |                                            | memory gone when serve exits                 |
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from helpers import start_serve, wait_for_url
from toy import save_toy_checkpoint

from lmfoundry.runtime.engine.core_client import TERM_GRACE_SECONDS
from lmfoundry.runtime.server.api_process import ENGINE_STOP_SECONDS, STOP_BOUND_SECONDS
from lmfoundry.runtime.server.background import RESPONSE_GRACE_SECONDS

pytestmark = pytest.mark.timeout(240)

SERVE = ["--port", "0", "--kv-cache-gb", "0.05", "--dtype", "float32", "--skip-verify"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    return save_toy_checkpoint(tmp_path_factory.mktemp("toy") / "toy", seed=2)


class Serve:
    """A `serve` subprocess, the processes and temporary folders it started, and its URL."""

    def __init__(self, args: list[str]) -> None:
        self.proc = start_serve(args)
        self.url = wait_for_url(self.proc).removesuffix("/v1")
        self.tree = psutil.Process(self.proc.pid).children(recursive=True)
        self.folders = [Path(a) for p in self.tree for a in p.cmdline() if a.startswith("/tmp/lmfoundry-engine-")]
        # a tensor-parallel group's shared memory, as its processes map it (other test runs may
        # create folders of their own meanwhile)
        self.folders += {Path(m.path).parent for p in self.tree for m in p.memory_maps()
                         if m.path.startswith("/dev/shm/lmfoundry-tp-")}
        assert self.folders and all(f.is_dir() for f in self.folders)

    def stop(self, signum: int = signal.SIGTERM) -> float:
        """Signal serve alone; return the seconds it took to exit (exit code 0)."""
        start = time.monotonic()
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=120)
        took = time.monotonic() - start
        output = self.proc.stdout.read()
        assert code == 0 and "Traceback" not in output, output
        return took

    def assert_nothing_left(self) -> None:
        """Checked the moment serve has exited: no process it started runs, no folder remains."""
        alive = [p for p in self.tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [p.cmdline() for p in alive]
        assert not [f for f in self.folders if f.exists()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


class Stream(threading.Thread):
    """A streamed completion read in the background: its SSE data lines, and an event set once the
    response has started (the request is in the engine) and once its first token arrived."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__()
        self.url, self.body = url, {**body, "stream": True}
        self.lines: list[str] = []
        self.started, self.first_token = threading.Event(), threading.Event()
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
            self.status = r.status_code
            self.started.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.lines.append(line[6:])
                    if '"text"' in line:
                        self.first_token.set()

    @property
    def tokens(self) -> int:
        return sum(1 for line in self.lines if '"text"' in line)

    def ending(self) -> tuple[Any, str]:
        """(the last chunk before [DONE] as JSON, the last line)."""
        return json.loads(self.lines[-2]), self.lines[-1]


def assert_shutdown_error(stream: Stream) -> None:
    last, done = stream.ending()
    assert done == "[DONE]" and last["error"]["code"] == "server_shutting_down", stream.lines[-3:]


@pytest.mark.slow
def test_sigterm_during_a_long_prefill(tmp_path) -> None:
    """A 4000-token prompt in one step of a wider model takes seconds: the signal lands inside it.
    The stream's client gets a final error event at the end of the drain, without waiting for the
    step; the engine is stopped (the shutdown request waits for the step, SIGTERM does not)."""
    wide = save_toy_checkpoint(tmp_path / "wide", seed=1, hidden_size=512, intermediate_size=2048,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                               max_position_embeddings=8192)
    timeout = 0.5
    serve = Serve([str(wide), *SERVE, "--kv-cache-gb", "0.2", "--max-model-len", "4200",
                   "--max-num-batched-tokens", "4096", "--shutdown-timeout", str(timeout)])
    try:
        stream = Stream(serve.url, {"prompt": "a" * 4000, "max_tokens": 4})
        assert stream.started.wait(60) and stream.status == 200
        time.sleep(0.5)
        took = serve.stop()
        stream.join(30)
        assert stream.tokens == 0  # still in its prefill when stopped
        assert_shutdown_error(stream)
        assert took < timeout + STOP_BOUND_SECONDS, took
        serve.assert_nothing_left()
    finally:
        serve.kill()


def test_sigterm_during_decode_drains_then_a_second_signal_fails_the_rest(toy) -> None:
    """During the drain the requests keep running (the stream keeps receiving tokens); a second
    SIGTERM ends it: the stream gets a final error event, the whole-response request a 503."""
    serve = Serve([str(toy), *SERVE, "--max-model-len", "4096", "--shutdown-timeout", "60"])
    try:
        stream = Stream(serve.url, {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True})
        whole: dict = {}
        caller = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
            f"{serve.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}, timeout=120)))
        caller.start()
        assert stream.first_token.wait(60)
        serve.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        during = stream.tokens
        time.sleep(0.5)
        assert stream.tokens > during  # still decoding while draining
        took = serve.stop(signal.SIGTERM)
        stream.join(30)
        caller.join(30)
        assert_shutdown_error(stream)
        assert stream.tokens < 4000
        r = whole["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
        assert took < STOP_BOUND_SECONDS, took
        serve.assert_nothing_left()
    finally:
        serve.kill()


@pytest.mark.slow
def test_a_drain_long_enough_lets_the_stream_finish(toy) -> None:
    """Requests in flight finish normally; meanwhile a new request on a kept-alive connection and
    /health get 503 (the listening socket is closed already); serve exits once the stream is done,
    long before its 60 s drain would end."""
    serve = Serve([str(toy), *SERVE, "--max-model-len", "2048", "--shutdown-timeout", "60"])
    try:
        with httpx.Client(base_url=serve.url, timeout=60) as client:
            assert client.get("/health").status_code == 200  # this connection stays open
            stream = Stream(serve.url, {"prompt": "hello", "max_tokens": 800, "ignore_eos": True})
            assert stream.first_token.wait(60)
            start = time.monotonic()
            serve.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            health = client.get("/health")
        assert stream.is_alive()  # the refusals came while the stream still ran
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert health.status_code == 503 and health.json()["status"] == "shutting down"
        stream.join(60)
        chunks = [json.loads(line) for line in stream.lines[:-1]]
        assert stream.lines[-1] == "[DONE]" and not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert serve.proc.wait(60) == 0 and time.monotonic() - start < 60
        serve.assert_nothing_left()
    finally:
        serve.kill()


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_idle(toy, signum: int) -> None:
    serve = Serve([str(toy), *SERVE, "--max-model-len", "256"])
    try:
        assert serve.stop(signum) < STOP_BOUND_SECONDS
        serve.assert_nothing_left()
    finally:
        serve.kill()


def test_sigterm_while_the_model_loads(toy) -> None:
    """Before the server listens, SIGTERM ends serve through the engine client's cleanup: the
    engine process it had started is stopped and its folder removed (exit 143, 128 + SIGTERM)."""
    proc = start_serve([str(toy), *SERVE, "--max-model-len", "256"])
    try:
        deadline, folders = time.monotonic() + 60, []
        while not folders and time.monotonic() < deadline:  # the engine process, once it has exec'd
            time.sleep(0.02)
            for engine in psutil.Process(proc.pid).children():
                folders = [Path(a) for a in engine.cmdline() if a.startswith("/tmp/lmfoundry-engine-")]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "serving on" not in proc.stdout.read()  # stopped while loading, not after
        assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
        assert folders and not any(f.exists() for f in folders)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_to_a_busy_tensor_parallel_serve(toy) -> None:
    """Engine, worker rank, resource tracker: all gone when serve exits, and the group's shared
    memory too; the stream in flight ends with an error event."""
    serve = Serve([str(toy), *SERVE, "--max-model-len", "4096", "--tp", "2", "--threads", "2",
                   "--shutdown-timeout", "0.5"])
    try:
        assert len(serve.tree) >= 2 and any(str(f).startswith("/dev/shm/") for f in serve.folders)
        stream = Stream(serve.url, {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True})
        assert stream.first_token.wait(60)
        took = serve.stop()
        stream.join(30)
        assert_shutdown_error(stream)
        assert took < 0.5 + STOP_BOUND_SECONDS, took
        serve.assert_nothing_left()
    finally:
        serve.kill()


def test_the_documented_bound_covers_every_wait_of_the_stop() -> None:
    """After the drain: the responses' grace, uvicorn's own close, the engine's stop, SIGTERM's
    grace, and a second for the SIGKILL and the exit."""
    assert 2 * RESPONSE_GRACE_SECONDS + ENGINE_STOP_SECONDS + TERM_GRACE_SECONDS + 1 <= STOP_BOUND_SECONDS
