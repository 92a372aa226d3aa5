"""RMSNorm fused with dynamic per-token activation quantization (int8 / fp8 e4m3), one row a program.

One kernel covers four jobs the W8A8/FP8 runtime needs, chosen by constexprs:
  - optional residual add first (`h = x + residual`, the sum written back: the decoder's skip path),
  - optional RMSNorm (Hugging Face semantics: normalise in fp32, round to the model dtype, multiply
    by the weight in the model dtype),
  - output either in the model dtype (plain RMSNorm) or quantized: int8 (round half to even,
    clamp ±127) or fp8 e4m3 (saturate ±448), with a per-token scale amax/qmax computed here
    (dynamic) or one static per-tensor scale read from memory.
Without the norm it is the standalone per-token quantizer used before o_proj / down_proj.

All arithmetic is fp32 with explicit roundings to the model dtype where Hugging Face rounds, which
also keeps the kernel correct under Triton's interpreter (its bf16 arithmetic is not).
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type
from lmfoundry.kernels.w8a8_reference import QUANT_FP8, QUANT_INT8, QUANT_NONE, quantize_reference

SUPPORT = Support(
    {
        "dtype": ("float16", "bfloat16"),
        "quant": ("none", "int8", "fp8"),
        "arch": (80, 86, 89, 90),
    },
    note="fp8 output needs sm_89+",
)


@triton.jit
def rmsnorm_quant_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    H, stride_x, stride_r, stride_o, stride_ro, eps,
    APPLY_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, STATIC_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (h + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
        h = h.to(tl.float32)
    if APPLY_NORM:
        var = tl.sum(h * h, axis=0) / H
        inv = 1.0 / tl.sqrt(var + eps)
        normed = (h * inv).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = (normed * w).to(dtype).to(tl.float32)
    if QUANT == 0:
        tl.store(out_ptr + row * stride_o + cols, h.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if QUANT == 1:
            qmax = 127.0
            qmin = -128.0
            floor = 1e-10
        else:
            qmax = 448.0
            qmin = -448.0
            floor = 0.001953125  # 1 / 512
        if STATIC_SCALE:
            scale = tl.load(scale_ptr)
        else:
            amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0)
            scale = tl.maximum(amax, floor) / qmax
            tl.store(scale_ptr + row, scale)
        v = tl.minimum(tl.maximum(h / scale, qmin), qmax)
        if QUANT == 1:
            # (v + 1.5 * 2**23) - 1.5 * 2**23 rounds |v| < 2**22 to nearest even in fp32: the
            # same as torch.round, without libdevice (which the interpreter lacks).
            v = (v + 12582912.0) - 12582912.0
            tl.store(out_ptr + row * stride_o + cols, v.to(tl.int8), mask=mask)
        else:
            tl.store(out_ptr + row * stride_o + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


# ---- reference ----------------------------------------------------------------------------------


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama RMSNorm: fp32 normalisation, rounded to x's dtype, times the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,
    quant: int,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(output, scale or None, residual sum or None) for the kernel's semantics."""
    h = x
    res_out = None
    if residual is not None:
        h = (x.float() + residual.float()).to(x.dtype)
        res_out = h
    if weight is not None:
        h = rmsnorm_reference(h, weight, eps)
    if quant == QUANT_NONE:
        return h, None, res_out
    codes, scale = quantize_reference(h, quant, static_scale)
    return codes, scale, res_out


def _reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    rows, hdim = call.shape["M"], a["H"]

    def view(t: torch.Tensor, stride: int) -> torch.Tensor:
        return torch.as_strided(t, (rows, hdim), (stride, 1))

    x = view(a["x_ptr"], a["stride_x"])
    residual = view(a["res_ptr"], a["stride_r"]) if s["HAS_RESIDUAL"] else None
    weight = a["w_ptr"][:hdim] if s["APPLY_NORM"] else None
    static = a["scale_ptr"][:1] if s["STATIC_SCALE"] else None
    out, scale, res_out = reference(x, weight, a["eps"], residual, s["QUANT"], static)
    view(a["out_ptr"], a["stride_o"]).copy_(out)
    if res_out is not None:
        view(a["res_out_ptr"], a["stride_ro"]).copy_(res_out)
    if scale is not None and not s["STATIC_SCALE"]:
        a["scale_ptr"][:rows].copy_(scale)


