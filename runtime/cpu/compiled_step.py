"""The model's step compiled ahead of time for a CPU (`lmfoundry compile --arch cpu`), run by the engine.

What is compiled: the decoder of `CausalLM.hidden_states` over embedded tokens (embeds [T, D],
positions [T]) for any T (the flat batch of a step: decodes and prefill chunks together), with the
packed W4A16/W8A16 linears as int4pack / int8pack ops (on an AMX CPU Inductor's C++ GEMM templates
may replace them: `compile.cpu_step.gemm_backends`), and the norms, rotary and SiLU fused into C++
loops. What is not, each one opaque op that calls back into the engine around each call
(`step_context`):
- attention over the paged KV cache, whose shape is the step's (ragged decode group, chunks,
  prefix hits): `lmfoundry::attend(q, k, v, layer, scale, softcap, window)` calls the step's
  `PagedAttention` (the engine's CPU attention, in whatever format the KV cache stores), with the
  layer's `AttentionSpec` (Gemma's scale and soft-cap, sliding windows) as plain numbers;
- a mixture-of-experts block, which routes tokens by value (a traced graph has one shape per
  tensor): `lmfoundry::moe(x, layer)` runs the eager model's `SparseMoE` of that layer, so the
  experts' weights are the eager model's, not a second copy in the package.
The embedding table and the LM head stay eager, one copy: the engine looks a step's rows up in the
table before the call and applies the head to the rows it samples.

A compiled step is machine code for one ISA: `load_compiled_step` refuses a package built for
another one (or by another torch) with the reason, and the caller serves the packed eager model.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, cast

import torch
from torch import nn

from lmfoundry.heap import page_out_mapped_files
from lmfoundry.model.attention_math import AttentionSpec

_ACTIVE = threading.local()


# The two ops are defined on a `torch.library.Library`, not with `torch.library.custom_op`: a
# custom_op's kernel runs under `torch._disable_dynamo`, whose first call imports TorchDynamo,
# Inductor and Triton into the serving process (well over 100 MiB resident) for nothing. The
# schemas are the ones custom_op derived for the packages already built (ints as SymInt).
_LIBRARY = torch.library.Library("lmfoundry", "DEF")
_LIBRARY.define("attend(Tensor q, Tensor k, Tensor v, SymInt layer, float scale=0., float softcap=0., "
                "SymInt window=0) -> Tensor")
_LIBRARY.define("moe(Tensor x, SymInt layer) -> Tensor")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float = 0.0,
           softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """Attention of one layer for the current step (writes k/v into the paged cache, reads it).
    `scale` 0: plain causal attention; else the layer's `AttentionSpec` (`softcap` / `window` 0:
    none), the numbers a traced graph can carry."""
    active = _active()
    spec = None if scale == 0.0 else AttentionSpec(scale, softcap or None, window or None)
    out = active.context.attend(layer, q, k, v) if spec is None else active.context.attend(layer, q, k, v, spec)
    # the compiled caller reads the result with the strides the fake below declares: contiguous
    return out.contiguous()


@torch.library.register_fake("lmfoundry::attend", lib=_LIBRARY)
def _attend_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float = 0.0,
                 softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    return q.new_empty(q.shape)


def moe(x: torch.Tensor, layer: int) -> torch.Tensor:
    """The mixture-of-experts block of one layer, run by the eager model's module."""
    block = _active().moe_blocks.get(layer)
    if block is None:
        raise RuntimeError(f"lmfoundry::moe: no mixture-of-experts block for layer {layer}")
    return block(x).contiguous()


@torch.library.register_fake("lmfoundry::moe", lib=_LIBRARY)
def _moe_fake(x: torch.Tensor, layer: int) -> torch.Tensor:
    return x.new_empty(x.shape)


_LIBRARY.impl("attend", attend, "CompositeExplicitAutograd")
_LIBRARY.impl("moe", moe, "CompositeExplicitAutograd")


@dataclass
class _Step:
    context: Any  # the step's attention (`PagedAttention`)
    moe_blocks: dict[int, nn.Module] = field(default_factory=dict)


def _active() -> _Step:
    active = getattr(_ACTIVE, "step", None)
    if active is None:
        raise RuntimeError("a compiled step's op was called outside step_context")
    return active


class ExportedAttention:
    """The attention context the model is traced with: each layer's attention becomes one
    `lmfoundry::attend` call in the graph, its `AttentionSpec` (if any) as numbers."""

    supports_attention_spec = True

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        if spec is None:
            return torch.ops.lmfoundry.attend(q, k, v, layer_idx)
        return torch.ops.lmfoundry.attend(q, k, v, layer_idx, float(spec.scale), float(spec.softcap or 0.0),
                                          int(spec.window or 0))


