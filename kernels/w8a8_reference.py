"""The W8A8 (int8) and FP8 (e4m3) arithmetic in plain PyTorch: per-token activation quantization
and the scaled GEMM. This is the one definition every executor shares: the reference model's
W8A8 / FP8 linears (`model.quantized_linear`) run it, and the Triton kernels (`norm_quant`,
`scaled_mm`) are checked against it. It is kept apart from them so that a CPU engine runs it
without importing Triton.
"""

from __future__ import annotations

import torch

QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2
QMAX = {QUANT_INT8: 127.0, QUANT_FP8: 448.0}
QMIN = {QUANT_INT8: -128.0, QUANT_FP8: -448.0}  # int8 codes span [-128, 127] (a static scale can reach -128)
# Floor of a row's absmax before the dynamic scale absmax / qmax: int8 only avoids 0/0 (an all-zero
# row quantizes to zeros whatever its scale); fp8 uses vLLM's minimum scale 1 / (448 * 512).
MIN_AMAX = {QUANT_INT8: 1e-10, QUANT_FP8: 1.0 / 512.0}


def quantize_reference(
    h: torch.Tensor, quant: int, static_scale: torch.Tensor | None = None, qmax: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization of h [M, H] -> (codes, fp32 scales [M] or the static one).

    This is the one definition of activation quantization: the kernel computes it, and the
    reference launcher's W8A8 / FP8 linears call it. `qmax` overrides the divisor of dynamic
    scales (127.5 reproduces compressed-tensors' fake quantization, which transformers runs)."""
    hf = h.float()
    divisor = QMAX[quant] if qmax is None else qmax
    if static_scale is not None:
        scale = static_scale.float().reshape(1).expand(hf.shape[0])
    else:
        scale = hf.abs().amax(-1).clamp(min=MIN_AMAX[quant]) / divisor
    v = (hf / scale[:, None]).clamp(QMIN[quant], QMAX[quant])
    if quant == QUANT_INT8:
        codes = torch.round(v).to(torch.int8)  # torch.round: half to even, as the kernel
    else:
        codes = v.to(torch.float8_e4m3fn)
    return codes, scale if static_scale is None else static_scale.float().reshape(1)


def scaled_mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The scaled GEMM's reference: int8 and e4m3 operands with fp32 scales a_scale [M|1], b_scale
    [N|1]. The reference launcher's W8A8 / FP8 linears run this function; the kernels are checked
    against it with accumulation-order bounds.

    int8: exact int32 dot products (`torch._int_mm`; cuBLASLt wants M > 16, so short inputs are
    padded with zero rows), then the fp32 epilogue acc * a_scale[m] * b_scale[n] (+ bias).
    e4m3 on CPU: both operands widened to float32 (exact: every e4m3 value, and every product of
    two, is a float32) and one fp32 GEMM, which is what `torch._scaled_mm` computes there (fp32
    accumulation of the dequantized operands, as transformers' and vLLM-CPU's FP8 linears do) at a
    small fraction of its CPU time (no fp8 arithmetic exists on these ISAs); then the epilogue.
    Elsewhere exact float64 sums and the same epilogue as int8."""
    if a.dtype == torch.int8 and b.dtype == torch.int8:
        m = a.shape[0]
        padded = torch.cat([a, a.new_zeros(17 - m, a.shape[1])]) if a.is_cuda and m <= 16 else a
        acc = torch._int_mm(padded, b.t())[:m].float()
    elif a.dtype == b.dtype == torch.float8_e4m3fn and not a.is_cuda:
        acc = a.float() @ b.float().t()
    else:
        acc = (a.double() @ b.double().t()).float()
    out = acc * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
