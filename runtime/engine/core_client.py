"""The engine in a process of its own (the layout of vLLM V1 and SGLang), and this process's
client of it.

The API process keeps HTTP, tokenization, validation and detokenization; the engine process
schedules and runs the forward passes in its main thread with all of `--threads` for intra-op
work, so neither waits for the other's Python. Commands ("add" a validated `EngineRequest`,
"abort", "shutdown") and each step's events cross two ZeroMQ PUSH/PULL sockets on Unix-domain
paths in a private temporary folder, pickled: both ends are this package, started by this
process.

If the engine process dies, every request in flight fails with `EngineDead` (HTTP 503), the
client reports not alive (/health 503) and calls `on_death`, which `serve` uses to stop with a
non-zero exit code. If the API process dies, the engine process is sent SIGTERM by the kernel
(started from the main thread: Linux's parent-death signal, asked for before the engine imports
anything heavy, `engine_process`) or notices within a second, and exits.

The private folder is named after the API process (`lmfoundry-engine-<pid>-*`): one whose owner
is gone and whose sockets no longer answer (an API process and its engine both killed outright)
is removed by the next client that starts (`sweep_abandoned_folders`).

The engine process leads a process group of its own, which its tensor-parallel ranks join: a
Ctrl-C or a SIGTERM to `serve`'s group reaches `serve` alone, which decides when the engine stops
(after draining), and `shutdown` can stop the engine and every rank in one signal when the
engine does not leave by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from lmfoundry.child_python import child_env, importable_path
from lmfoundry.errors import UserError
from lmfoundry.runtime.engine.client import EngineClient, EngineDead

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

POLL_MS = 1000  # the receiver thread looks at the engine process at least this often
TERM_GRACE_SECONDS = 2.0  # after SIGTERM, the engine's group gets this long before SIGKILL
FAILED_EXIT_SECONDS = 5.0  # an engine that said why it could not start gets this long to exit by itself
FOLDER_PREFIX = "lmfoundry-engine-"
LEGACY_FOLDER_AGE_SECONDS = 60.0  # a folder without its owner's pid is swept only once this old
# `python -c` puts the working directory first on sys.path; started from a checkout's root, its
# `kernels/` folder would shadow Hugging Face's `kernels` package, which transformers imports.
ENGINE_MAIN = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; "
    "from lmfoundry.runtime.engine.engine_process import engine_main; engine_main(sys.argv[1])"
)


@dataclass
class EngineSpec:
    """How the engine process builds its engine: a module-level callable and its arguments. They
    cross a process boundary (pickled; the process is spawned, not forked), so they must pickle."""

    factory: Callable[..., LLMEngine]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> LLMEngine:
        return self.factory(*self.args, **self.kwargs)


@contextlib.contextmanager
def signals_deferred(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the block runs, then deliver them to the handlers they had.

    serve's SIGTERM handler raises to leave through the client's cleanup. Raised inside
    `subprocess.Popen`, after the engine process was started but before Popen returned it, the
    exception would lose the only handle on that process: it outlived serve, loading the model,
    until it noticed its parent was gone, and its folder stayed. Handlers belong to the main
    thread; called from another one, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in signums}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


class EngineCoreClient(EngineClient):
    """Start the engine process for `spec` and wait until its engine is built (or raise the
    UserError it failed with). `on_death(exitcode)` is called from the receiver thread if the
    engine process ends while the client is open."""

    def __init__(self, spec: EngineSpec, on_death: Callable[[int | None], None] | None = None,
                 start_timeout: float | None = None) -> None:
        sweep_abandoned_folders(tempfile.gettempdir())
        self._on_death = on_death
        self._send_lock = threading.Lock()
        self._closing = False
        self._alive = False
        self._stats: dict[str, float] = {}
        self._exited: int | None = None
        self._said_failed = False
        try:
            # from the folder to the process that removes it too: a handler raising in between (inside
            # Popen, after the child started) would lose one of them
            with signals_deferred():
                self._start(spec)
            self._exited = _exit_fd(self.process.pid)
            info, tokenizer, stats = self._handshake(start_timeout)
        except BaseException:
            if hasattr(self, "process"):
                # An engine that said why it failed is leaving by itself: a signal now would land in
                # its cleanup (a finalizer, an exit callback) and print a traceback under the error.
                self._close(kill=not self._said_failed, timeout=FAILED_EXIT_SECONDS)
            else:  # nothing was started: what was made for it goes
                self._release()
            raise
        super().__init__(info.capacity)
        self.info, self.tokenizer, self._stats = info, tokenizer, stats
        self._alive = True
        self._receiver = threading.Thread(target=self._receive, name="lmfoundry-engine-outputs", daemon=True)
        self._receiver.start()

    def _start(self, spec: EngineSpec) -> None:
        """The private folder, the two sockets bound in it, the spec written there, then the engine
        process started on it."""
        import zmq

        self._dir = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")  # mode 0700: this user's sockets only
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # queue every command: a send fails only with no engine (`_send`)
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        with open(f"{self._dir}/spec.pickle", "wb") as f:
            # first: the spec may name a module only this path finds (less any checkout root, whose
            # bare lmfoundry/ and kernels/ folders would shadow installed packages there); the
            # parent-death signal is tied to the starting thread, so the engine asks for it only when
            # that is the main thread
            pickle.dump((importable_path(sys.path), os.getpid(), threading.current_thread() is threading.main_thread()),
                        f)
            pickle.dump(spec, f)
        # A fresh interpreter, not a fork (this process holds threads and OpenMP pools) and not
        # multiprocessing's spawn (which re-runs the caller's main script in the child).
        self.process = subprocess.Popen([sys.executable, "-c", ENGINE_MAIN, self._dir], env=child_env(),
                                        start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def is_alive(self) -> bool:
        return self._alive

    def stats(self) -> dict[str, float]:
        return self._stats

    def _handshake(self, timeout: float | None) -> tuple[Any, Any, dict[str, float]]:
        import zmq

        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        if self._exited is not None:
            poller.register(self._exited, zmq.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ready = dict(poller.poll(POLL_MS))
            if self._outputs in ready:
                message = self._outputs.recv_pyobj()
                if message[0] == "failed":
                    self._said_failed = True
                    raise UserError(message[1], exit_code=message[2])
                _, info, tokenizer, stats = message
                return info, tokenizer, stats
            if self.process.poll() is not None:
                raise UserError(f"the engine process exited while starting (exit code {self.process.returncode}); "
                                f"see its output above")
            if deadline is not None and time.monotonic() > deadline:
                raise UserError(f"the engine process did not start within {timeout:g} s")

    def _send(self, command: tuple) -> None:
        """Queue a command without blocking. With no engine connected (it has exited, and the
        receiver is about to fail every request in flight), a blocking send would wait forever."""
        import zmq

        with self._send_lock:
            if not self._closing:
                try:
                    self._commands.send_pyobj(command, zmq.NOBLOCK)
                except zmq.Again:
                    log.info("the engine process is not connected; %r dropped", command[0])

    def _receive(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        if self._exited is not None:
            poller.register(self._exited, zmq.POLLIN)
        while not self._closing:
            ready = dict(poller.poll(POLL_MS))
            if self._outputs in ready:
                self._drain()
            if self.process.poll() is not None:
                self._drain()  # what it sent before it went
                self._alive = False
                if not self._closing:
                    self._died()
                return

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                message = self._outputs.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            _, delivery, self._stats = message
            self.deliver(delivery)

    def _died(self) -> None:
        code = self.process.returncode
        log.error("the engine process died (exit code %s); failing the requests in flight", code)
        self.fail_all(EngineDead(f"the engine process died (exit code {code})"))
        if self._on_death is not None:
            self._on_death(code)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to exit (the requests still in it are dropped) and wait up to
        `timeout` seconds (it reads the request between steps); then stop its process group (see
        `_close`). Releases the sockets and the private folder."""
        if self._alive:
            self._send(("shutdown",))
        self._close(kill=False, timeout=timeout)

    def _close(self, kill: bool, timeout: float = 10.0) -> None:
        """Stop the engine process: wait `timeout` seconds for it to leave (unless `kill`), then
        SIGTERM its group (the engine and its ranks leave through their cleanup, freeing shared
        memory), SIGKILL after TERM_GRACE_SECONDS, and SIGKILL what is left of the group once it
        is gone (ranks, multiprocessing's resource tracker): nothing it started outlives it.

        SIGINT and SIGTERM are held back until it is done (`signals_deferred`): a handler that
        raises (serve's, Ctrl-C's) would cut the stop short and leave the engine and its folder."""
        with signals_deferred():
            self._stop(kill, timeout)

    def _stop(self, kill: bool, timeout: float) -> None:
        with self._send_lock:
            self._closing = True
        running = self.process.poll() is None  # only a group just stopped is signalled: its id is not reused yet
        if running and not kill:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within %g s; terminating it", timeout)
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(TERM_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within %g s of SIGTERM; killing it", TERM_GRACE_SECONDS)
                self._signal_group(signal.SIGKILL)
                self.process.wait(5)
        if running:
            self._signal_group(signal.SIGKILL)
        self._alive = False
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(POLL_MS / 1000 * 2)
        self._release()

    def _release(self) -> None:
        """Close the sockets and the exit descriptor and remove the private folder (whichever of
        them a start cut short had made)."""
        for sock in (getattr(self, "_commands", None), getattr(self, "_outputs", None)):
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
        if self._exited is not None:
            os.close(self._exited)
            self._exited = None
        if getattr(self, "_dir", None) is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            pass


def sweep_abandoned_folders(parent: str) -> list[Path]:
    """Remove the engine folders in `parent` left by API processes that were killed with their
    engine (SIGKILL to both, out of memory): this user's `lmfoundry-engine-<pid>-*` folders whose
    pid is gone and whose command socket no longer accepts a connection (pid namespaces may share
    a temporary directory; a live client's socket always answers). Folders of the format before
    the pid (`lmfoundry-engine-<random>`) are removed on the socket's word alone once older than
    LEGACY_FOLDER_AGE_SECONDS. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).glob(f"{FOLDER_PREFIX}*"))
    except OSError:
        return removed
    for folder in entries:
        try:
            info = folder.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        owner = re.fullmatch(rf"{FOLDER_PREFIX}(\d+)-.+", folder.name)
        if owner is not None:
            if _pid_exists(int(owner[1])):
                continue
        elif time.time() - info.st_mtime < LEGACY_FOLDER_AGE_SECONDS:
            continue
        if _accepts(folder / "commands"):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def _accepts(path: Path) -> bool:
    """Whether a process listens on Unix socket `path` (a bound ZeroMQ ipc endpoint does)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:  # refused (nobody listens), missing, or not a socket
            return False
    return True


def _exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when process `pid` exits (Linux's pidfd), so the
    receiver wakes at once; None where there is none (then it looks every POLL_MS)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
