"""The paged KV cache layout (in plain PyTorch; the store kernel is `paged_kv`, which writes it).

`key_cache` and `value_cache` are [num_blocks, block_size, Hkv, D] each, in the model dtype
(fp16/bf16), int8, or fp8 e4m3. A token's slot is `block * block_size + offset`; the block table
maps a sequence's logical blocks to physical ones. Quantized caches carry one fp32 scale per KV
head for keys and one for values (a per-tensor scale is the same value repeated), static across
the run (calibrated by the quantizer or 1.0), so a cached token never needs rewriting.

Quantization on write (the arithmetic of `lmfoundry.model.kv_quant` and compressed-tensors):
int8 saturates to [-128, 127] and rounds half to even; fp8 saturates to ±448 and rounds to nearest
even in the conversion. Slots < 0 are skipped (padding tokens).

Both executors share this layout: the reference executor's cache (`runtime.engine.kv_cache`) and
the kernels. It is kept apart from the Triton kernel so that a CPU engine uses it without
importing Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_NONE, KV_INT8, KV_FP8 = 0, 1, 2


def kv_code_max(cache_dtype: torch.dtype) -> float:
    """Largest code magnitude of a quantized cache dtype (1.0 for a float cache)."""
    return {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}.get(cache_dtype, 1.0)


def kv_quant_code(cache_dtype: torch.dtype, model_dtype: torch.dtype) -> int:
    if cache_dtype == torch.int8:
        return KV_INT8
    if cache_dtype == torch.float8_e4m3fn:
        return KV_FP8
    if cache_dtype == model_dtype:
        return KV_NONE
    raise ValueError(f"KV cache dtype {cache_dtype} with model dtype {model_dtype}")


@dataclass
class PagedKVCache:
    """One layer's cache tensors and scales (scales are ones for an unquantized cache)."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> "PagedKVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        ones = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            (k_scale if k_scale is not None else ones).float().to(device).expand(num_kv_heads).contiguous(),
            (v_scale if v_scale is not None else ones).float().to(device).expand(num_kv_heads).contiguous(),
        )

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.key_cache.shape[3]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> cache codes with per-head scales (identity cast when unquantized)."""
    if cache_dtype == torch.int8:
        v = (x.float() / scale.float()[:, None]).clamp(-128.0, 127.0)
        return torch.round(v).to(torch.int8)
    if cache_dtype == torch.float8_e4m3fn:
        v = (x.float() / scale.float()[:, None]).clamp(-448.0, 448.0)
        return v.to(torch.float8_e4m3fn)
    return x.to(cache_dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Cache codes [..., Hkv, D] -> fp32 values."""
    if codes.dtype in (torch.int8, torch.float8_e4m3fn):
        return codes.float() * scale.float()[:, None]
    return codes.float()


def store_reference(k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the cache slots (skipping slots < 0), quantizing on write."""
    keep = slots >= 0
    idx = slots[keep].long()
    flat_k = cache.key_cache.view(-1, cache.num_kv_heads, cache.head_dim)
    flat_v = cache.value_cache.view(-1, cache.num_kv_heads, cache.head_dim)
    flat_k[idx] = quantize_kv(k[keep], cache.k_scale, cache.key_cache.dtype)
    flat_v[idx] = quantize_kv(v[keep], cache.v_scale, cache.value_cache.dtype)
