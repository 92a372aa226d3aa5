"""`lmfoundry serve`: load a checkpoint into the engine and serve the OpenAI API with uvicorn."""

from __future__ import annotations

import os
import sys

import click

from lmfoundry.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _print_url(host: str, port: int, api_key: str | None) -> None:
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"lmfoundry serving on http://{shown}:{port}/v1"
               f"{' (API key required)' if api_key else ''}", err=False)
    sys.stdout.flush()


@click.command("serve")
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int, help="Port (0: any free port).")
@click.option("--api-key", default=None, envvar="LMFOUNDRY_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (env LMFOUNDRY_API_KEY).")
@click.option("--served-model-name", default=None, help="Model id reported by /v1/models.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True)
@click.option("--max-model-len", type=int, default=None, help="Context length (prompt + output).")
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Sequences batched together.")
@click.option("--max-num-batched-tokens", type=int, default=256, show_default=True,
              help="Tokens per forward pass (prefill chunk size).")
@click.option("--max-waiting", type=int, default=256, show_default=True,
              help="Waiting sequences before requests get 429.")
@click.option("--kv-cache-gb", type=float, default=1.0, show_default=True, help="KV-cache memory.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="auto, float32, bfloat16, float16, int8 or fp8 (int8/fp8 need checkpoint scales).")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block.")
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of shared prompt prefixes.")
@click.option("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS or all cores).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(model: str, host: str, port: int, api_key: str | None, served_model_name: str | None, dtype: str,
          max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int, max_waiting: int,
          kv_cache_gb: float, kv_cache_dtype: str, block_size: int, no_prefix_caching: bool,
          threads: int | None, log_level: str) -> None:
    """Serve MODEL (a checkpoint folder or a known model name) with an OpenAI-compatible API."""
    import torch
    import uvicorn

    from lmfoundry.runtime.engine import AsyncLLMEngine, EngineConfig, LLMEngine
    from lmfoundry.runtime.server.app import create_app

    for name, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--block-size", block_size)):
        if value < 1:
            raise UserError(f"{name} must be at least 1")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)
    config = EngineConfig(
        block_size=block_size, kv_cache_memory_gb=kv_cache_gb, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_waiting_requests=max_waiting, enable_prefix_caching=not no_prefix_caching,
        kv_cache_dtype=kv_cache_dtype, num_threads=threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or None)
    engine = LLMEngine.from_pretrained(model, None if dtype == "auto" else getattr(torch, dtype), config)
    name = served_model_name or os.path.basename(os.path.normpath(model))
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, name, api_key=api_key, aliases=(model,))

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:  # type: ignore[override]
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()
                _print_url(host, bound[1], api_key)

    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run()
    finally:
        async_engine.shutdown()
    if not server.started:
        raise UserError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")
