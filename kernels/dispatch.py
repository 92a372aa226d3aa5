"""How a `KernelCall` gets executed: Triton JIT (or its interpreter), or the PyTorch reference.

The engine loader (`lmfoundry.runtime.kernel_set`) adds a third launcher that launches shipped cubins
through the CUDA driver. Every op function in this package takes `launcher=`; `None` means "pick
the natural one": Triton for CUDA tensors or when `TRITON_INTERPRET=1`, the reference otherwise.
"""

from __future__ import annotations

import os
from typing import Callable, Protocol

import torch

from lmfoundry.kernels.spec import KernelCall, TileConfig


def is_interpreter() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class Launcher(Protocol):
    def run(self, call: KernelCall) -> None:
        """Execute `call`, writing its output arguments in place."""
        ...


class ReferenceLauncher:
    """Runs each call's PyTorch reference (CPU serving, and ground truth in tests)."""

    name = "reference"

    def run(self, call: KernelCall) -> None:
        call.kernel.reference(call)


ConfigPicker = Callable[[KernelCall], TileConfig]


class JitLauncher:
    """Launches the Triton kernel through Triton's own JIT (compiles on first use per variant).

    `pick_config` chooses tiles (the engine loader passes the per-arch tables); by default each
    kernel's `default_config` is used.
    """

    name = "jit"

    def __init__(self, pick_config: ConfigPicker | None = None) -> None:
        self.pick_config = pick_config

    def config_for(self, call: KernelCall) -> TileConfig:
        if self.pick_config is not None:
            return self.pick_config(call)
        return call.kernel.default_config(call.shape)

    def run(self, call: KernelCall) -> None:
        config = self.config_for(call)
        grid = call.grid(config)
        if grid[0] * grid[1] * grid[2] == 0:
            return
        call.kernel.fn[grid](
            **call.args,
            **call.semantics,
            **dict(config.constexprs),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


_REFERENCE = ReferenceLauncher()
_JIT = JitLauncher()


def resolve(launcher: Launcher | None, *tensors: torch.Tensor | None) -> Launcher:
    """The launcher to use when the caller passed `launcher=None`."""
    if launcher is not None:
        return launcher
    if any(t is not None and t.is_cuda for t in tensors):
        return _JIT
    return _JIT if is_interpreter() else _REFERENCE
