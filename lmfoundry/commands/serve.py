"""`lmfoundry serve`: the engine in a process of its own (it loads the checkpoint and steps with
all of --threads), the OpenAI API in this one (uvicorn, tokenization, detokenization)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

import click

from lmfoundry.errors import UserError
from lmfoundry.runtime.dtypes import DTYPES

# Default step budgets (--max-num-batched-tokens). Every running stream waits for the whole step,
# and on CPU a step's time grows with its rows long after the matrix units are busy, so past that
# point a larger chunk only lengthens the wait (benchmarks/results/serve_peers_avx2.md measures 1024
# against 2048); 2048 is vLLM's default, for GPUs, whose units need many more rows to be busy.
CPU_STEP_TOKENS = 1024
GPU_STEP_TOKENS = 2048
# Stopping (docs/reliability.md): --shutdown-timeout for the requests in flight, then two response
# graces (background.RESPONSE_GRACE_SECONDS) and the engine's own stop: ENGINE_STOP_SECONDS for it
# to read the shutdown between steps, core_client.TERM_GRACE_SECONDS after SIGTERM to its group.
DEFAULT_SHUTDOWN_TIMEOUT = 15.0  # with STOP_BOUND_SECONDS: within Kubernetes' default 30 s grace period
ENGINE_STOP_SECONDS = 5.0
STOP_BOUND_SECONDS = 15.0  # documented: serve exits within --shutdown-timeout + this

if TYPE_CHECKING:
    from lmfoundry.runtime.engine import EngineInfo
    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.engine.llm_engine import LLMEngine
    from lmfoundry.runtime.server.app import ApiOptions


def default_step_tokens(device: str) -> int:
    """--max-num-batched-tokens when not given: smaller on CPU (`engine_config.CPU_STEP_TOKENS`
    says why; eval runs the serving engine with the same budget)."""
    from lmfoundry.runtime.engine.engine_config import default_step_tokens as budget

    return budget(device)


def _print_url(host: str, port: int, api_key: str | None) -> None:
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"lmfoundry serving on http://{shown}:{port}/v1"
               f"{' (API key required)' if api_key else ''}", err=False)
    sys.stdout.flush()


def _bundle_block_size(path: str) -> int:
    from pathlib import Path

    from lmfoundry.engine_bundle.engine_manifest import bundle_degree, rank_folder, read_manifest

    folder = Path(path) / rank_folder(0) if bundle_degree(path) > 1 else Path(path)
    return int(read_manifest(folder)["kv_cache"]["block_size"])


def _compiled_step_bundle(model: str, block_size: int, verified: bool) -> str:
    """--compile-step: the cached `--arch cpu` bundle of checkpoint `model` (built now if new, by
    a `lmfoundry compile` child that prints its own lines and time; `serve` refused a GPU or a
    bundle before the engine process started). `verified`: serve has just checked the files
    against the checkpoint's lmfoundry.json, so the cache key takes the sha256s recorded there
    instead of reading every weight a second time."""
    from lmfoundry.runtime.cpu.step_cache import cached_cpu_engine

    return str(cached_cpu_engine(model, block_size=block_size, log_line=lambda m: click.echo(m, err=True),
                                 verified=verified)[0])


def _compiled_step_by_default(model: str, device: str, tp: int, deterministic: bool, run_dtype: Any,
                              lora_slots: int, speculative: str | None) -> str | None:
    """Why `serve` builds the compiled step without being asked (None: it serves the eager model).

    The eager model's 4/8-bit products run AVX-512 BF16 dot products; on a CPU with AMX the float
    model's GEMMs, and the compiled step's (Inductor's templates), run on AMX tiles instead, and the
    issue that asked for this default measured the compiled step there ahead of both the eager
    quantized model and the float one. Without AMX the eager products serve faster than the
    compiled step (benchmarks/results/serve_w4a16_avx512.md), so the default stays eager. Only
    where nothing else needs the eager model: one CPU process, bf16, no LoRA, no speculation, not
    --deterministic, and a checkpoint (not a bundle) whose weights are integer weight-only."""
    import torch

    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
    from lmfoundry.runtime.cpu import features as cpu_isa

    if device != "cpu" or tp > 1 or deterministic or lora_slots or speculative is not None:
        return None
    if run_dtype != torch.bfloat16 or not cpu_isa.cpu_features().get("amx_bf16") or is_engine_bundle(model):
        return None
    if not _weight_only_integer(model):
        return None
    return "this CPU has AMX and the checkpoint's weights are integer weight-only"


def _default_compiled_step(model: str, block_size: int, reason: str | None, verified: bool) -> str:
    """MODEL, or its cached compiled-step bundle where `reason` says to build it by default. A
    default is an optimization the user did not ask for: if the build fails (no C++ compiler,
    a step Inductor cannot compile), serve says why in one line and serves the eager model."""
    if reason is None:
        return model
    click.echo(f"serving through the compiled step: {reason} (--no-compile-step serves the eager model)", err=True)
    try:
        return _compiled_step_bundle(model, block_size, verified)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional build falls back, said in one line
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        click.echo(f"warning: the compiled step could not be built ({detail}); serving the eager model", err=True)
        return model


def serving_engine(model: str, dtype: str, config: EngineConfig, *, device: str, compile_step: bool | None,
                   draft_model: str | None = None, verified: bool = False) -> LLMEngine:
    """The engine `serve` runs, built in the engine process. Everything that reads the CPU or
    needs torch is decided here and not in the API process, which then never imports torch (on
    a CPU machine): the CPU's line, --dtype auto, the compiled step (the default's choice, and
    the build in a child process), then the model, less the eager weights a compiled step makes
    unused. Its lines go to the terminal the engine process shares with serve, its UserErrors to
    serve through the engine's start-up (`core_client`)."""
    from lmfoundry.runtime.cpu import features as cpu_isa
    from lmfoundry.runtime.engine.llm_engine import LLMEngine
    from lmfoundry.runtime.loader import resolve_dtype

    if device == "cpu":
        click.echo(cpu_isa.describe(dtype), err=True)
    run_dtype = resolve_dtype(dtype, model, device)
    if compile_step:
        model = _compiled_step_bundle(model, config.block_size, verified)
    elif compile_step is None:
        reason = _compiled_step_by_default(model, device, config.tensor_parallel_size, config.deterministic, run_dtype,
                                           config.max_loras, config.speculative)
        model = _default_compiled_step(model, config.block_size, reason, verified)
    engine = LLMEngine.from_pretrained(model, run_dtype, config, device=device, draft_model=draft_model)
    engine.release_eager_weights()  # a compiled step's package holds the weights: not twice
    return engine


