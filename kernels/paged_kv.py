"""The store-KV kernel: writes a step's K and V into the paged cache, quantizing on write.

The layout it writes, its quantization and the PyTorch reference it is checked against
(`store_reference`) are `kv_layout`'s, which a CPU engine uses without importing Triton.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.kv_layout import PagedKVCache, kv_quant_code, store_reference
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type

SUPPORT = Support(
    {
        "dtype": ("float16", "bfloat16"),
        "kv_dtype": ("auto", "int8", "fp8"),
        "block_size": (8, 16, 32, 64, 128),
        "head_dim": (64, 80, 96, 128, 256),
        "arch": (80, 86, 89, 90),
    },
    note="fp8 KV needs sm_89+",
)


@triton.jit
def _store_one(src_ptr, cache_ptr, scale_ptr, t, base, stride_t, stride_h, h, d, mask,
               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    x = tl.load(src_ptr + t * stride_t + h[:, None] * stride_h + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + base + h[:, None] * HEAD_DIM + d[None, :]
    if KV_QUANT == 0:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        scale = tl.load(scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)
        if KV_QUANT == 1:
            lo = -128.0
            hi = 127.0
        else:
            lo = -448.0
            hi = 448.0
        v = tl.minimum(tl.maximum(x.to(tl.float32) / scale[:, None], lo), hi)
        if KV_QUANT == 1:
            v = (v + 12582912.0) - 12582912.0  # round half to even (see norm_quant)
        tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV_QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :] & (slot >= 0)
    base = (slot // PAGE) * (PAGE * NUM_KV_HEADS * HEAD_DIM) + (slot % PAGE) * (NUM_KV_HEADS * HEAD_DIM)
    base = tl.where(slot >= 0, base, 0)
    _store_one(k_ptr, key_cache_ptr, k_scale_ptr, t, base, stride_kt, stride_kh, h, d, mask,
               NUM_KV_HEADS, HEAD_DIM, KV_QUANT)
    _store_one(v_ptr, value_cache_ptr, v_scale_ptr, t, base, stride_vt, stride_vh, h, d, mask,
               NUM_KV_HEADS, HEAD_DIM, KV_QUANT)


# ---- reference ----------------------------------------------------------------------------------


def _reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    t, hkv, d = call.shape["T"], s["NUM_KV_HEADS"], s["HEAD_DIM"]
    cache = PagedKVCache(a["key_cache_ptr"], a["value_cache_ptr"], a["k_scale_ptr"], a["v_scale_ptr"])
    k = torch.as_strided(a["k_ptr"], (t, hkv, d), (a["stride_kt"], a["stride_kh"], 1))
    v = torch.as_strided(a["v_ptr"], (t, hkv, d), (a["stride_vt"], a["stride_vh"], 1))
    store_reference(k, v, cache, a["slot_ptr"][:t])


def _default_config(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=1, BLOCK_H=next_pow2(shape["Hkv"]), BLOCK_D=next_pow2(shape["D"]))


KERNEL = KernelDef(
    name="store_kv",
    fn=store_kv_kernel,
    params=(
        Param("k_ptr", "*{act}"),
        Param("v_ptr", "*{act}"),
        Param("key_cache_ptr", "*{kv}"),
        Param("value_cache_ptr", "*{kv}"),
        Param("slot_ptr", "*i32"),
        Param("k_scale_ptr", "*fp32"),
        Param("v_scale_ptr", "*fp32"),
        Param("stride_kt", "i32", aligned=True),
        Param("stride_kh", "i32", aligned=True),
        Param("stride_vt", "i32", aligned=True),
        Param("stride_vh", "i32", aligned=True),
    ),
    grid=("T", "1", "1"),
    type_vars=("act", "kv"),
    semantics=("NUM_KV_HEADS", "HEAD_DIM", "PAGE", "KV_QUANT"),
    tiles=("BLOCK_H", "BLOCK_D"),
    reference=_reference_call,
    default_config=_default_config,
    shape_ints=lambda shape: {
        "stride_kt": shape["k_stride"], "stride_kh": shape["D"],
        "stride_vt": shape["k_stride"], "stride_vh": shape["D"],
    },
    static_shape=("Hkv", "D"),
)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor, launcher: Launcher | None = None
) -> None:
    """Write the new tokens' k/v [T, Hkv, D] into their cache slots (quantizing on write)."""
    t, hkv, d = k.shape
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be [T, Hkv, D] with a contiguous head dim")
    if (hkv, d) != (cache.num_kv_heads, cache.head_dim):
        raise ValueError(f"k is [T, {hkv}, {d}], cache holds [{cache.num_kv_heads}, {cache.head_dim}]")
    if not (cache.key_cache.is_contiguous() and cache.value_cache.is_contiguous()):
        raise ValueError("cache tensors must be contiguous")
    slots = slots.to(device=k.device, dtype=torch.int32).contiguous()
    call = KernelCall(
        kernel=KERNEL,
        args={
            "k_ptr": k, "v_ptr": v, "key_cache_ptr": cache.key_cache, "value_cache_ptr": cache.value_cache,
            "slot_ptr": slots, "k_scale_ptr": cache.k_scale, "v_scale_ptr": cache.v_scale,
            "stride_kt": k.stride(0), "stride_kh": k.stride(1), "stride_vt": v.stride(0), "stride_vh": v.stride(1),
        },
        types={"act": triton_type(k.dtype), "kv": triton_type(cache.key_cache.dtype)},
        semantics={
            "NUM_KV_HEADS": hkv,
            "HEAD_DIM": d,
            "PAGE": cache.block_size,
            "KV_QUANT": kv_quant_code(cache.key_cache.dtype, k.dtype),
        },
        shape={"T": t, "Hkv": hkv, "D": d},
    )
    resolve(launcher, k).run(call)
