"""RMSNorm (+ residual add) fused with dynamic/static per-token int8/fp8 quantization."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels import norm_quant, w8a8_reference
from lmfoundry.kernels.error_bounds import (
    U32,
    assert_within,
    assert_written,
    poisoned,
    quantization_error,
    rmsnorm_bound,
)

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("rows,hidden,dtype,residual", [(1, 576, torch.bfloat16, False), (5, 200, torch.float16, True),
                                                        (3, 64, torch.bfloat16, True)])
def test_rmsnorm(rows, hidden, dtype, residual, gen, device):
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    r = torch.randn(rows, hidden, generator=gen).to(dtype) if residual else None
    out = poisoned((rows, hidden), dtype, device)
    res_out = poisoned((rows, hidden), dtype, device) if residual else None
    norm_quant.rmsnorm_quant(x.to(device), w.to(device), 1e-5, residual=None if r is None else r.to(device),
                             out=out, residual_out=res_out)
    assert_written(out, "rmsnorm")
    ref, _, ref_res = norm_quant.reference(x, w, 1e-5, r, norm_quant.QUANT_NONE)
    h = ref_res if residual else x
    assert_within(out.cpu(), ref, rmsnorm_bound(h, w, ref, 1e-5), "rmsnorm")
    if residual:
        assert_written(res_out, "residual out")
        assert torch.equal(res_out.cpu(), ref_res), "x + residual is one correctly rounded add"


@pytest.mark.parametrize("quant_dtype", [torch.int8, E4M3])
@pytest.mark.parametrize("rows,hidden,dtype,norm,residual", [(1, 576, torch.bfloat16, True, False),
                                                             (7, 200, torch.float16, True, True),
                                                             (4, 96, torch.bfloat16, False, False)])
def test_dynamic_per_token_quant(quant_dtype, rows, hidden, dtype, norm, residual, gen, device):
    x = (torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).to(dtype)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype) if norm else None
    r = torch.randn(rows, hidden, generator=gen).to(dtype) if residual else None
    out = poisoned((rows, hidden), quant_dtype, device)
    scale = poisoned((rows,), torch.float32, device)
    norm_quant.rmsnorm_quant(x.to(device), None if w is None else w.to(device), 1e-6, quant_dtype=quant_dtype,
                             residual=None if r is None else r.to(device), out=out, scale_out=scale)
    assert_written(out, "codes")
    assert_written(scale, "scales")
    code = norm_quant._quant_code(quant_dtype)
    h_ref, _, res_ref = norm_quant.reference(x, w, 1e-6, r, norm_quant.QUANT_NONE)
    h_src = res_ref if residual else x
    h_err = rmsnorm_bound(h_src, w, h_ref, 1e-6) if norm else torch.zeros_like(h_ref, dtype=torch.float64)
    qmax = w8a8_reference.QMAX[code]
    # scale = amax/qmax: amax moves by at most the largest |h| error of the row.
    s_ref = h_ref.double().abs().amax(-1) / qmax
    s_bound = h_err.amax(-1) / qmax + 4 * U32 * s_ref
    assert_within(scale.cpu(), s_ref, s_bound, "scales")
    # Dequantized codes are within the rounding of the format of the kernel's own h.
    s = scale.cpu().double()[:, None]
    h_abs = h_ref.double().abs() + h_err
    q_err = quantization_error(h_abs, s, quant_dtype)
    assert_within(out.cpu().double() * s, h_ref, q_err + h_err, "dequantized codes")
    if code == norm_quant.QUANT_INT8:
        assert int(out.cpu().abs().max()) == 127, "the largest |h| of each row maps to ±127"


def test_static_scale_and_saturation(gen, device):
    """A static scale is used as given and never written; out-of-range values saturate."""
    x = torch.randn(6, 128, generator=gen).to(torch.float16)
    static = torch.tensor([x.float().abs().max().item() / 254])  # half the range: forces clamping
    out, scale, _ = norm_quant.rmsnorm_quant(x.to(device), None, quant_dtype=torch.int8, static_scale=static.to(device))
    assert scale.cpu().item() == pytest.approx(static.item())
    codes, _ = norm_quant.quantize_reference(x, norm_quant.QUANT_INT8, static)
    assert int(out.cpu().abs().max()) == 127
    q_err = static.double() / 2 * (1 + 8 * U32) + 4 * U32 * x.double().abs() / static.double()
    assert_within(out.cpu().double(), codes.double(), q_err / static.double() + 1e-12, "static codes")


def test_zero_row_gets_positive_scale(device):
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    out, scale, _ = norm_quant.rmsnorm_quant(x.to(device), None, quant_dtype=torch.int8)
    assert torch.all(scale.cpu() > 0) and torch.all(out.cpu() == 0)
