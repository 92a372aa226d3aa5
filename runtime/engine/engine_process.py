"""The engine process's first and last steps, around the engine itself (`core.run_engine_core`).

The API process (`core_client.EngineCoreClient`) starts `python -c ENGINE_MAIN FOLDER`. Before
anything heavy is imported (torch and the model code take seconds), this module takes the
process's signals and ties its life to the API process's, so that there is no window in which a
killed `serve` leaves an engine loading a model for nobody:

- SIGTERM leaves through the cleanup (`SystemExit`), once; SIGINT is ignored (the API process
  decides when the engine stops). With the API process gone, SIGTERM is passed on to the process
  group the engine leads (its tensor-parallel ranks, a compile child), as `serve` does when it
  stops the engine itself.
- Linux's parent-death signal is asked for at once, as SIGHUP (the engine leads its own session:
  no terminal sends it one), which says "the API process is gone" and nothing else. Not SIGTERM
  plus a look at `getppid()`: a multi-threaded API process that dies first hands its children to
  one of its threads still exiting, so the parent can look alive when the signal lands. The
  engine's idle loop also checks its parent (`core.PARENT_CHECK_MS`).
- Whatever ends the engine, its folder (sockets, spec) is removed; past that cleanup a SIGTERM
  ends the process where it stands: nothing of it is left to clean, and a `SystemExit` raised in
  an interpreter-exit callback would only print a traceback under serve's one-line error.
- A `SystemExit` of the signal that lands inside a finalizer (which swallows it, printing
  "Exception ignored in ...") is raised again outside it, without the noise.

Only the standard library is imported here at module level.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
PARENT_DEATH_SIGNAL = signal.SIGHUP  # only the kernel's parent-death notice sends it (`exit_with_parent`)
RAISE_AGAIN_SECONDS = 0.01  # a signal's exit swallowed by a finalizer is raised again this much later
_signalled: list[int] = []  # the signal that started this process's exit, once it came
_finished: list[bool] = []  # set once engine_main's cleanup is done: the interpreter is exiting
_api_pid: list[int] = []  # the API process that started this one, once known


def engine_main(folder: str) -> None:
    """The engine process of an `EngineCoreClient`, which wrote FOLDER/spec.pickle (its sys.path,
    its pid, whether it started this process from its main thread, then the EngineSpec) and binds
    the two sockets there."""
    import pickle
    import shutil

    take_signals()
    try:
        with open(f"{folder}/spec.pickle", "rb") as f:
            sys_path, parent_pid, from_main_thread = pickle.load(f)  # plain data: nothing heavy imported yet
            _api_pid.append(parent_pid)
            if from_main_thread:
                exit_with_parent(parent_pid)
            sys.path.extend(p for p in sys_path if p not in sys.path)  # added after ours: never shadows them
            from lmfoundry.runtime.engine.core import run_engine_core

            spec = pickle.load(f)  # imports the engine's factory (and torch)
        run_engine_core(spec, f"ipc://{folder}/commands", f"ipc://{folder}/outputs", parent_pid)
    finally:
        # Its sockets are closed: the folder goes with it (the API process removes it too; if that
        # process was killed, nobody else would).
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_DFL)
        _finished.append(True)


def take_signals() -> None:
    """This process's signals as the engine's: SIGINT ignored, SIGTERM `exit_on_signal`, the
    parent-death signal `exit_on_parent_death`, and the signal's exit out of a finalizer raised
    again (`_unraisable`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(PARENT_DEATH_SIGNAL, exit_on_parent_death)
    sys.unraisablehook = _unraisable(sys.unraisablehook)


def exit_with_parent(parent_pid: int) -> None:
    """Have the kernel send this process the parent-death signal when the thread that started it
    ends (Linux's PR_SET_PDEATHSIG), so that a killed API process takes the engine along even in
    the middle of a long step or of the model's load; send it now if the parent is already gone.
    Elsewhere the engine's own checks of its parent (`core.PARENT_CHECK_MS`) remain."""
    from lmfoundry.heap import libc

    prctl = getattr(libc(), "prctl", None)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0)
    if os.getppid() != parent_pid:  # gone before the kernel could be asked
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)


def exit_on_signal(signum: int, _frame: Any) -> None:
    """Leave through the cleanup, once: a second SystemExit (another SIGTERM, the parent-death
    signal after it) would cut the cleanup short.

    With the API process gone (a service manager's SIGTERM to a process whose parent died), the
    signal is passed on to the group this process leads, as the API process does when it stops
    the engine: a tensor-parallel rank still loading would otherwise keep the cleanup waiting
    for it. While the API process lives, it signals the group itself (never twice)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    _signalled.append(signum)
    if _api_pid and os.getppid() != _api_pid[0]:
        _signal_group(signum)
    raise SystemExit(128 + signum)


def exit_on_parent_death(_signum: int, _frame: Any) -> None:
    """The API process is gone (the kernel's parent-death signal): pass SIGTERM on to the group this
    process leads, then leave as SIGTERM would, through the cleanup, once (a killed multi-threaded
    parent can send the parent-death signal again for each of its threads). Whichever of the two
    signals comes first, both are ignored from then on."""
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _signalled.append(signal.SIGTERM)
    _signal_group(signal.SIGTERM)
    raise SystemExit(128 + signal.SIGTERM)


def _signal_group(signum: int) -> None:
    """`signum` to the process group this process leads (it ignores the signal itself by now)."""
    if os.getpgrp() != os.getpid():
        return
    try:
        os.killpg(os.getpid(), signum)
    except OSError:
        pass


def _exit_again(signum: int) -> None:
    """`exit_on_signal`'s SystemExit once more, where a finalizer had swallowed it (the group has
    had its signal)."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def _unraisable(default: Any) -> Any:
    """sys.unraisablehook for the engine process: the signal's SystemExit raised inside a
    finalizer (which cannot propagate it) is raised again shortly after, from a timer's signal,
    and nothing is printed; everything else goes to `default`. Not from here: a handler runs at
    the first chance, which would be inside this hook (any call that waits, os.kill itself)."""

    def hook(info: Any) -> None:
        if not (_signalled and isinstance(info.exc_value, SystemExit)):
            default(info)
            return
        if _finished:  # the process is on its way out already
            return
        signum = _signalled[-1]
        signal.signal(signal.SIGALRM, lambda _signum, _frame: _exit_again(signum))
        signal.setitimer(signal.ITIMER_REAL, RAISE_AGAIN_SECONDS)  # lands in another finalizer: once more

    return hook
