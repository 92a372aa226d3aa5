"""The engine's side of a client: apply the caller's commands between steps, step, and turn the
step's events (and failures) into what the caller's streams receive.

`EngineCore` is shared by the two places an engine steps: the engine process
(`run_engine_core`, started by `EngineCoreClient`) and the thread of an in-process
`AsyncLLMEngine`. A request that fails inside a step (see `LLMEngine.step`) fails alone: its
stream gets `RequestFailed`, the others keep streaming; a step that raises fails the requests
then running, and the engine keeps serving.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any

from lmfoundry.errors import UserError
from lmfoundry.heap import freeze_heap
from lmfoundry.runtime.engine.client import EngineDead, EngineRequest, RequestFailed
from lmfoundry.runtime.engine.core_client import EngineSpec
from lmfoundry.runtime.engine.llm_engine import LLMEngine
from lmfoundry.runtime.engine.outputs import EmbeddingResult, LoRAResult, StepEvent

log = logging.getLogger(__name__)

Delivery = list[tuple[str, "StepEvent | EmbeddingResult | LoRAResult | BaseException"]]
PARENT_CHECK_MS = 1000  # an idle engine process looks this often whether its API process still exists


class EngineCore:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def apply(self, command: tuple) -> Delivery:
        """("add", EngineRequest), ("abort", request_id), ("embed", request_id, prompts) or ("lora",
        request_id, "load" | "unload", name, path); what the
        caller must be told."""
        if command[0] == "lora":
            _, request_id, op, name, path = command
            return [(request_id, self.engine.lora_command(request_id, op, name, path))]
        if command[0] == "embed":  # scheduled with the other requests, a step's budget at a time
            _, request_id, prompts = command
            try:
                self.engine.add_embedding(request_id, prompts)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                return [(request_id, RequestFailed(f"the engine refused the request: {exc}"))]
        elif command[0] == "add":
            request: EngineRequest = command[1]
            try:
                self.engine.add(request)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                return [(request.request_id, RequestFailed(f"the engine refused the request: {exc}"))]
        elif command[0] == "abort":
            self.engine.abort(command[1])
        else:
            raise ValueError(f"unknown engine command {command[0]!r}")
        return []

    def step(self) -> Delivery:
        try:
            events = self.engine.step()
        except EngineDead:  # the engine cannot step again: its caller stops it
            raise
        except Exception as exc:  # noqa: BLE001 - fail the requests, keep serving
            log.exception("engine step failed; aborting all running requests")
            return [(rid, RequestFailed(f"engine failure: {exc}")) for rid in self.engine.abort_all()]
        out: Delivery = []
        for ev in events:
            if ev.error is not None:
                log.error("request %s failed; the others keep running", ev.request_id, exc_info=ev.error)
                out.append((ev.request_id, RequestFailed(f"the request failed in the engine: {ev.error}")))
            else:
                out.append((ev.request_id, ev))
        out += [(result.request_id, result) for result in self.engine.take_embeddings()]
        return out


def run_engine_core(spec: EngineSpec, commands_addr: str, outputs_addr: str, parent_pid: int) -> None:
    """The engine process: build the engine, say "ready" (with what the API process needs: the
    engine's info, its tokenizer, its stats) or "failed", then step while there is work and wait
    for commands while there is none. Exits on "shutdown" or when its parent is gone.

    Its process's signals are `engine_process.engine_main`'s: SIGINT is ignored (the API process
    decides when the engine stops, after draining the requests in flight); SIGTERM (the API
    process stopping it, a service manager stopping every process of the service at once, the
    parent-death signal) ends it at once, but through its cleanup: a tensor-parallel group's
    workers and shared memory go with it."""
    import zmq

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s engine: %(message)s")
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(commands_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(outputs_addr)
    try:
        try:
            engine = spec.build()
        except SystemExit:
            raise
        except UserError as exc:  # its exit code too: a bundle's failed check is 4 in serve as in every verb
            outputs.send_pyobj(("failed", str(exc), exc.exit_code))
            return
        except BaseException as exc:  # noqa: BLE001 - a bug: the traceback goes to stderr, one line to the caller
            traceback.print_exc()
            outputs.send_pyobj(("failed", f"the engine could not start: {type(exc).__name__}: {exc}", UserError.exit_code))
            return
        outputs.send_pyobj(("ready", engine.info, engine.tokenizer, engine.stats()))
        freeze_heap()
        try:
            _serve(EngineCore(engine), commands, outputs, parent_pid)
        except EngineDead as exc:  # e.g. a lost tensor-parallel rank: the API process sees this one end
            log.error("the engine stops: %s", exc)
            getattr(engine.model, "abandon", lambda: None)()  # a broken group's processes and memory
            lost = True
        except SystemExit:  # SIGTERM: no draining, but no processes or shared memory left behind
            getattr(engine.model, "abandon", lambda: None)()
            raise
        else:
            lost = False
            engine.close()
    finally:
        outputs.close(linger=5000)  # let the last message out
        commands.close(linger=0)
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
    if lost:
        os._exit(1)  # not sys.exit: the lost group's processes must not be waited for


def _serve(core: EngineCore, commands: Any, outputs: Any, parent_pid: int) -> None:
    import zmq

    poller = zmq.Poller()
    poller.register(commands, zmq.POLLIN)
    last_parent_check = time.monotonic()
    while True:
        delivery: Delivery = []
        received = False
        if poller.poll(0 if core.has_work else PARENT_CHECK_MS):
            while True:
                try:
                    command = commands.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if command[0] == "shutdown":
                    return
                received = True
                delivery += core.apply(command)
        if core.has_work:
            delivery += core.step()
        if delivery or received:
            outputs.send_pyobj(("out", delivery, core.engine.stats()))
        now = time.monotonic()
        if now - last_parent_check >= PARENT_CHECK_MS / 1000:
            last_parent_check = now
            if os.getppid() != parent_pid:
                log.warning("the API process is gone; the engine process exits")
                return
