"""The model's step compiled ahead of time for a CPU (`lmfoundry compile --arch cpu`), run by the engine.

What is compiled: `CausalLM.hidden_states(ids [T], positions [T])` for any T (the flat batch of a
step: decodes and prefill chunks together), with the packed W4A16/W8A16 linears as int4pack /
int8pack ops, which Inductor's C++ GEMM templates (AMX or AVX-512 micro-kernels) replace, and the
norms, rotary and SiLU fused into C++ loops. What is not: attention over the paged KV cache,
whose shape is the step's (ragged decode group, chunks, prefix hits). It stays one opaque op,
`lmfoundry::attend(q, k, v, layer)`, that calls the step's `PagedAttention` (the engine's CPU
attention), set around each call with `attention_context`. The LM head stays eager (the engine
applies it to the rows it samples).

A compiled step is machine code for one ISA: `load_compiled_step` refuses a package built for
another one (or by another torch) with the reason, and the caller serves the packed eager model.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

_ACTIVE = threading.local()


@torch.library.custom_op("lmfoundry::attend", mutates_args=())
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Attention of one layer for the current step (writes k/v into the paged cache, reads it)."""
    context = getattr(_ACTIVE, "context", None)
    if context is None:
        raise RuntimeError("lmfoundry::attend called outside attention_context")
    # the compiled caller reads the result with the strides the fake below declares: contiguous
    return context.attend(layer, q, k, v).contiguous()


@attend.register_fake
def _attend_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)


class ExportedAttention:
    """The attention context the model is traced with: each layer's attention becomes one
    `lmfoundry::attend` call in the graph."""

    supports_attention_spec = False  # plain causal attention only (see compile's refusal)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.lmfoundry.attend(q, k, v, layer_idx)


@contextlib.contextmanager
def attention_context(context: Any) -> Iterator[None]:
    previous = getattr(_ACTIVE, "context", None)
    _ACTIVE.context = context
    try:
        yield
    finally:
        _ACTIVE.context = previous


class CompiledStep:
    """hidden_states(ids, positions, context) through an AOTInductor package."""

    def __init__(self, runner: Any, path: Path) -> None:
        self.runner = runner
        self.path = path

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor:
        with attention_context(context), torch.inference_mode():
            return self.runner(ids, positions)


def compiled_step_refusal(entry: dict[str, Any]) -> str | None:
    """Why a bundle's compiled step cannot run on this machine (None: it can)."""
    from lmfoundry.runtime.cpu_isa import isa

    here = isa()
    if entry.get("isa") != here:
        return f"the compiled step is for {entry.get('isa')} CPUs and this one is {here}"
    built = entry.get("torch")
    if built != torch.__version__:
        return f"the compiled step was built by torch {built}, this is torch {torch.__version__}"
    return None


def load_compiled_step(package: Path) -> CompiledStep:
    runner = torch._inductor.aoti_load_package(str(package))
    return CompiledStep(runner, package)
