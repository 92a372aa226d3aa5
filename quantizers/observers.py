"""Observers: the statistic that turns a tensor (or a stream of activations) into qparams.

Observers are separate from quantization algorithms (llm-compressor's split): RTN, GPTQ's group
scales, AWQ's final quantization and activation calibration all ask an observer, so a better
observer improves every quantizer.
"""

from __future__ import annotations

from typing import Callable

import torch

from lmfoundry.errors import UserError
from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs

WeightObserver = Callable[[torch.Tensor, QuantArgs, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]]


def minmax_observer(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale/zero point from the min and max of each group (channel, tensor)."""
    x = qmath.reduce_shape(w, args)
    scale, zp = qmath.qparams_from_range(x.amin(dim=-1), x.amax(dim=-1), args, scale_dtype)
    return _squeeze(scale, args), _squeeze(zp, args) if zp is not None else None


def mse_observer(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
    grid: int = 80, max_shrink: float = 0.8, norm: float = 2.4,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shrink each group's range by the factor in (1 - max_shrink, 1] that minimizes the
    L^norm reconstruction error. Clipping a few outliers lowers the error of everything else."""
    x = qmath.reduce_shape(w, args).float()
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    best_err = torch.full_like(lo, float("inf"))
    best_scale = best_zp = None
    for i in range(int(grid * max_shrink) + 1):
        p = 1.0 - i / grid
        scale, zp = qmath.qparams_from_range(lo * p, hi * p, args, scale_dtype)
        s, z = _squeeze(scale, args), _squeeze(zp, args) if zp is not None else None
        err = (qmath.fake_quantize(w.float(), s, z, args) - w.float()).abs().pow(norm)
        err = qmath.reduce_shape(err, args).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = scale if best_scale is None else torch.where(better, scale, best_scale)
        if zp is not None:
            best_zp = zp if best_zp is None else torch.where(better, zp, best_zp)
    assert best_scale is not None, "the grid has at least one point"
    return _squeeze(best_scale, args), _squeeze(best_zp, args) if best_zp is not None else None


def _squeeze(t: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """[out, groups] for group, [out, 1] for channel, [1] for tensor."""
    if args.strategy == "tensor":
        return t.reshape(1)
    return t.reshape(t.shape[0], -1)


WEIGHT_OBSERVERS: dict[str, WeightObserver] = {"minmax": minmax_observer, "mse": mse_observer}


def weight_observer(name: str) -> WeightObserver:
    try:
        return WEIGHT_OBSERVERS[name]
    except KeyError:
        raise UserError(f"unknown observer {name!r}; known: {', '.join(WEIGHT_OBSERVERS)}") from None
