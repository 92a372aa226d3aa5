"""Paged attention over a block table: prefill (causal, variable lengths) and decode.

Both read K/V from the cache layout of `kv_cache.py` (fp16/bf16, int8 or fp8 with per-KV-head
scales). Quantized codes are converted to the model dtype exactly (int8 and e4m3 values are
representable in fp16 and bf16), and the per-head scales are applied outside the dot products: the
key scale folds into the softmax scale, the value scale into the final normalisation — one scalar
multiply each instead of a dequantization per element.

Prefill: queries of B sequences packed as [sum(q_len), Hq, D] with `cu_seqlens_q` [B+1]; each
sequence's keys are the first `ctx_lens[b]` cache slots (its new tokens already stored), so the
same kernel serves chunked prefill and prefix-cached prompts: query i of sequence b sits at
position ctx_lens[b] - q_len[b] + i and attends to keys ≤ that position. Flash-attention style
online softmax (exp2, fp32 state), P rounded to the model dtype for the PV tensor-core product.

Decode: one query per sequence [B, Hq, D]; one program per (head, sequence) streams the
sequence's blocks with fp32 reductions (no tensor cores: one query row is a matrix-vector product).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.dispatch import Executor, resolve
from lmfoundry.kernels.kv_cache import PagedKVCache, dequantize_kv, kv_quant_code
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, Support, TileConfig, next_pow2, triton_type

SUPPORT = Support(
    {
        "dtype": ("float16", "bfloat16"),
        "kv_dtype": ("auto", "int8", "fp8"),
        "block_size": (8, 16, 32, 64, 128),
        "head_dim": (64, 80, 96, 128, 256),
        "arch": (80, 86, 89, 90),
    },
    note="GQA with Hq a multiple of Hkv; fp8 KV needs sm_89+",
)


@triton.jit
def _kv_offsets(block_table_ptr, b, stride_bt, rj, mask_j, kvh,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr):
    page = tl.load(block_table_ptr + b * stride_bt + rj // PAGE, mask=mask_j, other=0).to(tl.int64)
    return page * (PAGE * NUM_KV_HEADS * HEAD_DIM) + (rj % PAGE) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM


@triton.jit
def paged_prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, cu_q_ptr, ctx_len_ptr, out_ptr,
    sm_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mb * BLOCK_M < q_len:
        ctx = tl.load(ctx_len_ptr + b)
        kvh = h // (NUM_Q_HEADS // NUM_KV_HEADS)
        dtype = q_ptr.dtype.element_ty
        rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        mask_m = rm < q_len
        mask_d = d < HEAD_DIM
        q_rows = (q_start + rm).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        pos = ctx - q_len + rm
        if KV_QUANT == 0:
            qk_scale = sm_scale * 1.4426950408889634
            v_scale = 1.0
        else:
            qk_scale = sm_scale * tl.load(k_scale_ptr + kvh) * 1.4426950408889634
            v_scale = tl.load(v_scale_ptr + kvh)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        end = tl.minimum(ctx, ctx - q_len + (mb + 1) * BLOCK_M)
        for j0 in range(0, end, BLOCK_N):
            rj = j0 + tl.arange(0, BLOCK_N)
            mask_j = rj < end
            off = _kv_offsets(block_table_ptr, b, stride_bt, rj, mask_j, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE)
            kv_mask = mask_j[:, None] & mask_d[None, :]
            k = tl.load(key_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
            s = tl.dot(q, tl.trans(k))
            visible = (rj[None, :] <= pos[:, None]) & mask_j[None, :]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(value_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v)
            m_i = m_new
        out = acc * (v_scale / l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(dtype),
                 mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def paged_decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, ctx_len_ptr, out_ptr,
    sm_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    kvh = h // (NUM_Q_HEADS // NUM_KV_HEADS)
    ctx = tl.load(ctx_len_ptr + b)
    d = tl.arange(0, BLOCK_D)
    mask_d = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=mask_d, other=0.0).to(tl.float32)
    if KV_QUANT == 0:
        qk_scale = sm_scale * 1.4426950408889634
        v_scale = 1.0
    else:
        qk_scale = sm_scale * tl.load(k_scale_ptr + kvh) * 1.4426950408889634
        v_scale = tl.load(v_scale_ptr + kvh)
    m_i = tl.full([1], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j0 in range(0, ctx, BLOCK_N):
        rj = j0 + tl.arange(0, BLOCK_N)
        mask_j = rj < ctx
        off = _kv_offsets(block_table_ptr, b, stride_bt, rj, mask_j, kvh, NUM_KV_HEADS, HEAD_DIM, PAGE)
        kv_mask = mask_j[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale
        s = tl.where(mask_j, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v = tl.load(value_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc * (v_scale / l_i)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


# ---- reference ----------------------------------------------------------------------------------


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
    hkv, page = cache.num_kv_heads, cache.block_size
    out = torch.empty_like(q)
    for b in range(len(ctx_lens)):
        start, stop, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(ctx_lens[b])
        if stop == start:
            continue
        blocks = block_table[b, : -(-ctx // page)].long()
        k = dequantize_kv(cache.key_cache[blocks].reshape(-1, hkv, cache.head_dim)[:ctx], cache.k_scale)
        v = dequantize_kv(cache.value_cache[blocks].reshape(-1, hkv, cache.head_dim)[:ctx], cache.v_scale)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        qb = q[start:stop].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        pos = ctx - (stop - start) + torch.arange(stop - start, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:stop] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def _cache_of(a: Mapping[str, torch.Tensor], s: Mapping[str, int]) -> PagedKVCache:
    return PagedKVCache(a["key_cache_ptr"], a["value_cache_ptr"], a["k_scale_ptr"], a["v_scale_ptr"])


def _prefill_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    t, hq, d = call.shape["T"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    nseq = call.shape["B"]
    q = torch.as_strided(a["q_ptr"], (t, hq, d), (a["stride_qt"], a["stride_qh"], 1))
    bt = torch.as_strided(a["block_table_ptr"], (nseq, a["block_table_ptr"].numel() // max(nseq, 1)), (a["stride_bt"], 1))
    out = reference(q, _cache_of(a, s), bt, a["cu_q_ptr"], a["ctx_len_ptr"], a["sm_scale"])
    torch.as_strided(a["out_ptr"], (t, hq, d), (a["stride_ot"], a["stride_oh"], 1)).copy_(out)


def _decode_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    nseq, hq, d = call.shape["B"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    q = torch.as_strided(a["q_ptr"], (nseq, hq, d), (a["stride_qb"], a["stride_qh"], 1))
    bt = torch.as_strided(a["block_table_ptr"], (nseq, a["block_table_ptr"].numel() // max(nseq, 1)), (a["stride_bt"], 1))
    cu = torch.arange(nseq + 1, dtype=torch.int32, device=q.device)
    out = reference(q, _cache_of(a, s), bt, cu, a["ctx_len_ptr"], a["sm_scale"])
    torch.as_strided(a["out_ptr"], (nseq, hq, d), (a["stride_ob"], a["stride_oh"], 1)).copy_(out)


def _prefill_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=max(16, next_pow2(shape["D"])))


def _decode_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_N=64, BLOCK_D=max(16, next_pow2(shape["D"])))


def _prefill_sass(arch: int, cfg: TileConfig, types: Mapping[str, str], sem: object) -> tuple[str, ...]:
    if arch >= 90 and cfg["BLOCK_M"] >= 64 and cfg.num_warps >= 4:
        return ("HGMMA",)
    return ("HMMA",)


_CACHE_PARAMS = (
    Param("key_cache_ptr", "*{kv}"),
    Param("value_cache_ptr", "*{kv}"),
    Param("k_scale_ptr", "*fp32"),
    Param("v_scale_ptr", "*fp32"),
    Param("block_table_ptr", "*i32"),
)
_SEMANTICS = ("NUM_Q_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "PAGE", "KV_QUANT")


def _attn_ints(shape: Mapping[str, int]) -> dict[str, int]:
    # q rows are views into the fused qkv output (or a separate q tensor): token stride q_stride.
    return {"stride_qt": shape["q_stride"], "stride_qh": shape["D"], "stride_ot": shape["Hq"] * shape["D"],
            "stride_oh": shape["D"], "stride_qb": shape["q_stride"], "stride_ob": shape["Hq"] * shape["D"]}


PREFILL = KernelDef(
    name="paged_prefill",
    fn=paged_prefill_kernel,
    params=(
        Param("q_ptr", "*{act}"),
        *_CACHE_PARAMS,
        Param("cu_q_ptr", "*i32"),
        Param("ctx_len_ptr", "*i32"),
        Param("out_ptr", "*{act}"),
        Param("sm_scale", "fp32"),
        Param("stride_qt", "i32", aligned=True),
        Param("stride_qh", "i32", aligned=True),
        Param("stride_ot", "i32", aligned=True),
        Param("stride_oh", "i32", aligned=True),
        Param("stride_bt", "i32"),
    ),
    grid=("cdiv(max_q_len, BLOCK_M)", "NUM_Q_HEADS", "B"),
    type_vars=("act", "kv"),
    semantics=_SEMANTICS,
    tiles=("BLOCK_M", "BLOCK_N", "BLOCK_D"),
    reference=_prefill_reference_call,
    default_config=_prefill_default,
    expect_sass=_prefill_sass,
    shape_ints=_attn_ints,
    static_shape=("Hq", "D"),
)

DECODE = KernelDef(
    name="paged_decode",
    fn=paged_decode_kernel,
    params=(
        Param("q_ptr", "*{act}"),
        *_CACHE_PARAMS,
        Param("ctx_len_ptr", "*i32"),
        Param("out_ptr", "*{act}"),
        Param("sm_scale", "fp32"),
        Param("stride_qb", "i32", aligned=True),
        Param("stride_qh", "i32", aligned=True),
        Param("stride_ob", "i32", aligned=True),
        Param("stride_oh", "i32", aligned=True),
        Param("stride_bt", "i32"),
    ),
    grid=("NUM_Q_HEADS", "B", "1"),
    type_vars=("act", "kv"),
    semantics=_SEMANTICS,
    tiles=("BLOCK_N", "BLOCK_D"),
    reference=_decode_reference_call,
    default_config=_decode_default,
    shape_ints=_attn_ints,
    static_shape=("Hq", "D"),
)


# ---- ops ----------------------------------------------------------------------------------------


def _check(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor) -> None:
    hq, d = q.shape[1], q.shape[2]
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous head dim")
    if d != cache.head_dim or hq % cache.num_kv_heads:
        raise ValueError(f"q heads/dim {hq}/{d} do not fit the cache's {cache.num_kv_heads}/{cache.head_dim}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be [B, max_blocks] with contiguous rows")


def _semantics(q: torch.Tensor, cache: PagedKVCache) -> dict[str, int]:
    return {
        "NUM_Q_HEADS": q.shape[1],
        "NUM_KV_HEADS": cache.num_kv_heads,
        "HEAD_DIM": q.shape[2],
        "PAGE": cache.block_size,
        "KV_QUANT": kv_quant_code(cache.key_cache.dtype, q.dtype),
    }


def paged_prefill(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries q [T, Hq, D]; returns [T, Hq, D] in q's dtype.

    `max_q_len` (the longest q_len) sizes the grid; passing it avoids a device-to-host sync.
    """
    _check(q, cache, block_table)
    t, hq, d = q.shape
    nseq = ctx_lens.numel()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    block_table = block_table.to(torch.int32)
    call = KernelCall(
        kernel=PREFILL,
        args={
            "q_ptr": q, "key_cache_ptr": cache.key_cache, "value_cache_ptr": cache.value_cache,
            "k_scale_ptr": cache.k_scale, "v_scale_ptr": cache.v_scale, "block_table_ptr": block_table,
            "cu_q_ptr": cu_seqlens_q.to(torch.int32).contiguous(), "ctx_len_ptr": ctx_lens.to(torch.int32).contiguous(),
            "out_ptr": out, "sm_scale": float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)),
            "stride_qt": q.stride(0), "stride_qh": q.stride(1), "stride_ot": out.stride(0), "stride_oh": out.stride(1),
            "stride_bt": block_table.stride(0),
        },
        types={"act": triton_type(q.dtype), "kv": triton_type(cache.key_cache.dtype)},
        semantics=_semantics(q, cache),
        shape={"T": t, "B": nseq, "max_q_len": int(max_q_len), "Hq": hq, "D": d},
    )
    resolve(executor, q).run(call)
    return out


def paged_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over each sequence's first ctx_lens[b] slots."""
    _check(q, cache, block_table)
    nseq, hq, d = q.shape
    out = torch.empty((nseq, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    block_table = block_table.to(torch.int32)
    call = KernelCall(
        kernel=DECODE,
        args={
            "q_ptr": q, "key_cache_ptr": cache.key_cache, "value_cache_ptr": cache.value_cache,
            "k_scale_ptr": cache.k_scale, "v_scale_ptr": cache.v_scale, "block_table_ptr": block_table,
            "ctx_len_ptr": ctx_lens.to(torch.int32).contiguous(), "out_ptr": out,
            "sm_scale": float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)),
            "stride_qb": q.stride(0), "stride_qh": q.stride(1), "stride_ob": out.stride(0), "stride_oh": out.stride(1),
            "stride_bt": block_table.stride(0),
        },
        types={"act": triton_type(q.dtype), "kv": triton_type(cache.key_cache.dtype)},
        semantics=_semantics(q, cache),
        shape={"B": nseq, "Hq": hq, "D": d},
    )
    resolve(executor, q).run(call)
    return out
