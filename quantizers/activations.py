"""Static activation scales: calibrate the per-tensor `input_scale` of W8A8 linears.

Shared by SmoothQuant (w8a8 static), FP8 (fp8-static) and any quantizer whose scheme asks for
static input activations. Statistics are collected through the pipeline's float pass (one hook per
*distinct* input: q/k/v read the same normed hidden state, gate/up too, so they get one recorder and
therefore one identical scale, which is what vLLM's fused qkv / gate_up kernels need).

A recorder keeps the per-channel absmax of its input (cheap, [K] floats) and, when asked, a
subsample of input rows (for SmoothQuant's α search). The per-tensor absmax of the input *after*
a per-channel smoothing x/s is max_j(absmax_j / s_j), so smoothing after calibration needs no
second pass.
"""

from __future__ import annotations

from typing import Callable

import torch

from lmfoundry.model.config import input_groups
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs, Scheme


class InputRecorder:
    """Per-channel absmax of one linear input over all calibration batches, plus an optional
    evenly spaced subsample of rows (at most `rows_per_batch` per batch)."""

    def __init__(self, rows_per_batch: int = 0) -> None:
        self.rows_per_batch = rows_per_batch
        self._absmax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.reduced = False  # combined over data-parallel ranks (once, when first read)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> None:
        if self.reduced:
            raise RuntimeError("InputRecorder called after its statistics were read")
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        a = x2.abs().amax(dim=0)
        self._absmax = a if self._absmax is None else torch.maximum(self._absmax, a)
        if self.rows_per_batch > 0:
            stride = max(1, x2.shape[0] // self.rows_per_batch)
            self.rows.append(x2[::stride][: self.rows_per_batch].clone())

    def _reduce(self) -> None:
        """Absmax over every rank's inputs and every rank's rows (rank order)."""
        from lmfoundry.distributed import ranks

        if self.reduced:
            return
        self.reduced = True
        group = ranks()
        if group.parallel and self._absmax is not None:
            group.max_(self._absmax)
            if self.rows_per_batch > 0:
                self.rows = [group.gather_rows(torch.cat(self.rows))]

    @property
    def absmax(self) -> torch.Tensor | None:
        """Per-channel absmax over all calibration inputs (of all data-parallel ranks)."""
        self._reduce()
        return self._absmax

    def channel_absmax(self) -> torch.Tensor:
        """`absmax` of a recorder that has seen data."""
        if self.absmax is None:
            raise RuntimeError("activation recorder saw no data")
        return self.absmax

    def sample(self) -> torch.Tensor:
        self._reduce()
        return torch.cat(self.rows) if self.rows else torch.empty(0)

    def tensor_absmax(self, divisor: torch.Tensor | None = None) -> torch.Tensor:
        """Absmax of the whole input (divided per channel by `divisor`, a smoothing vector)."""
        if self.absmax is None:
            raise RuntimeError("activation recorder saw no data")
        a = self.absmax if divisor is None else self.absmax / divisor.float()
        return a.amax().reshape(1)


def input_recorders(names: list[str], rows_per_batch: int = 0) -> tuple[
        dict[str, InputRecorder], dict[str, Callable[[torch.Tensor], None]]]:
    """One recorder per distinct input among `names`: (linear name -> recorder, hook name -> fn)."""
    recorders: dict[str, InputRecorder] = {}
    hooks: dict[str, Callable[[torch.Tensor], None]] = {}
    for group in input_groups(names):
        rec = InputRecorder(rows_per_batch)
        hooks[group[0]] = rec
        for n in group:
            recorders[n] = rec
    return recorders, hooks


def static_input_scale(absmax: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor symmetric scale for activations with range ±absmax (int8: /127, fp8: /448)."""
    scale, _ = qmath.qparams_from_range(-absmax.float(), absmax.float(), args, scale_dtype)
    return scale.reshape(1)


def static_input_scales(schemes: dict[str, Scheme], recorders: dict[str, InputRecorder],
                        scale_dtype: torch.dtype,
                        divisors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`{"<linear>.input_scale": [1] tensor}` for every linear whose scheme has static activations.
    `divisors[name]` is a smoothing vector already folded into that linear's input."""
    out: dict[str, torch.Tensor] = {}
    for name, scheme in schemes.items():
        if not scheme.needs_activation_calibration:
            continue
        act = scheme.input_activations
        assert act is not None  # needs_activation_calibration implies activation args
        if act.strategy != "tensor" or not act.symmetric:
            raise ValueError(f"static activations are calibrated per tensor, symmetric; got {act.describe()}")
        absmax = recorders[name].tensor_absmax((divisors or {}).get(name))
        out[f"{name}.input_scale"] = static_input_scale(absmax, act, scale_dtype)
    return out


def needs_static_activations(schemes: dict[str, Scheme]) -> bool:
    return any(s.needs_activation_calibration for s in schemes.values())
