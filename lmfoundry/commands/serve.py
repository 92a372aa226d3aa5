"""`lmfoundry serve`: the engine in a process of its own (it loads the checkpoint and steps with
all of --threads), the OpenAI API in this one (uvicorn, tokenization, detokenization). This module
parses the flags; the runtime builds the engine (`runtime.engine.serving`, in the engine process)
and runs the API process (`runtime.server.api_process`)."""

from __future__ import annotations

import os
from typing import Any

import click

from lmfoundry.commands.http_options import api_options, check_server_options, http_options
from lmfoundry.commands.run_options import device_option, dtype_option
from lmfoundry.errors import UserError
from lmfoundry.runtime.server.api_process import DEFAULT_SHUTDOWN_TIMEOUT, STOP_BOUND_SECONDS


@click.command("serve")
@click.argument("model")
@click.argument("extra", nargs=-1, metavar="")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int, help="Port (0: any free port).")
@click.option("--api-key", default=None, envvar="LMFOUNDRY_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (env LMFOUNDRY_API_KEY).")
@click.option("--served-model-name", default=None, help="Model id reported by /v1/models.")
@dtype_option
@click.option("--max-model-len", type=int, default=None, help="Context length (prompt + output).")
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Sequences batched together.")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Tokens per forward pass (prefill chunk size); default 1024 on CPU, 2048 (vLLM's) on a GPU. "
                   "Every running stream waits for a whole step, so a chunk only needs enough rows to keep the "
                   "matrix units busy: a CPU's are busy with far fewer than a GPU's, and a larger chunk there "
                   "only lengthens the stall (benchmarks/results/serve_peers_avx2.md measures both).")
@click.option("--max-waiting", type=int, default=256, show_default=True,
              help="Waiting sequences before requests get 429.")
