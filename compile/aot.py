"""A small pool of compile worker processes (`lmfoundry.compile.worker`) fed JSON jobs.

Why subprocesses with an explicit environment rather than multiprocessing: the workers must start
with `TRITON_INTERPRET` unset, line info disabled (byte-reproducible cubins) and a private Triton
cache — properties of the process environment, not of a function call. They import the installed
lmfoundry whatever the working directory (`lmfoundry.child_python`): from a checkout's root, `-m`
alone would import its bare `lmfoundry/` folder, which has no `compile` subpackage.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable

from lmfoundry.child_python import child_env, python_command

WORKER = python_command("lmfoundry.compile.worker")


def worker_env(cache_dir: Path) -> dict[str, str]:
    env = child_env()
    env.pop("TRITON_INTERPRET", None)
    env["TRITON_DISABLE_LINE_INFO"] = "1"
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_jobs(
    jobs: list[dict[str, Any]],
    workers: int,
    cache_dir: Path,
    log_path: Path,
    on_done: Callable[[dict[str, Any]], None] = lambda reply: None,
) -> list[dict[str, Any]]:
    """Compile every job on `workers` processes; replies in job order. Never raises for a job's
    own failure (its reply has ok=False); raises RuntimeError if a worker process dies."""
    todo: queue.Queue = queue.Queue()
    for job in jobs:
        todo.put(job)
    replies: dict[Any, dict[str, Any]] = {}
    lock = threading.Lock()
    errors: list[str] = []
    cache_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "a")

    def serve() -> None:
        proc = subprocess.Popen(WORKER, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=worker_env(cache_dir))
        assert proc.stdin is not None and proc.stdout is not None  # both are pipes
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    break
                proc.stdin.write(json.dumps(job) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    reply = {"id": job["id"], "ok": False, "error": f"compile worker died (see {log_path})"}
                    with lock:
                        errors.append(reply["error"])
                else:
                    reply = json.loads(line)
                with lock:
                    replies[job["id"]] = reply
                on_done(reply)
                if not line:
                    break
        finally:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=60)

    threads = [threading.Thread(target=serve, daemon=True) for _ in range(max(1, min(workers, len(jobs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    missing = [j["id"] for j in jobs if j["id"] not in replies]
    if missing:
        raise RuntimeError(f"{len(missing)} compile jobs got no answer ({'; '.join(errors) or 'workers exited'})")
    return [replies[j["id"]] for j in jobs]
