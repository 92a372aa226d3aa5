"""Whether a CPU engine serves a checkpoint through its compiled step, and getting that step: what
`serve --compile-step` asks for, and the default `serve` takes without being asked.

The compiled step is an `--arch cpu` bundle kept in the cache (`step_cache`), built on first use by
a `lmfoundry compile` child process. Its lines go to stderr, which the engine process shares
with `serve`'s terminal.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from lmfoundry.engine_bundle.engine_manifest import is_engine_bundle
from lmfoundry.errors import UserError
from lmfoundry.runtime.cpu import features


def say(line: str) -> None:
    """One line on stderr (the terminal the engine process shares with serve)."""
    print(line, file=sys.stderr, flush=True)


def compiled_step_bundle(model: str, block_size: int, verified: bool) -> str:
    """--compile-step: the cached `--arch cpu` bundle of checkpoint `model` (built now if new, by
    a `lmfoundry compile` child that prints its own lines and time; `serve` refused a GPU or a
    bundle before the engine process started). `verified`: serve has just checked the files
    against the checkpoint's lmfoundry.json, so the cache key takes the sha256s recorded there
    instead of reading every weight a second time."""
    from lmfoundry.runtime.cpu.step_cache import cached_cpu_engine

    return str(cached_cpu_engine(model, block_size=block_size, log_line=say, verified=verified)[0])


def compiled_step_by_default(model: str, device: str, tp: int, deterministic: bool, run_dtype: torch.dtype | None,
                             lora_slots: int, speculative: str | None) -> str | None:
    """Why `serve` builds the compiled step without being asked (None: it serves the eager model).

    The eager model's 4/8-bit products run AVX-512 BF16 dot products; on a CPU with AMX the float
    model's GEMMs, and the compiled step's (Inductor's templates), run on AMX tiles instead, and the
    issue that asked for this default measured the compiled step there ahead of both the eager
    quantized model and the float one. Without AMX the eager products serve faster than the
    compiled step (benchmarks/results/serve_w4a16_avx512.md), so the default stays eager. Only
    where nothing else needs the eager model: one CPU process, bf16, no LoRA, no speculation, not
    --deterministic, and a checkpoint (not a bundle) whose weights are integer weight-only."""
    if device != "cpu" or tp > 1 or deterministic or lora_slots or speculative is not None:
        return None
    if run_dtype != torch.bfloat16 or not features.cpu_features().get("amx_bf16") or is_engine_bundle(model):
        return None
    if not weight_only_integer(model):
        return None
    return "this CPU has AMX and the checkpoint's weights are integer weight-only"


def default_compiled_step(model: str, block_size: int, reason: str | None, verified: bool) -> str:
    """MODEL, or its cached compiled-step bundle where `reason` says to build it by default. A
    default is an optimization the user did not ask for: if the build fails (no C++ compiler,
    a step Inductor cannot compile), it says why in one line and the eager model serves."""
    if reason is None:
        return model
    say(f"serving through the compiled step: {reason} (--no-compile-step serves the eager model)")
    try:
        return compiled_step_bundle(model, block_size, verified)
    except Exception as exc:  # noqa: BLE001 - any failure of the optional build falls back, said in one line
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        say(f"warning: the compiled step could not be built ({detail}); serving the eager model")
        return model


def weight_only_integer(model: str) -> bool:
    """Whether checkpoint folder `model` stores integer weight-only quantized linears (W4A16 / W8A16
    style). Read from its config.json alone: a GGUF file or a built-in model name is float (their
    conversion drops any quantization), and converting one here would load it in this process."""
    from lmfoundry.quantformat.scheme import plan_from_compressed_tensors

    path = Path(model) / "config.json"
    try:
        qcfg = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
        plan = plan_from_compressed_tensors(qcfg) if qcfg else None
    except (OSError, ValueError, AttributeError, UserError):  # the engine's load says what is wrong with it
        return False
    return plan is not None and bool(plan.groups) and all(g.scheme.format == "pack-quantized" for g in plan.groups)
