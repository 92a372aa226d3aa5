"""Float32 linears in the FMA panels of `F32FmaGemm`: the deterministic mode's float32 swap
(`batch_invariant`), where every output is one FMA chain over the inputs in order whatever the
number of rows beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from lmfoundry.runtime.cpu.native.bf16_fma_gemm import F32FmaGemm, load_f32_fma_gemm


class FloatPanelLinear(nn.Module):
    """A dense float32 linear whose weight is stored in `F32FmaGemm`'s panels: every output is one
    FMA chain over the inputs in order, whatever the number of rows. The deterministic mode's
    float32 linear (a BLAS GEMM chooses its blocking, and so its summation order, by the row count:
    a token's logits then depend on the batch it is computed in). `.weight` unpacks a copy."""

    def __init__(self, linear: nn.Linear, gemm: F32FmaGemm) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.gemm = gemm
        self.panels = gemm.block(linear.weight)
        self.bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        rows = rows if rows.stride(1) == 1 else rows.contiguous()
        out = rows.new_empty(rows.shape[0], self.out_features)
        self.gemm(rows, self.panels, self.bias, out)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return F32FmaGemm.unblock(self.panels, self.out_features).contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float32 FMA panels"


def panel_float_linears(model: nn.Module) -> int:
    """Swap every dense float32 `nn.Linear` of a CPU model for a `FloatPanelLinear` (the
    deterministic mode's swap); returns how many. Raises ValueError where the product is not built
    (it needs AVX2 and FMA and a C compiler)."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    if not swaps:
        return 0
    gemm = load_f32_fma_gemm()
    if gemm is None:
        raise ValueError("no batch-invariant float32 product on this CPU (it needs AVX2, FMA and a C compiler)")
    for parent, name, child in swaps:
        setattr(parent, name, FloatPanelLinear(child, gemm))
    return len(swaps)