@click.option("--kv-cache-gb", type=float, default=1.0, show_default=True, help="KV-cache memory.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              help="auto, float32, bfloat16, float16, int8 or fp8 (int8/fp8 need checkpoint scales).")
@click.option("--block-size", type=int, default=None,
              help="Tokens per KV block (default 16, or the block size an engine bundle was compiled for).")
@device_option
@click.option("--compile-step/--no-compile-step", default=None,
              help="CPU: serve a checkpoint through its step compiled ahead of time (what `compile --arch cpu` "
                   "builds), built on first use into the cache (minutes, once per checkpoint, block size, torch "
                   "and CPU ISA) and reused after. Default: on for a weight-only quantized checkpoint on a CPU "
                   "with AMX (where the compiled step's GEMMs run on AMX tiles), off elsewhere (the eager model's "
                   "packed products serve faster there); --no-compile-step keeps the eager model.")
@click.option("--enforce-eager", is_flag=True,
              help="On a GPU, run every decode step eagerly instead of replaying CUDA graphs.")
@click.option("--no-prefix-caching", is_flag=True, help="Do not reuse KV blocks of shared prompt prefixes.")
@click.option("--speculative", type=click.Choice(["ngram", "draft"]), default=None,
              help="Speculative decoding: guess each decoding sequence's next tokens cheaply and check them all in "
                   "one forward of the model. ngram: prompt lookup, the tokens that followed the sequence's last "
                   "n-gram earlier in its prompt or output (no extra model; pays off when outputs quote or edit "
                   "their input). draft: a smaller model with the same tokenizer (--draft-model) decodes the "
                   "guesses. Outputs are those of plain decoding, at any temperature: greedy requests give the same "
                   "tokens, sampled ones keep the model's distribution (standard speculative sampling) and a seeded "
                   "request draws the same tokens (up to float rounding between a multi-token and a one-token "
                   "forward, which can only matter at exact near-ties). Drafts spend the --max-num-batched-tokens "
                   "budget; it pays when a forward over a few tokens costs about what one token costs (small "
                   "batches), and when drafts are accepted (/metrics lmfoundry_spec_decode_acceptance_rate).")
@click.option("--num-speculative-tokens", type=int, default=4, show_default=True,
              help="Draft tokens proposed per sequence and step (with --speculative); a step yields 1 to K+1 tokens.")
@click.option("--draft-model", default=None,
              help="Draft model for --speculative draft: a checkpoint folder, known model name or engine bundle, "
                   "loaded like MODEL (same --dtype and --device) with its own KV cache sized like MODEL's.")
@click.option("--ngram-max", type=int, default=3, show_default=True,
              help="Longest n-gram looked up for --speculative ngram (shorter ones down to 1 are tried next).")
@click.option("--deterministic", is_flag=True,
              help="Batch-invariant execution: a greedy request gets the same tokens and logprobs, bit for bit, "
                   "whatever else is in its batch, however many requests run, and whether its prompt prefix came "
                   "from the cache (every linear one C product whatever the row count, every token's attention "
                   "the decode kernel's over its own context). CPU, one process, the eager model (no --compile-step) "
                   "in bfloat16 or float32; slower (benchmarks/results/deterministic.md).")
@click.option("--threads", type=int, default=None,
              help="torch threads of the engine process (default: OMP_NUM_THREADS or all cores); with --tp, "
                   "shared by its ranks (each gets threads / tp, at least 1).")
@click.option("--tp", type=int, default=1, show_default=True,
              help="Tensor parallel: split the model over this many processes (ranks), Megatron-style: each "
                   "holds 1/tp of the attention heads, MLP width and vocabulary, and its own KV cache for its KV "
                   "heads; they meet in one all-reduce per attention and MLP block. Must divide the attention "
                   "heads and MLP width, and divide or be a multiple of the KV heads (`lmfoundry plan --tp` lists "
                   "the valid sizes). On CPU: a checkpoint folder, model name or bundle; on GPUs (one a rank, "
                   "NCCL): a bundle built with `compile --tp` at the same degree.")
@click.option("--tp-backend", type=click.Choice(["shm", "gloo"]), default="shm", show_default=True,
              help="How CPU --tp ranks exchange partial sums: shm (shared memory, the fast one on one machine) or "
                   "gloo (torch.distributed over TCP); GPU ranks use NCCL.")
@click.option("--max-request-mb", type=float, default=8.0, show_default=True,
              help="Largest request body in MiB (larger: HTTP 413).")
@click.option("--timeout-read", type=float, default=30.0, show_default=True,
              help="Seconds a client may take to send a request's headers (else the connection is closed), "
                   "and then its body (else HTTP 408).")
@click.option("--timeout-keep-alive", type=float, default=5.0, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, show_default=True,
              help="Seconds the requests in flight may still run after SIGINT or SIGTERM (new requests get HTTP 503 "
                   "at once); those left then fail with 503, or a final error event in a stream. A second signal "
                   f"ends them at once. serve exits within this + {STOP_BOUND_SECONDS:g} s, with the engine process, "
                   "its tensor-parallel ranks and its temporary folders gone.")
@click.option("--skip-verify", is_flag=True,
              help="Do not check the checkpoint's files against the sha256 in its lmfoundry.json before loading "
                   "(engine bundles are always checked against engine.json).")
@click.option("--lora", "loras", multiple=True, metavar="NAME=PATH",
              help="Serve a LoRA adapter (a PEFT folder: adapter_config.json + adapter_model.safetensors) on "
                   "MODEL under NAME: a request whose model is NAME runs it, in the same batches as the base and "
                   "the other adapters. Repeat for several. Each is checked against MODEL first (rank, shapes, "
                   "targets, kind) and refused in one line if it does not fit. vLLM's --lora-modules NAME=PATH "
                   "[NAME=PATH ...] is accepted too.")
@click.option("--lora-modules", "lora_modules", multiple=True, hidden=True)
@click.option("--enable-lora", is_flag=True,
              help="LoRA on without --lora (adapters loaded at run time through POST /v1/load_lora_adapter).")
@click.option("--max-loras", type=int, default=None,
              help="Adapters held at once (slots of the stacked adapter weights, allocated at start; "
                   "`lmfoundry plan --max-loras` counts their memory). Default: the number of --lora given, at "
                   "least 1.")
@click.option("--max-lora-rank", type=int, default=16, show_default=True,
              help="Largest adapter rank the slots hold; an adapter of higher rank is refused.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@http_options
def serve(model: str, host: str, port: int, api_key: str | None, served_model_name: str | None, dtype: str,
          max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int | None, max_waiting: int,
          kv_cache_gb: float, kv_cache_dtype: str, block_size: int | None, device: str,
          compile_step: bool | None, enforce_eager: bool,
          no_prefix_caching: bool, speculative: str | None, num_speculative_tokens: int, draft_model: str | None,
          ngram_max: int, deterministic: bool, threads: int | None, tp: int, tp_backend: str, max_request_mb: float,
          timeout_read: float, timeout_keep_alive: float, shutdown_timeout: float, skip_verify: bool, log_level: str,
          extra: tuple[str, ...] = (), loras: tuple[str, ...] = (), lora_modules: tuple[str, ...] = (),
          enable_lora: bool = False, max_loras: int | None = None, max_lora_rank: int = 16,
          **http_flags: Any) -> None:
    """Serve MODEL with an OpenAI-compatible API. MODEL is a checkpoint folder, a known model name,
    or an engine bundle folder (`lmfoundry compile` output) whose kernels run on --device.

    The engine runs in a process of its own (it loads MODEL and steps with --threads); this one
    serves HTTP, tokenizes and detokenizes. If the engine process dies, requests in flight get
    HTTP 503 and serve exits with code 1. SIGINT or SIGTERM stops it with a bounded drain
    (--shutdown-timeout), then exit code 0; before it serves (the model loading), at once, with
    exit code 128 + the signal."""
    check_server_options(port, max_model_len, max_waiting, kv_cache_gb, threads, max_request_mb, timeout_read,
                         timeout_keep_alive, shutdown_timeout)
    options = api_options(**http_flags)
    from lmfoundry.commands.lora_options import lora_config, parse_spec, split_positionals

    model, lora_modules = split_positionals(model, extra, lora_modules)
    adapter_specs = [parse_spec(v, "--lora") for v in loras] + [parse_spec(v, "--lora-modules") for v in lora_modules]
    from lmfoundry.devices import check_device
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
    from lmfoundry.runtime.engine.core_client import EngineSpec
    from lmfoundry.runtime.engine.engine_config import EngineConfig, default_step_tokens
    from lmfoundry.runtime.engine.serving import bundle_block_size, check_serving, serving_engine
    from lmfoundry.runtime.placement import check_tensor_parallel
    from lmfoundry.runtime.server.api_process import Listen, serve_api

    device = check_device(device)
    check_tensor_parallel(tp, device, (model,))
    check_serving(model, device, tp, compile_step, deterministic)
    if tp > 1:
        from lmfoundry.model.head_split import split_heads
        from lmfoundry.runtime.loader import whole_model_config

        split_heads(whole_model_config(model), tp)  # before anything starts
    # the name clients use: what the user named, even when the engine serves a compiled step of it
    name = served_model_name or os.path.basename(os.path.normpath(model))
    lora_slots, adapters = lora_config(model, adapter_specs, enable_lora, max_loras, max_lora_rank, name, tp, device)
    if not skip_verify and not is_engine_bundle(model):
        from pathlib import Path

        from lmfoundry.manifest import verify_artifact

        for spec in (model, draft_model):
            if spec is not None and Path(spec).is_dir():
                verify_artifact(Path(spec), "serve")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_step_tokens(device)
    for flag, value in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens),
                        ("--block-size", 1 if block_size is None else block_size),
                        ("--num-speculative-tokens", num_speculative_tokens), ("--ngram-max", ngram_max)):
        if value < 1:
            raise UserError(f"{flag} must be at least 1")
    if (speculative == "draft") != (draft_model is not None):
        raise UserError("--speculative draft needs --draft-model, and --draft-model needs --speculative draft")
    block_size = bundle_block_size(model, block_size)  # a bundle's kernels were specialized for one
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach it can use it", err=True)
    config = EngineConfig(
        block_size=block_size, kv_cache_memory_gb=kv_cache_gb, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_waiting_requests=max_waiting, enable_prefix_caching=not no_prefix_caching,
        kv_cache_dtype=kv_cache_dtype, cuda_graphs=not enforce_eager,
        num_threads=threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() if tp > 1 else None),
        speculative=speculative, num_speculative_tokens=num_speculative_tokens, ngram_max=ngram_max,
        tensor_parallel_size=tp, tp_backend=tp_backend, deterministic=deterministic, max_loras=lora_slots,
        max_lora_rank=max_lora_rank, lora_modules=adapters)
    engine_spec = EngineSpec(serving_engine, (model, dtype, config),
                             {"device": device, "compile_step": compile_step, "draft_model": draft_model,
                              "verified": not skip_verify})
    listen = Listen(host, port, api_key, max_request_mb, timeout_read, timeout_keep_alive, shutdown_timeout, log_level)
    serve_api(engine_spec, name, listen, options, aliases=(model,), max_model_len=max_model_len, kv_cache_gb=kv_cache_gb)
