"""The serving-time module swap for the elementwise parts of a bf16 model on CPU: RMSNorm, the
MLP's SiLU(gate) * up (`lmfoundry.runtime.cpu.native.norm_act`) and the rotary embedding of q and k
(`lmfoundry.runtime.cpu.native.rope`) run through one C pass each.

In eager PyTorch each is a chain of small ops: at a decode step their dispatch costs more than
their arithmetic, at a prefill chunk their passes over memory do (and SiLU's input, a strided view
of the fused gate/up product, is copied once more for down_proj). The swap is a second explicit
step after `prepack_dense_linears`, for serving only: calibration and evaluation outside the
engine keep the reference modules. Where a call's inputs do not fit the kernel (another dtype,
strided columns) it runs the reference, so the swapped model computes what it did before, to
within one bfloat16 rounding step per value (see norm_act.c).
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.model.reference import MLP, Attention, RMSNorm
from lmfoundry.runtime.cpu.native.norm_act import NormAct, load_norm_act
from lmfoundry.runtime.cpu.native.rope import load_rope

# Below some size the two PyTorch ops of SiLU(gate) * up cost less than one ctypes call (a single
# decode row of a small model); the norm's chain of six is always slower. Serving measures that
# size on its machine (`runtime.cpu.crossover.set_silu_mul_from`); this is the size elsewhere.
SILU_MUL_MIN_ELEMENTS = 8192


class NativeRMSNorm(RMSNorm):
    """`RMSNorm` (no offset, bf16 gain) through the one-pass kernel; shares the original's gain."""

    def __init__(self, norm: RMSNorm, kernel: NormAct) -> None:
        nn.Module.__init__(self)
        self.weight = norm.weight
        self.eps, self.offset = norm.eps, norm.offset
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.kernel.rms_norm(x, self.weight, self.eps)
        return out if out is not None else super().forward(x)


class NativeSiluMul:
    """`MLP.act_mul` for SiLU: bf16(silu(gate)) * up in one pass; None (the MLP's own ops run)
    for inputs below `min_elements` or ill-fitting ones. With `min_elements` 0 (the engine's
    deterministic mode) every size takes the same pass, float32 inputs included."""

    def __init__(self, kernel: NormAct, min_elements: int = SILU_MUL_MIN_ELEMENTS) -> None:
        self.kernel = kernel
        self.min_elements = min_elements

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        return self.kernel.silu_mul(gate, up) if gate.numel() >= self.min_elements else None


def swap_native_elementwise(model: nn.Module, batch_invariant: bool = False) -> int:
    """Swap the bf16 RMSNorms (Llama's, without Gemma's offset) for `NativeRMSNorm`, give SiLU
    MLPs `NativeSiluMul` and attention layers the one-call rotary (bit for bit the reference's;
    it declines other dtypes itself); returns how many modules changed (0 where the kernels are not
    built or are turned off: LMFOUNDRY_NATIVE_KERNELS=0). With `batch_invariant`, SiLU takes the
    C pass at every size (a row's result then never depends on the rows beside it), replacing an
    activation an earlier swap set."""
    kernel, rope = load_norm_act(), load_rope()
    if kernel is None or rope is None:
        return 0
    attentions = [m for m in model.modules() if isinstance(m, Attention) and m.rope is None]
    for attention in attentions:
        attention.rope = rope
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is RMSNorm and not child.offset and child.weight.dtype == torch.bfloat16
             and child.weight.device.type == "cpu"]
    for parent, name, child in swaps:
        setattr(parent, name, NativeRMSNorm(child, kernel))
    mlps = [m for m in model.modules() if isinstance(m, MLP) and m.gelu is None
            and (m.act_mul is None or batch_invariant)]
    for mlp in mlps:
        mlp.act_mul = NativeSiluMul(kernel, 0 if batch_invariant else SILU_MUL_MIN_ELEMENTS)
    return len(swaps) + len(mlps) + len(attentions)