class ExportedMoE(nn.Module):
    """Stands in for one layer's `SparseMoE` while the step is traced: a `lmfoundry::moe` call."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.lmfoundry.moe(x, self.layer)


def moe_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """Layer index -> the model's mixture-of-experts block (what `lmfoundry::moe` runs)."""
    from lmfoundry.model.reference import SparseMoE

    layers = cast(nn.ModuleList, model.get_submodule("model.layers"))
    return {i: layer.mlp for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoE)}


class ReleasedLinear(nn.Module):
    """Stands in for a decoder linear whose weights `release_decoder_linears` dropped: the compiled
    step holds its own copy of them. It keeps the shape; calling it is refused (the executor
    refuses a step the compiled step cannot take before any linear is reached)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this linear's eager weights were released: the compiled step serves every step")


def release_decoder_linears(model: nn.Module) -> int:
    """Replace every decoder linear of `model` (any module with in_features and out_features,
    fused products and their parts alike) by a `ReleasedLinear`, except inside mixture-of-experts
    blocks (the compiled step calls those); returns how many were replaced. Norms, the
    embeddings and the LM head stay: they are small, or the engine runs them."""
    moe = set(map(id, moe_blocks(model).values()))

    def release(parent: nn.Module) -> int:
        count = 0
        for name, child in list(parent.named_children()):
            if id(child) in moe or isinstance(child, ReleasedLinear):
                continue
            if hasattr(child, "in_features") and hasattr(child, "out_features"):
                setattr(parent, name, ReleasedLinear(child))
                count += 1
            else:
                count += release(child)
        return count

    return release(model.get_submodule("model.layers"))


@contextlib.contextmanager
def step_context(context: Any, blocks: dict[int, nn.Module] | None = None) -> Iterator[None]:
    previous = getattr(_ACTIVE, "step", None)
    _ACTIVE.step = _Step(context, blocks or {})
    try:
        yield
    finally:
        _ACTIVE.step = previous


class CompiledStep:
    """`model.hidden_states(ids, positions, context)` through an AOTInductor package; `moe_blocks`
    are the eager model's mixture-of-experts blocks its `lmfoundry::moe` calls run. A package takes
    the tokens' embedding rows, looked up in the eager model's table (`embedded`); one built
    before that change takes the ids and holds a copy of the table."""

    def __init__(self, runner: Any, path: Path, moe_blocks: dict[int, nn.Module] | None = None,
                 embedded: bool = True) -> None:
        self.runner = runner
        self.path = path
        self.moe_blocks = moe_blocks or {}
        self.embedded = embedded

    def __call__(self, model: Any, ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor:
        with step_context(context, self.moe_blocks), torch.inference_mode():
            return self.runner(model.embed_inputs(ids) if self.embedded else ids, positions)


def compiled_step_refusal(entry: dict[str, Any]) -> str | None:
    """Why a bundle's compiled step cannot run on this machine (None: it can)."""
    from lmfoundry.runtime.cpu.features import isa

    here = isa()
    if entry.get("isa") != here:
        return f"the compiled step is for {entry.get('isa')} CPUs and this one is {here}"
    built = entry.get("torch")
    if built != torch.__version__:
        return f"the compiled step was built by torch {built}, this is torch {torch.__version__}"
    return None


class _PackageRunner:
    """The package's compiled step through the AOTInductor loader torch's C++ core provides.
    `torch._inductor.aoti_load_package` wraps the same loader, but importing it loads Inductor,
    sympy and Triton for the server's life; this step's inputs are two tensors and its output
    one, so the wrapper's pytree flattening has nothing to do."""

    def __init__(self, package: Path) -> None:
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        # the loader copied the weights out of the library's read-only section: its pages go
        paged = page_out_mapped_files(".wrapper.so")
        logging.getLogger("lmfoundry.runtime").debug("%s: %d bytes of library pages paged out", package, paged)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        outputs = self.loader.boxed_run([ids, positions])
        if len(outputs) != 1:
            raise RuntimeError(f"the compiled step returned {len(outputs)} tensors, expected the hidden states")
        return outputs[0]


def load_compiled_step(package: Path, moe: dict[int, nn.Module] | None = None, embedded: bool = True
                       ) -> CompiledStep:
    """The package's step; `embedded`: it takes embedding rows, as its engine.json says (False for
    packages built before, which take the ids)."""
    return CompiledStep(_PackageRunner(package), package, moe, embedded)
