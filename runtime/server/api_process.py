"""`serve`'s API process: the engine started in a process of its own (`EngineCoreClient`), the
OpenAI-compatible app over it, uvicorn in this thread, and the stop (docs/reliability.md).

Stopping: --shutdown-timeout for the requests in flight, then two response graces
(background.RESPONSE_GRACE_SECONDS) and the engine's own stop: ENGINE_STOP_SECONDS for it to
read the shutdown between steps, core_client.TERM_GRACE_SECONDS after SIGTERM to its group.
Until the server runs, SIGINT and SIGTERM stop serve through the engine client's cleanup, which
stops the engine process (SIGTERM's default action would end this process and orphan it), and say
so in one line. SIGINT too: started in the background by a shell, serve inherits it ignored, and it
would be ignored until the model had loaded (uvicorn takes it from then on). Once the server
runs, both are its own (a drain, or the end of one), also while the engine stops after it.
Handlers belong to the main thread (serve called from another one keeps the process's own).
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmfoundry.errors import UserError

if TYPE_CHECKING:
    from lmfoundry.runtime.engine.client import EngineInfo
    from lmfoundry.runtime.engine.core_client import EngineSpec
    from lmfoundry.runtime.server.app import ApiOptions

DEFAULT_SHUTDOWN_TIMEOUT = 15.0  # with STOP_BOUND_SECONDS: within Kubernetes' default 30 s grace period
ENGINE_STOP_SECONDS = 5.0
STOP_BOUND_SECONDS = 15.0  # documented: serve exits within --shutdown-timeout + this


@dataclass(frozen=True)
class Listen:
    """Where and how the API listens: address, key, body and time limits, uvicorn's log level."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_mb: float = 8.0
    read_timeout: float = 30.0
    keep_alive: float = 5.0
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    log_level: str = "warning"


def print_url(host: str, port: int, api_key: str | None) -> None:
    shown = f"[{host}]" if ":" in host else host
    print(f"lmfoundry serving on http://{shown}:{port}/v1{' (API key required)' if api_key else ''}", flush=True)


def print_runtime(name: str, info: EngineInfo) -> None:
    """What runs, read from the loaded model (not from the flags): dtype, device, CPU path, weights."""
    where = f"{info.device}, {info.cpu_isa} path" if info.cpu_isa else info.device
    print(f"{name}: {info.dtype} on {where}; weights {info.weight_format}", file=sys.stderr)


def note_capped_context(info: EngineInfo, max_model_len: int | None, kv_cache_gb: float) -> None:
    """Say so when the context was capped to what the KV cache holds (as vLLM reports its estimated
    maximum model length); an explicit --max-model-len over the capacity is refused by the engine."""
    full = info.max_position_embeddings
    if max_model_len is None and info.max_model_len < full:
        print(f"note: the KV cache (--kv-cache-gb {kv_cache_gb:g}) holds {info.max_model_len} tokens, "
              f"less than the model's context of {full}: max model len is capped to {info.max_model_len}; "
              f"raise --kv-cache-gb for more", file=sys.stderr)


def serve_api(engine_spec: EngineSpec, name: str, listen: Listen, options: ApiOptions, *,
              aliases: tuple[str, ...] = (), max_model_len: int | None = None, kv_cache_gb: float = 1.0) -> None:
    """Start the engine process from `engine_spec`, serve the API over it as `name` (and
    `aliases`) until a signal or the engine's death, then stop both within the bound above. A
    signal before the server runs exits with 128 + the signal; an engine that died, or an address
    that could not be bound, is one UserError."""
    from lmfoundry.heap import freeze_heap
    from lmfoundry.runtime.engine import core_client
    from lmfoundry.runtime.server.app import create_app
    from lmfoundry.runtime.server.background import uvicorn_config

    died: list[int | None] = []
    server: Any = None

    def on_engine_death(exitcode: int | None) -> None:
        died.append(exitcode)
        if server is not None:
            server.should_exit = True  # in-flight requests have their 503; stop listening

    in_main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    serving: list[bool] = []
    stopping: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        if serving:
            server.handle_exit(signum, frame)
        elif not stopping:  # later ones change nothing: the stop under way is bounded
            stopping.append(signum)
            raise _Stopped(signum)

    for sig in handlers:
        signal.signal(sig, on_signal)
    try:
        engine = core_client.EngineCoreClient(engine_spec, on_death=on_engine_death)  # loads the model there
        try:
            note_capped_context(engine.info, max_model_len, kv_cache_gb)
            print_runtime(name, engine.info)
            app = create_app(engine, name, api_key=listen.api_key, aliases=aliases,
                             max_body_bytes=int(listen.max_request_mb * 2**20), read_timeout=listen.read_timeout,
                             options=options)
            http = uvicorn_config(app, listen.host, listen.port, listen.log_level, read_timeout=listen.read_timeout,
                                  keep_alive=listen.keep_alive)
            server = _server_class(listen.host, listen.api_key)(http, app.state.server.drain, listen.shutdown_timeout)
            if died:
                server.should_exit = True
            freeze_heap()
            # uvicorn in this thread: the first SIGINT/SIGTERM stops accepting and drains the requests in
            # flight (GracefulServer), a second one fails them at once.
            serving.append(True)
            server.run()
        finally:
            engine.shutdown(ENGINE_STOP_SECONDS)
    except _Stopped as stop:
        print(f"stopped by {signal.Signals(stop.signum).name} before serving: the engine process and its "
              "folder are gone", file=sys.stderr)
        sys.exit(128 + stop.signum)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if died and not (server.stop_signal is not None and died[0] == 128 + signal.SIGTERM):
        # (an engine that left on SIGTERM while serve stopped too got it from a service manager)
        raise UserError(f"the engine process died (exit code {died[0]}); the requests in flight got HTTP 503",
                        exit_code=1)
    if not server.started:
        raise UserError(f"could not listen on {listen.host}:{listen.port} (in use, or not an address of this machine)")


class _Stopped(BaseException):
    """SIGINT or SIGTERM before the server runs. A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way out of the engine's start may take it for a failure and go on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _server_class(host: str, api_key: str | None) -> Any:
    """The server with its bounded drain (`GracefulServer`), printing the URL once it listens
    (port 0 is resolved by then) and a line when it starts to stop."""
    from lmfoundry.runtime.server.background import GracefulServer

    class Server(GracefulServer):
        async def startup(self, sockets=None) -> None:  # type: ignore[override]
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                print_url(host, bound[1], api_key)

        async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
            if self.started:
                print(f"stopping: new requests get HTTP 503; the requests in flight have up to "
                      f"{self.shutdown_timeout:g} s to finish (signal again to end them now)", file=sys.stderr)
            await super().shutdown(sockets)

    return Server
