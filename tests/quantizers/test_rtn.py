import torch

from lmfoundry.quantformat.scheme import QuantArgs
from lmfoundry.quantizers.rtn import rtn_quantize_weight


def test_rtn_error_decreases_with_bits():
    torch.manual_seed(0)
    w = torch.randn(32, 128)
    errs = [rtn_quantize_weight(w, QuantArgs(b, "int", True, "group", 32), torch.float32).metrics["weight_rel_error"]
            for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.01 and errs[0] < 1.0


def test_rtn_asym_exact_on_grid():
    """Weights that lie on an asymmetric 4-bit grid (as SmolLM2's Q4_1 ones do) are reproduced."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (16, 64)).float()
    codes[:, ::32] = 0.0
    codes[:, 1::32] = 15.0  # each group spans the full grid
    d = torch.rand(16, 2).repeat_interleave(32, 1) + 0.1
    # offsets that are whole steps (a zero point must be an integer code)
    m = -torch.randint(1, 15, (16, 2)).repeat_interleave(32, 1) * d
    w = codes * d + m
    qw = rtn_quantize_weight(w, QuantArgs(4, "int", False, "group", 32), torch.float32)
    assert qw.metrics["weight_rel_error"] < 1e-6
