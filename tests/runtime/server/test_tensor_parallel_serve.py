"""`serve --tp 2` as a user runs it: requests are answered by the ranks together, and killing a
worker rank fails the request in flight with 503 and ends serve with a non-zero exit, not a hang."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import assert_one_error, post_in_background, run_cli, start_serve, stop_serve, wait_for_url
from toy import save_toy_checkpoint

pytestmark = pytest.mark.timeout(240)


def _worker_ranks(serve_pid: int) -> list[psutil.Process]:
    """The tensor-parallel worker processes under serve (engine process -> spawned ranks)."""
    return [p for p in psutil.Process(serve_pid).children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def test_serve_tp2_answers_and_a_lost_rank_is_503_and_exit(tmp_path) -> None:
    import glob

    shm_before = set(glob.glob("/dev/shm/lmfoundry-tp-*"))
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    # a context long enough that the request the kill lands in is still generating half a second
    # after it started (240 tokens of this toy model could finish first on a quiet machine)
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "4096", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify", "--tp", "2", "--threads", "2"])
    try:
        url = wait_for_url(proc).removesuffix("/v1")
        workers = _worker_ranks(proc.pid)
        assert len(workers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 16, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
        caller, result = post_in_background(f"{url}/v1/completions",
                                            {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
        time.sleep(0.5)
        workers[0].send_signal(signal.SIGKILL)
        caller.join(timeout=60)
        assert result["r"].status_code == 503, result["r"].text
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            stop_serve(proc)
    leftover = [p for p in psutil.process_iter(["cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or [])]
    assert not leftover, "processes of the killed server are still running"
    assert set(glob.glob("/dev/shm/lmfoundry-tp-*")) <= shm_before, "the lost group's shared memory stayed"


def test_serve_refuses_what_tp_cannot_run(tmp_path, capsys) -> None:
    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    for extra, needle in ((["--compile-step"], "drop it with --tp"), (["--device", "cuda"], "no CUDA GPU"),
                          ([], "--tp 3 does not divide the 4 attention heads")):
        code, _, err = run_cli(["serve", str(folder), "--tp", "3" if not extra else "2", "--skip-verify", "--port",
                                "0", *extra], capsys)
        assert_one_error(code, err, needle)


def test_killed_engine_leaves_no_shared_memory(tmp_path) -> None:
    """Killing the engine process (rank 0) outright: the worker notices, leaves, and removes the
    group's shared-memory folder that rank 0 had no chance to remove."""
    import glob

    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    before = set(glob.glob("/dev/shm/lmfoundry-tp-*"))
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify", "--tp", "2", "--threads", "2"])
    try:
        wait_for_url(proc)
        workers = _worker_ranks(proc.pid)
        engine = workers[0].parent()
        created = set(glob.glob("/dev/shm/lmfoundry-tp-*")) - before
        assert len(created) == 1
        engine.send_signal(signal.SIGKILL)
        workers[0].wait(timeout=30)
        assert not any(Path(f).exists() for f in created)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            stop_serve(proc)


def test_sigterm_to_every_process_leaves_nothing_behind(tmp_path) -> None:
    """A service manager stopping serve (systemd's default: SIGTERM to every process of the
    service's cgroup at once) reaches the engine process and the worker rank directly: both end
    through their cleanup, so no process and no shared-memory folder outlives the server. (Serve's
    process group alone, as a shell's kill -- -PGID sends, reaches serve only: the engine leads a
    group of its own; test_shutdown.py covers that.)"""
    import glob

    folder = save_toy_checkpoint(tmp_path / "toy", seed=2)
    before = set(glob.glob("/dev/shm/lmfoundry-tp-*"))
    proc = start_serve([str(folder), "--port", "0", "--max-model-len", "256", "--kv-cache-gb", "0.01",
                        "--dtype", "float32", "--skip-verify", "--tp", "2", "--threads", "2"], own_session=True)
    try:
        wait_for_url(proc)
        processes = psutil.Process(proc.pid).children(recursive=True)
        created = set(glob.glob("/dev/shm/lmfoundry-tp-*")) - before
        assert len(created) == 1 and len(_worker_ranks(proc.pid)) == 1
        for p in [psutil.Process(proc.pid), *processes]:
            p.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        psutil.wait_procs(processes, timeout=30)
        assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not any(Path(f).exists() for f in created), "the group's shared memory stayed"
    finally:
        if proc.poll() is None:
            stop_serve(proc)