def _weight_only_integer(model: str) -> bool:
    """Whether checkpoint folder `model` stores integer weight-only quantized linears (W4A16 / W8A16
    style). Read from its config.json alone: a GGUF file or a built-in model name is float (their
    conversion drops any quantization), and converting one here would load it in this process."""
    import json
    from pathlib import Path

    from lmfoundry.quantformat.scheme import plan_from_compressed_tensors

    path = Path(model) / "config.json"
    try:
        qcfg = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
        plan = plan_from_compressed_tensors(qcfg) if qcfg else None
    except (OSError, ValueError, AttributeError, UserError):  # the engine's load says what is wrong with it
        return False
    return plan is not None and bool(plan.groups) and all(g.scheme.format == "pack-quantized" for g in plan.groups)


def _check_server_options(port: int, max_model_len: int | None, max_waiting: int, kv_cache_gb: float,
                          threads: int | None, max_request_mb: float, timeout_read: float,
                          timeout_keep_alive: float, shutdown_timeout: float) -> None:
    """Refuse out-of-range options in one line before loading the model (--kv-cache-gb 0 used to
    run with one block, --max-waiting -5 shrank the running capacity, nan reached the allocator)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if max_model_len is not None and max_model_len < 2:
        raise UserError(f"--max-model-len must be at least 2 (a prompt token and an output token), got {max_model_len}")
    if max_waiting < 0:
        raise UserError(f"--max-waiting must be at least 0, got {max_waiting}")
    if threads is not None and threads < 1:
        raise UserError(f"--threads must be at least 1, got {threads}")
    for name, value in (("--kv-cache-gb", kv_cache_gb), ("--max-request-mb", max_request_mb),
                        ("--timeout-read", timeout_read), ("--timeout-keep-alive", timeout_keep_alive)):
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"{name} must be a positive number, got {value}")
    if not (math.isfinite(shutdown_timeout) and shutdown_timeout >= 0):
        raise UserError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout}")


def _check_deterministic(device: str, tp: int, compile_step: bool) -> None:
    """Refuse --deterministic where it cannot hold, before anything loads (the engine refuses the
    rest: a model, an --arch cpu bundle or a KV cache without batch-invariant kernels)."""
    if device != "cpu":
        raise UserError(f"--deterministic runs the CPU engine, not --device {device}")
    if tp > 1:
        raise UserError("--deterministic runs one process; drop --tp")
    if compile_step:
        raise UserError("--deterministic runs the eager model: a compiled step chooses its kernels by the step's "
                        "size; drop --compile-step")


def _note_capped_context(info: EngineInfo, max_model_len: int | None, kv_cache_gb: float) -> None:
    """Say so when the context was capped to what the KV cache holds (as vLLM reports its estimated
    maximum model length); an explicit --max-model-len over the capacity is refused by the engine."""
    full = info.max_position_embeddings
    if max_model_len is None and info.max_model_len < full:
        click.echo(f"note: the KV cache (--kv-cache-gb {kv_cache_gb:g}) holds {info.max_model_len} tokens, "
                   f"less than the model's context of {full}: max model len is capped to {info.max_model_len}; "
                   f"raise --kv-cache-gb for more", err=True)


def _http_options(command: Any) -> Any:
    """serve's HTTP-facing flags (CORS with vLLM's names, unknown request fields, metric names,
    /openapi.json); `_api_options` turns them into the app's `ApiOptions`."""
    listed = "; several values: the option repeated, commas, or a JSON list as vLLM takes it"
    options = [
        click.option("--allowed-origins", multiple=True,
                     help="CORS: origins whose browser pages may call the API, e.g. http://localhost:3000, or '*' "
                          f"(default: none, no CORS; vLLM's default is '*'){listed}."),
        click.option("--allowed-methods", multiple=True, help=f"CORS: methods allowed (default '*'){listed}."),
        click.option("--allowed-headers", multiple=True, help=f"CORS: request headers allowed (default '*'){listed}."),
        click.option("--allow-credentials", is_flag=True,
                     help="CORS: allow cookies and Authorization from those origins (listed explicitly: not with '*')."),
        click.option("--lenient-request-fields", is_flag=True,
                     help="Log and ignore request fields this server does not know (vLLM's behaviour) instead of "
                          "refusing the request with HTTP 400 naming them (OpenAI's), for clients that send extras."),
        click.option("--metrics-names", type=click.Choice(["ours", "vllm", "both"]), default="both", show_default=True,
                     help="/metrics series: ours (lmfoundry_*, what `promtool check metrics` accepts), vLLM's names "
                          "(vllm:*, for dashboards and autoscalers built for vLLM; promtool refuses their ':') or both."),
        click.option("--enable-openapi", is_flag=True, help="Serve the API's OpenAPI 3 schema at GET /openapi.json."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _listed(values: tuple[str, ...], name: str) -> tuple[str, ...]:
    """A repeated option's values, each a JSON list (vLLM's form) or comma-separated."""
    import json

    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except ValueError as exc:
                raise UserError(f"{name} {value!r}: not a JSON list ({exc})") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise UserError(f"{name} {value!r}: expected a JSON list of strings")
            out.extend(items)
        else:
            out.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(out)


def _api_options(allowed_origins: tuple[str, ...], allowed_methods: tuple[str, ...],
                 allowed_headers: tuple[str, ...], allow_credentials: bool, lenient_request_fields: bool,
                 metrics_names: str, enable_openapi: bool) -> ApiOptions:
    from lmfoundry.runtime.server.app import ApiOptions

    origins = _listed(allowed_origins, "--allowed-origins")
    for origin in origins:
        if origin != "*" and "://" not in origin:
            raise UserError(f"--allowed-origins {origin!r}: an origin is scheme://host[:port] (or '*')")
    if not origins and (allowed_methods or allowed_headers or allow_credentials):
        raise UserError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
    if allow_credentials and "*" in origins:  # what ApiOptions refuses too, said with the flags' names
        raise UserError("--allow-credentials with --allowed-origins '*' would let every web page send requests with "
                        "the user's credentials; list the origins explicitly (--allowed-origins https://app.example)")
    return ApiOptions(allowed_origins=origins, allowed_methods=_listed(allowed_methods, "--allowed-methods") or ("*",),
                      allowed_headers=_listed(allowed_headers, "--allowed-headers") or ("*",),
                      allow_credentials=allow_credentials, lenient_request_fields=lenient_request_fields,
                      metrics_names=metrics_names, openapi=enable_openapi)


def _print_runtime(name: str, info: EngineInfo) -> None:
    """What runs, read from the loaded model (not from the flags): dtype, device, CPU path, weights."""
    where = f"{info.device}, {info.cpu_isa} path" if info.cpu_isa else info.device
    click.echo(f"{name}: {info.dtype} on {where}; weights {info.weight_format}", err=True)


@click.command("serve")
@click.argument("model")
@click.argument("extra", nargs=-1, metavar="")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=int, help="Port (0: any free port).")
@click.option("--api-key", default=None, envvar="LMFOUNDRY_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1 (env LMFOUNDRY_API_KEY).")
@click.option("--served-model-name", default=None, help="Model id reported by /v1/models.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="Execution dtype on CPU. auto: bfloat16 where the CPU has bf16 arithmetic (AVX512-BF16/AMX; "
                   "W4A16/W8A16 weights then stay packed) or AVX2 + FMA (the runtime's kernels widen bf16 in registers), "
                   "float32 elsewhere; an engine bundle on a GPU keeps its own.")
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
@click.option("--device", default="cpu", show_default=True,
              help="cpu or cuda[:N]. An engine bundle (`lmfoundry compile` output) runs its kernels there: "
                   "shipped cubins on a matching GPU, Triton JIT otherwise, each kernel's PyTorch reference on "
                   "CPU. A checkpoint folder or model name runs the PyTorch reference model on CPU.")
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
@_http_options
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
    _check_server_options(port, max_model_len, max_waiting, kv_cache_gb, threads, max_request_mb, timeout_read,
                          timeout_keep_alive, shutdown_timeout)
    api_options = _api_options(**http_flags)
    from lmfoundry.commands.lora_options import lora_config, parse_spec, split_positionals

    model, lora_modules = split_positionals(model, extra, lora_modules)
    adapter_specs = [parse_spec(v, "--lora") for v in loras] + [parse_spec(v, "--lora-modules") for v in lora_modules]
    from lmfoundry.devices import check_device
    from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
    from lmfoundry.heap import freeze_heap
    from lmfoundry.runtime.engine.core_client import EngineCoreClient, EngineSpec
    from lmfoundry.runtime.engine.engine_config import EngineConfig
    from lmfoundry.runtime.placement import check_tensor_parallel
    from lmfoundry.runtime.server.app import create_app
    from lmfoundry.runtime.server.background import uvicorn_config

    device = check_device(device)
    check_tensor_parallel(tp, device, (model,))
    if deterministic:
        _check_deterministic(device, tp, bool(compile_step))
    if compile_step:  # refused here: the engine process builds it after every check below
        if device != "cpu":
            raise UserError("--compile-step compiles the CPU step; on a GPU serve a `lmfoundry compile` bundle")
        if tp > 1:
            raise UserError("--compile-step compiles one process's step; drop it with --tp")
        if is_engine_bundle(model):
            raise UserError(f"{model} is an engine bundle already: serve it without --compile-step")
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
    if is_engine_bundle(model):  # its paged-attention kernels were specialized for one block size
        compiled_block = _bundle_block_size(model)
        if block_size is not None and block_size != compiled_block:
            raise UserError(f"{model}: the bundle was compiled for --block-size {compiled_block}; serve it with "
                            f"that (or leave --block-size out), or compile again with --block-size {block_size}")
        block_size = compiled_block
    if block_size is None:
        block_size = 16
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
    died: list[int | None] = []
    server: Any = None

    def on_engine_death(exitcode: int | None) -> None:
        died.append(exitcode)
        if server is not None:
            server.should_exit = True  # in-flight requests have their 503; stop listening

    engine_spec = EngineSpec(serving_engine, (model, dtype, config),
                             {"device": device, "compile_step": compile_step, "draft_model": draft_model,
                              "verified": not skip_verify})
    # Until the server runs, SIGINT and SIGTERM stop serve through the engine client's cleanup, which
    # stops the engine process (SIGTERM's default action would end this process and orphan it), and
    # say so in one line. SIGINT too: started in the background by a shell, serve inherits it
    # ignored, and it would be ignored until the model had loaded (uvicorn takes it from then on).
    # Once the server runs, both are its own (a drain, or the end of one), also while the engine
    # stops after it. Handlers belong to the main thread (serve called from another one keeps the
    # process's own).
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
        engine = EngineCoreClient(engine_spec, on_death=on_engine_death)  # loads the model in the engine process
        try:
            _note_capped_context(engine.info, max_model_len, kv_cache_gb)
            _print_runtime(name, engine.info)
            app = create_app(engine, name, api_key=api_key, aliases=(model,),
                             max_body_bytes=int(max_request_mb * 2**20), read_timeout=timeout_read,
                             options=api_options)
            http = uvicorn_config(app, host, port, log_level, read_timeout=timeout_read, keep_alive=timeout_keep_alive)
            server = _server_class(host, api_key)(http, app.state.server.drain, shutdown_timeout)
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
        click.echo(f"stopped by {signal.Signals(stop.signum).name} before serving: the engine process and its "
                   "folder are gone", err=True)
        sys.exit(128 + stop.signum)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if died and not (server.stop_signal is not None and died[0] == 128 + signal.SIGTERM):
        # (an engine that left on SIGTERM while serve stopped too got it from a service manager)
        raise UserError(f"the engine process died (exit code {died[0]}); the requests in flight got HTTP 503",
                        exit_code=1)
    if not server.started:
        raise UserError(f"could not listen on {host}:{port} (in use, or not an address of this machine)")


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
                _print_url(host, bound[1], api_key)

        async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
            if self.started:
                click.echo(f"stopping: new requests get HTTP 503; the requests in flight have up to "
                           f"{self.shutdown_timeout:g} s to finish (signal again to end them now)", err=True)
            await super().shutdown(sockets)

    return Server
