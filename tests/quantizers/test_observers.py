"""Observers: the qparams they choose for a weight."""

import torch

from lmfoundry.quantformat import qmath
from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.observers import minmax_observer, mse_observer


def test_mse_observer_never_worse_than_minmax():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    w[0, 0] = 12.0  # an outlier that min-max must cover
    args = QuantArgs(4, "int", True, "group", 64)
    errs = []
    for obs in (minmax_observer, mse_observer):
        s, z = obs(w, args, torch.float32)
        errs.append((qmath.fake_quantize(w, s, z, args) - w).pow(2).sum().item())
    assert errs[1] < errs[0]
