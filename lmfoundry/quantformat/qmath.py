"""Reference quantization arithmetic (plain PyTorch), shared by every quantizer and the runtime.

Conventions follow compressed-tensors so what we write decompresses bit-exactly in transformers
and vLLM: integer codes are signed (`[-2^(b-1), 2^(b-1)-1]`), zero points live in the same signed
range, and dequantization is `(q - zp) * scale` computed in the scale's dtype. Weights are 2-D
`[out, in]`; scales are `[out, in / group]` (group), `[out, 1]` (channel) or `[1]` (tensor).
"""

from __future__ import annotations

import torch

from lmfoundry.quantformat.scheme import QuantArgs

FP8_DTYPE = torch.float8_e4m3fn


def all_finite(t: torch.Tensor, rows: int = 256) -> bool:
    """No inf/NaN in `t`, checked `rows` rows at a time: `isfinite(t).all()` on a whole 14336²
    Hessian allocates about twice its size in temporaries."""
    if t.ndim == 0:
        return bool(torch.isfinite(t))
    return all(bool(torch.isfinite(t[i:i + rows]).all()) for i in range(0, t.shape[0], rows))


def reduce_shape(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View `w` [out, in] as [out, groups, group_size] so qparams reduce over the last dim."""
    out, cols = w.shape
    if args.strategy == "group":
        g = args.group_size  # validated by the caller (check_group_size); QuantArgs refuses None
        assert g is not None
        return w.reshape(out, cols // g, g)
    if args.strategy in ("channel", "token"):
        return w.reshape(out, 1, cols)
    if args.strategy == "tensor":
        return w.reshape(1, 1, -1)
    raise ValueError(f"strategy {args.strategy} not valid for a 2-D tensor")


def qparams_from_range(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point from observed ranges (range always includes 0, as compressed-tensors)."""
    min_vals = torch.minimum(min_vals.float(), torch.zeros_like(min_vals, dtype=torch.float32))
    max_vals = torch.maximum(max_vals.float(), torch.zeros_like(max_vals, dtype=torch.float32))
    span = args.qmax - args.qmin
    if args.symmetric or args.type == "float":
        absmax = torch.maximum(min_vals.abs(), max_vals.abs())
        scale = absmax / (args.qmax if args.type == "float" else span / 2)
        zp = None
    else:
        scale = (max_vals - min_vals) / span
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).eps))
    scale = scale.to(scale_dtype)
    # a scale that underflows in a half dtype would divide by zero
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(scale_dtype).tiny))
    if not (args.symmetric or args.type == "float"):
        zp = torch.clamp(torch.round(args.qmin - min_vals / scale.float()), args.qmin, args.qmax).to(torch.int8)
    return scale, zp


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs
) -> torch.Tensor:
    """Codes for `w` [out, in]: int8 (integer schemes) or float8_e4m3fn (fp8)."""
    x = reduce_shape(w, args).float()
    s = _expand(scale, x).float()
    if args.type == "float":
        return torch.clamp(x / s, args.qmin, args.qmax).to(FP8_DTYPE).reshape(w.shape)
    q = torch.round(x / s)
    if zp is not None:
        q = q + _expand(zp, x).float()
    return torch.clamp(q, args.qmin, args.qmax).to(torch.int8).reshape(w.shape)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`(q - zp) * scale` in the scale's dtype, exactly as compressed-tensors decompresses."""
    x = reduce_shape(q, args)
    s = _expand(scale, x)
    deq = x.to(s.dtype)
    if zp is not None:
        deq = deq - _expand(zp, x).to(s.dtype)
    deq = (deq * s).reshape(q.shape)
    return deq.to(dtype) if dtype is not None else deq


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    return dequantize(quantize(w, scale, zp, args), scale, zp, args, dtype=w.dtype)


def _expand(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a [out, groups] / [out, 1] / [1] parameter against x [out, groups, size]."""
    if t.numel() == 1:
        return t.reshape(1, 1, 1)
    return t.reshape(x.shape[0], x.shape[1], 1)


def check_group_size(name: str, in_features: int, args: QuantArgs) -> None:
    from lmfoundry.errors import UserError

    if args.strategy == "group" and args.group_size is not None and in_features % args.group_size != 0:
        raise UserError(
            f"group size {args.group_size} does not divide the input dimension {in_features} of {name}"
        )
