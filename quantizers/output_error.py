"""The relative output error of each quantized linear, ‖X(W − Q)ᵀ‖_F / ‖XWᵀ‖_F over the
calibration inputs X it sees: the quantity GPTQ and AWQ minimize.

Why beside the weight error: ‖W − Q‖/‖W‖ does not rank methods by quality. GPTQ pushes each
column's rounding error onto columns the inputs excite little, so its weight error can exceed
round-to-nearest's while its output error (and the model's perplexity) is lower.

Why here, a statistic of the pipeline and not of a method (as the Hessian of hessian.py is its own
piece): every quantizer gets the same measurement, on the same inputs, without code of its own.
It is taken while the quantized linear runs in the pass that makes the next layer's inputs (the
quantized-layer pass, or GPTQ's single sequential pass), so it costs no extra pass: X are the
inputs the linear sees once the linears before it are quantized, W is the float weight the method
quantized (after any smoothing folded into it) and Q its dequantized codes.

Two ways to measure a group of linears sharing one input, whichever takes fewer products:
- direct: per batch, xWᵀ compared with the quantized output the pass computes anyway
  (N·C_in·C_out multiply-adds for N tokens);
- Gram: G = XᵀX accumulated over the batches (N·C_in²), then ‖X(W − Q)ᵀ‖² = tr(D G Dᵀ) with
  D = W − Q and ‖XWᵀ‖² = tr(W G Wᵀ) (C_out·C_in² once): cheaper where a group's outputs outnumber
  its inputs (q/k/v, gate/up).
GPTQ's own Hessian is not reused for the Gram form: it caps massive-activation tokens and weights
k/v rows by received attention, so it measures GPTQ's objective, not the plain output error every
method is compared on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmfoundry.distributed import ranks
from lmfoundry.model.config import input_groups
from lmfoundry.quantizers.base import get_linear


def gram_output_error(w: torch.Tensor, w_hat: torch.Tensor, gram: torch.Tensor) -> tuple[float, float]:
    """(‖X(W − Ŵ)ᵀ‖², ‖XWᵀ‖²) from G = XᵀX, in float64: tr(D G Dᵀ) and tr(W G Wᵀ)."""
    g = gram.double()
    w64 = w.double()
    d = w64 - w_hat.double()
    return float(((d @ g) * d).sum()), float(((w64 @ g) * w64).sum())


def prefers_gram(in_features: int, out_features: int, tokens: int) -> bool:
    """Whether the Gram form costs fewer multiply-adds than the direct one for a group whose
    members read `in_features` and together write `out_features`, over `tokens` rows."""
    return in_features * (tokens + out_features) < tokens * out_features


class OutputErrorMeter:
    """Per-linear output error of one decoder layer, measured by forward hooks on its linears.

    The pipeline calls `quantized(name, w)` with the float weight just before a linear's weight is
    replaced by its dequantized codes; from then on each call of the linear adds its batch. A
    linear's float weight (and its group's Gram matrix) is dropped as soon as it has seen
    `num_batches` batches, so at most the float weights of the linears between quantization and
    their last batch are held. `finish()` sums over data-parallel ranks and returns name → error.
    """

    def __init__(self, layer: nn.Module, names: list[str], num_batches: int, tokens: int,
                 gram: bool | None = None) -> None:
        self.names = list(names)
        self.num_batches = num_batches
        self._float: dict[str, torch.Tensor] = {}
        self._seen = dict.fromkeys(self.names, 0)
        self._sums = {n: [0.0, 0.0] for n in self.names}
        self._leader: dict[str, str] = {}  # member -> the group's first linear (whose hook adds to G)
        self._gram_mode: dict[str, bool] = {}
        self._grams: dict[str, torch.Tensor] = {}  # leader -> float64 XᵀX so far
        self._modules = {n: get_linear(layer, n) for n in self.names}
        for group in input_groups(self.names):
            shapes = [self._modules[n].weight.shape for n in group]
            use = gram if gram is not None else prefers_gram(shapes[0][1], sum(s[0] for s in shapes), tokens)
            for n in group:
                self._leader[n] = group[0]
                self._gram_mode[n] = use
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in self._modules.items()]

    def quantized(self, name: str, w_float: torch.Tensor) -> None:
        """Start measuring `name`: `w_float` is its float weight (the module's weight is about to
        become the dequantized codes)."""
        if name in self._seen:
            self._float[name] = w_float

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            w = self._float.get(name)
            if w is None:  # not quantized yet (a method's own statistics pass), or already measured
                return
            x = args[0].detach()
            with torch.no_grad():
                if self._gram_mode[name]:
                    leader = self._leader[name]
                    if name == leader:
                        x2 = x.reshape(-1, x.shape[-1]).float()
                        part = (x2.t() @ x2).double()
                        self._grams[leader] = part if leader not in self._grams else self._grams[leader].add_(part)
                else:
                    # the pass computed out = xQᵀ + b; xWᵀ is the one product added here
                    x2 = x.reshape(-1, x.shape[-1])
                    ref = x2 @ w.t().to(x2.dtype)
                    q_out = out.detach().reshape(-1, out.shape[-1])
                    bias = getattr(module, "bias", None)
                    if bias is not None:
                        q_out = q_out - bias
                    sums = self._sums[name]
                    sums[0] += float(torch.sum((q_out - ref).square(), dtype=torch.float64))
                    sums[1] += float(torch.sum(ref.square(), dtype=torch.float64))
            self._seen[name] += 1
            if self._seen[name] >= self.num_batches:
                self._close(name)
        return hook

    def _close(self, name: str) -> None:
        """This linear has seen its batches: turn a Gram into its sums; drop what it held."""
        w = self._float.pop(name, None)
        if w is None or not self._gram_mode[name]:
            return
        leader = self._leader[name]
        gram = self._grams.get(leader)
        if gram is not None:
            err2, ref2 = gram_output_error(w, self._modules[name].weight.data, gram)
            self._sums[name] = [err2, ref2]
        if not any(self._leader[n] == leader for n in self._float):
            self._grams.pop(leader, None)

    def finish(self) -> dict[str, float]:
        """Remove the hooks and return name → relative output error, summed over every rank's
        batches (linears that saw no input on any rank are left out)."""
        for h in self._handles:
            h.remove()
        for name in list(self._float):
            self._close(name)
        group = ranks()  # every rank walks the same names in the same order: its collectives match
        out = {}
        for n in self.names:
            err2, ref2, seen = (group.sum_number(v) for v in (*self._sums[n], self._seen[n]))
            if seen > 0 and ref2 > 0:
                out[n] = (err2 / ref2) ** 0.5
        return out