def _default_config(shape: Mapping[str, int]) -> TileConfig:
    block = next_pow2(shape["H"])
    return TileConfig.make(num_warps=max(1, min(16, block // 256)), num_stages=1, BLOCK_H=block)


KERNEL = KernelDef(
    name="rmsnorm_quant",
    fn=rmsnorm_quant_kernel,
    params=(
        Param("x_ptr", "*{act}"),
        Param("res_ptr", "*{act}"),
        Param("w_ptr", "*{act}"),
        Param("out_ptr", "*{out}"),
        Param("res_out_ptr", "*{act}"),
        Param("scale_ptr", "*fp32"),
        Param("H", "i32", aligned=True),
        Param("stride_x", "i32", aligned=True),
        Param("stride_r", "i32", aligned=True),
        Param("stride_o", "i32", aligned=True),
        Param("stride_ro", "i32", aligned=True),
        Param("eps", "fp32"),
    ),
    grid=("M", "1", "1"),
    type_vars=("act", "out"),
    semantics=("APPLY_NORM", "HAS_RESIDUAL", "QUANT", "STATIC_SCALE"),
    tiles=("BLOCK_H",),
    reference=_reference_call,
    default_config=_default_config,
    shape_ints=lambda shape: {k: shape["H"] for k in ("H", "stride_x", "stride_r", "stride_o", "stride_ro")},
    static_shape=("H",),
)


# ---- op -----------------------------------------------------------------------------------------


def _quant_code(out_dtype: torch.dtype | None) -> int:
    if out_dtype is None:
        return QUANT_NONE
    if out_dtype == torch.int8:
        return QUANT_INT8
    if out_dtype == torch.float8_e4m3fn:
        return QUANT_FP8
    raise ValueError(f"quantized output must be int8 or float8_e4m3fn, got {out_dtype}")


def rmsnorm_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    *,
    quant_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
    static_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    launcher: Launcher | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """RMSNorm (weight given) and/or per-token quantization (quant_dtype given) of x [M, H].

    Returns (out, scale, residual_out): out in x's dtype or `quant_dtype`; scale fp32 [M] for
    dynamic quantization (the static scale when given, None without quantization); residual_out =
    x + residual in x's dtype when a residual is given.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("x must be 2-D and contiguous along the hidden dim")
    rows, hdim = x.shape
    quant = _quant_code(quant_dtype)
    if static_scale is not None and quant == QUANT_NONE:
        raise ValueError("a static scale only makes sense with a quantized output")
    if out is None:
        out = torch.empty((rows, hdim), dtype=quant_dtype or x.dtype, device=x.device)
    if quant != QUANT_NONE and static_scale is None and scale_out is None:
        scale_out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    scale_buf = static_scale.float().reshape(-1) if static_scale is not None else scale_out
    call = KernelCall(
        kernel=KERNEL,
        args={
            "x_ptr": x,
            "res_ptr": residual if residual is not None else x,
            "w_ptr": weight if weight is not None else x,
            "out_ptr": out,
            "res_out_ptr": residual_out if residual_out is not None else x,
            "scale_ptr": scale_buf if scale_buf is not None else torch.empty(1, dtype=torch.float32, device=x.device),
            "H": hdim,
            "stride_x": x.stride(0),
            "stride_r": residual.stride(0) if residual is not None else x.stride(0),
            "stride_o": out.stride(0),
            "stride_ro": residual_out.stride(0) if residual_out is not None else x.stride(0),
            "eps": float(eps),
        },
        types={"act": triton_type(x.dtype), "out": triton_type(out.dtype)},
        semantics={
            "APPLY_NORM": weight is not None,
            "HAS_RESIDUAL": residual is not None,
            "QUANT": quant,
            "STATIC_SCALE": static_scale is not None,
        },
        shape={"M": rows, "H": hdim},
    )
    resolve(launcher, x).run(call)
    scale = (static_scale.float().reshape(1) if static_scale is not None else scale_out) if quant else None
    return out, scale, residual_out
