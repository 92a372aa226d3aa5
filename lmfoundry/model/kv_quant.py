"""KV-cache storage arithmetic: what a quantized cache stores and what it hands back.

One place for the math, shared by the reference attention (`kv_round_trip`), the calibration
pass that chooses the scales and the paged cache of the serving runtime. Conventions follow vLLM
and compressed-tensors: a stored value is `k / k_scale` (fp8 e4m3, saturated to ±448) or
`round(k / k_scale)` (int8, saturated to [-128, 127]), and reading multiplies by the scale again.
All arithmetic runs in float32 whatever the model dtype, as the CUDA cache kernels do.

Scales are per tensor (shape [1], compressed-tensors strategy "tensor") or per KV head
(compressed-tensors strategy "attn_head", stored as [Hkv, 1, 1]); K/V tensors are laid out
[..., T, Hkv, D] here, so a per-head scale broadcasts as [Hkv, 1].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from lmfoundry.errors import UserError

if TYPE_CHECKING:
    from lmfoundry.quantformat.scheme import QuantArgs

# fn(k, v) -> what the cache hands back for them (quantize on write, dequantize on read)
KVRoundTrip = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0

# strategy names accepted for a KV cache (ours and compressed-tensors' spelling of per-head)
PER_TENSOR = ("tensor",)
PER_HEAD = ("head", "attn_head")


def kv_storage_dtype(kind: str) -> torch.dtype:
    """torch dtype of the cache for `kind` ("int" or "float", compressed-tensors' `type`)."""
    if kind == "float":
        return FP8_DTYPE
    if kind == "int":
        return torch.int8
    raise ValueError(f"KV cache type must be 'int' or 'float', got {kind!r}")


def kv_qmax(kind: str) -> float:
    """Largest magnitude a stored KV element can take (the denominator of absmax scales)."""
    return FP8_MAX if kind == "float" else INT8_MAX


def broadcast_scale(scale: torch.Tensor, num_kv_heads: int | None = None) -> torch.Tensor:
    """A [1] / 0-d / [Hkv] / [Hkv, 1, 1] scale reshaped to broadcast against [..., Hkv, D], in fp32."""
    s = scale.detach().float()
    if s.numel() == 1:
        return s.reshape(1, 1)
    if num_kv_heads is not None and s.numel() != num_kv_heads:
        raise ValueError(f"per-head KV scale has {s.numel()} entries for {num_kv_heads} KV heads")
    return s.reshape(-1, 1)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Store `x` [..., Hkv, D]: int8 codes or float8_e4m3fn values (the store-KV kernel's
    reference arithmetic, `lmfoundry.kernels.kv_layout.quantize_kv`)."""
    from lmfoundry.kernels.kv_layout import quantize_kv as store

    return store(x, per_head(scale, x.shape[-2]), kv_storage_dtype(kind))


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Read stored KV back: `q * scale` in float32 (the paged-attention kernels' reference),
    cast to the attention dtype."""
    from lmfoundry.kernels.kv_layout import dequantize_kv as load

    return load(q, per_head(scale, q.shape[-2])).to(dtype)


def per_head(scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A per-tensor or per-head scale as the kernels take it: fp32 [Hkv]."""
    return broadcast_scale(scale, num_kv_heads).reshape(-1).expand(num_kv_heads)


def kv_scales_from_absmax(absmax: torch.Tensor, kind: str, dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """Scale = absmax / qmax, stored in `dtype`; never zero (an all-zero head gets a tiny scale),
    and rounded *up* when the storage dtype is coarser than float32 so the observed maximum is
    never clipped by the rounding of its own scale."""
    s = absmax.float() / kv_qmax(kind)
    s = torch.where(s > 0, s, torch.full_like(s, torch.finfo(torch.float32).tiny))
    stored = s.to(dtype)
    if dtype != torch.float32:
        low = stored.float() < s
        stored = torch.where(low, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored)
    return stored.reshape(-1, 1, 1) if per_head else stored.reshape(1)


def check_kv_args(args: QuantArgs) -> bool:
    """Validate a KV scheme; returns True for per-head scales."""
    if args.num_bits != 8 or args.type not in ("int", "float"):
        raise UserError(f"KV cache quantization supports int8 and fp8 only, got {args.describe()}")
    if not args.symmetric:
        raise UserError("KV cache quantization is symmetric only (vLLM refuses asymmetric KV scales)")
    if args.dynamic:
        raise UserError("KV cache scales are static (calibrated); a dynamic KV scheme is not supported")
    if args.strategy in PER_TENSOR:
        return False
    if args.strategy in PER_HEAD:
        return True
    raise UserError(f"KV cache strategy {args.strategy!r}: expected 'tensor' or 'attn_head' (per head)")


def kv_round_trip_from_checkpoint(kv_args: QuantArgs, k_scale: torch.Tensor, v_scale: torch.Tensor) -> KVRoundTrip:
    """fn(k, v) -> what a cache with these scales hands back (quantize on write, dequantize on
    read). k/v: [..., T, Hkv, D]; scales [1] / 0-d (per tensor) or [Hkv] / [Hkv, 1, 1] (per head)."""
    per_head = check_kv_args(kv_args)
    kind = kv_args.type
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not per_head and s.numel() != 1:
            raise UserError(f"per-tensor KV scheme but {name} has shape {list(s.shape)}")
        if not torch.isfinite(s.float()).all() or (s.float() <= 0).any():
            raise UserError(f"KV {name} must be finite and positive, got {s.flatten()[:4].tolist()}")
    ks, vs = k_scale.detach().float().clone(), v_scale.detach().float().clone()

    def round_trip(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_kv(quantize_kv(k, ks, kind), ks, k.dtype),
                dequantize_kv(quantize_kv(v, vs, kind), vs, v.dtype))

    round_trip.k_scale, round_trip.v_scale, round_trip.kv_args = ks, vs, kv_args  # type: ignore[attr-defined]
    return round_trip
