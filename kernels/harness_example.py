"""The example call the kernel harness builds (`Example`) and what every builder shares: the
torch dtype of each kernel type name and the bytes of its tensors.

A module of its own so that the builders of harness.py and harness_attention.py import it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lmfoundry.kernels import error_bounds
from lmfoundry.kernels.spec import KernelCall

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i8": torch.int8,
               "fp8e4nv": torch.float8_e4m3fn}


@dataclass
class Example:
    """A ready call of one kernel specialization on random inputs, the output arguments it writes,
    the bytes it moves and flops it does, and the check of its outputs against the reference."""

    call: KernelCall
    outputs: tuple[str, ...]
    bytes: int
    flops: int
    check: Callable[[KernelCall, KernelCall, error_bounds.Accumulation], None]  # (ran, reference, accumulation)
    notes: dict[str, Any] = field(default_factory=dict)

    def clone(self) -> KernelCall:
        """The call with fresh copies of its output buffers (inputs shared)."""
        args = dict(self.call.args)
        for name in self.outputs:
            args[name] = args[name].clone()
        return KernelCall(self.call.kernel, args, dict(self.call.types), dict(self.call.semantics), dict(self.call.shape))


def nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the given tensors (None counts nothing): what a call moves, for GB/s."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
