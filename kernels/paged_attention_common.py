"""What the prefill kernel (`paged_prefill.py`) and the decode kernels (`paged_decode.py`) share.

A module of its own so that both kernel files, and the op module `paged_attention.py` that imports
them, depend on it and not on each other: the per-KV-head scale folding (a `@triton.jit` helper
every attention kernel inlines), the fp32 attention reference over the block table that every
kernel's reference (and every test) compares against, and the parameter and constexpr declarations
the kernel definitions have in common.

Scales: quantized K/V codes are converted to the model dtype exactly (int8 and e4m3 values are
representable in fp16 and bf16) and the per-head scales are applied outside the dot products: the
key scale folds into the softmax scale, the value scale into the final normalisation — one scalar
multiply each instead of a dequantization per element.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.kv_layout import PagedKVCache, dequantize_kv
from lmfoundry.kernels.spec import Param

LOG2E = 1.4426950408889634


@triton.jit
def kv_scales(k_scale_ptr, v_scale_ptr, kvh, sm_scale, KV_QUANT: tl.constexpr):
    """(score scale in log2 units: sm_scale · k_scale · log2 e, value scale) of KV head `kvh`."""
    if KV_QUANT == 0:
        qk_scale = sm_scale * 1.4426950408889634
        v_scale = 1.0
    else:
        qk_scale = sm_scale * tl.load(k_scale_ptr + kvh) * 1.4426950408889634
        v_scale = tl.load(v_scale_ptr + kvh)
    return qk_scale, v_scale


# ---- kernel declarations ------------------------------------------------------------------------

CACHE_PARAMS = (
    Param("key_cache_ptr", "*{kv}"),
    Param("value_cache_ptr", "*{kv}"),
    Param("k_scale_ptr", "*fp32"),
    Param("v_scale_ptr", "*fp32"),
    Param("block_table_ptr", "*i32"),
)
SEMANTICS = ("NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "PAGE", "KV_QUANT")


def attn_ints(shape: Mapping[str, int]) -> dict[str, int]:
    """The aligned stride params' values for a shape (`KernelDef.shape_ints`)."""
    # q rows are views into the fused qkv output (or a separate q tensor): token stride q_stride.
    return {"stride_qt": shape["q_stride"], "stride_qh": shape["D"], "stride_ot": shape["Hq"] * shape["D"],
            "stride_oh": shape["D"], "stride_qb": shape["q_stride"], "stride_ob": shape["Hq"] * shape["D"]}


# ---- reference ----------------------------------------------------------------------------------


def cache_of(a: Mapping[str, torch.Tensor]) -> PagedKVCache:
    """The cache a kernel call's arguments point at."""
    return PagedKVCache(a["key_cache_ptr"], a["value_cache_ptr"], a["k_scale_ptr"], a["v_scale_ptr"])


def table_of(a: Mapping[str, torch.Tensor], nseq: int) -> torch.Tensor:
    """A kernel call's block table as [nseq, max_blocks]."""
    bt = a["block_table_ptr"]
    return torch.as_strided(bt, (nseq, bt.numel() // max(nseq, 1)), (int(a["stride_bt"]), 1))


def sequence_kv(cache: PagedKVCache, block_table: torch.Tensor, b: int, ctx: int,
                hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's first ctx keys and values, dequantized to fp32, repeated per query head."""
    hkv, page, d = cache.num_kv_heads, cache.block_size, cache.head_dim
    blocks = block_table[b, : -(-ctx // page)].long()
    k = dequantize_kv(cache.key_cache[blocks].reshape(-1, hkv, d)[:ctx], cache.k_scale)
    v = dequantize_kv(cache.value_cache[blocks].reshape(-1, hkv, d)[:ctx], cache.v_scale)
    return k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)


def reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries [T, Hq, D] over each sequence's cached keys, in fp32."""
    hq = q.shape[1]
    out = torch.empty_like(q)
    for b in range(len(ctx_lens)):
        start, stop, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(ctx_lens[b])
        if stop == start:
            continue
        k, v = sequence_kv(cache, block_table, b, ctx, hq)
        qb = q[start:stop].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        pos = ctx - (stop - start) + torch.arange(stop - start, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
