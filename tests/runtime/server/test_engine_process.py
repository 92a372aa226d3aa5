"""The engine in a process of its own (`EngineCoreClient`, what `serve` runs): its death is a
503 and a non-zero exit, never a hang; the API process's death ends it; a failed start is one
line; `serve` steps with its --threads in the engine process."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import post_in_background, start_serve, stop_serve, wait_for_url
from toy import save_toy_checkpoint, toy_engine

from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec

pytestmark = pytest.mark.timeout(180)


def _wait(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_engine_death_fails_requests_in_flight_with_503(make_server) -> None:
    with make_server(step_delay=0.02) as live:
        caller, result = post_in_background(f"{live.url}/v1/completions",
                                            {"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        assert _wait(lambda: live.engine.stats()["requests_running"] > 0)
        os.kill(live.engine.pid, signal.SIGKILL)
        caller.join(timeout=30)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert "died" in r.json()["error"]["message"]
        assert httpx.get(f"{live.url}/health").status_code == 503
        again = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert again.status_code == 503


def test_failed_start_is_one_user_error() -> None:
    with pytest.raises(UserError, match="speculative"):
        EngineCoreClient(EngineSpec(toy_engine, kwargs=dict(speculative="bogus")))


def test_a_signal_while_the_engine_process_starts_still_stops_it(monkeypatch) -> None:
    """SIGTERM delivered while `subprocess.Popen` is starting the engine process (serve's handler
    raises to leave through the client's cleanup): the handler runs once Popen has returned the
    process, so the cleanup stops it and removes its folder instead of losing it."""
    import subprocess

    from lmfoundry.runtime.engine import core_client

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_interrupted(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        signal.raise_signal(signal.SIGTERM)  # arrives before Popen returns the child
        time.sleep(0.05)  # where the handler would run without the deferral
        return started[0]

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    monkeypatch.setattr(core_client.subprocess, "Popen", popen_interrupted)
    previous = signal.signal(signal.SIGTERM, leave)
    before = set(Path(tempfile.gettempdir()).glob("lmfoundry-engine-*"))
    try:
        with pytest.raises(SystemExit) as left:
            EngineCoreClient(EngineSpec(toy_engine))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert left.value.code == 128 + signal.SIGTERM
    assert started and started[0].poll() is not None  # stopped and reaped, not left loading
    assert set(Path(tempfile.gettempdir()).glob("lmfoundry-engine-*")) <= before


def test_engine_steps_in_its_own_process_and_leaves_with_the_api(tmp_path) -> None:
    """A streamed request is served by a child process; killing `serve` outright (no chance to
    shut the engine down) still ends the engine within seconds."""
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify"])
    try:
        url = wait_for_url(proc).removesuffix("/v1")
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1  # the engine process
        engine = children[0]
        cpu_before = engine.cpu_times().user
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 64, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64
        assert engine.cpu_times().user > cpu_before  # the forward passes ran there
        folders = {Path(a) for a in engine.cmdline()[1:] if a.startswith(tempfile.gettempdir())}
        assert len(folders) == 1 and next(iter(folders)).is_dir()  # the sockets' private folder
        proc.kill()
        proc.wait(10)
        assert _wait(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 15)
        assert _wait(lambda: not next(iter(folders)).exists(), 5)  # and it took its folder along
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_the_api_process_never_loads_torch(tmp_path) -> None:
    """Tokenizing, validating and compiling a grammar, detokenizing and streaming logprobs all run
    in the API process without torch, whose import alone would be most of its resident memory:
    the engine process decides everything that needs torch (`runtime.engine.serving.serving_engine`)."""
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify"])
    try:
        url = wait_for_url(proc)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True,
                "top_logprobs": 2, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}
        r = httpx.post(f"{url}/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["content"]
        with httpx.stream("POST", f"{url}/completions", timeout=60,
                          json={"prompt": "hello", "max_tokens": 8, "stream": True, "logprobs": 2}) as streamed:
            assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
        api_maps = Path(f"/proc/{proc.pid}/maps").read_text()
        engine_maps = Path(f"/proc/{psutil.Process(proc.pid).children()[0].pid}/maps").read_text()
        assert "libtorch" in engine_maps  # the check can see torch where it is loaded
        assert "libtorch" not in api_maps
    finally:
        if proc.poll() is None:
            stop_serve(proc)


def test_serve_exits_non_zero_when_the_engine_dies(tmp_path) -> None:
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify"])
    try:
        url = wait_for_url(proc).removesuffix("/v1")
        assert httpx.get(f"{url}/health").status_code == 200
        psutil.Process(proc.pid).children()[0].kill()
        code = proc.wait(30)
        out = proc.stdout.read()
        assert code == 1, out
        assert "error: the engine process died" in out
    finally:
        if proc.poll() is None:
            stop_serve(proc)


def test_the_engine_process_finds_a_factory_on_the_callers_path() -> None:
    """An EngineSpec may name a module importable only through the caller's sys.path (a test
    helper, a user's script folder): the engine process takes that path before the spec."""
    import helpers

    client = EngineCoreClient(EngineSpec(helpers.engine_outside_the_package, kwargs=dict(num_kv_blocks=16)))
    try:
        assert client.is_alive and client.info.vocab_size == 259
    finally:
        client.shutdown()
    assert client.process.returncode == 0
