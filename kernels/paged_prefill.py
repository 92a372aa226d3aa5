"""The causal paged-attention prefill kernel (`paged_prefill` in the registry) and its definition.

The op that launches it is `paged_attention.paged_prefill`; the decode kernels are in
`paged_decode.py` and what both share (scale folding, the fp32 reference) in
`paged_attention_common.py`. Prefill has a file of its own because nothing in it changes with
decode: its rows are queries, not the heads of a GQA group, and it masks causally.

Queries of B sequences are packed as [sum(q_len), Hq, D] with `cu_seqlens_q` [B+1]; each
sequence's keys are the first `ctx_lens[b]` cache slots (its new tokens already stored), so the
same kernel serves chunked prefill and prefix-cached prompts: query i of sequence b sits at
position ctx_lens[b] - q_len[b] + i and attends to keys ≤ that position. Flash-attention style
online softmax (exp2, fp32 state), P rounded to the model dtype for the PV tensor-core product.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.paged_attention_common import (
    CACHE_PARAMS,
    SEMANTICS,
    attn_ints,
    cache_of,
    kv_scales,
    reference,
    table_of,
)
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, TileConfig, next_pow2


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
        qk_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kvh, sm_scale, KV_QUANT)
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


def _prefill_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    t, hq, d = call.shape["T"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    q = torch.as_strided(a["q_ptr"], (t, hq, d), (a["stride_qt"], a["stride_qh"], 1))
    out = reference(q, cache_of(a), table_of(a, call.shape["B"]), a["cu_q_ptr"], a["ctx_len_ptr"], a["sm_scale"])
    torch.as_strided(a["out_ptr"], (t, hq, d), (a["stride_ot"], a["stride_oh"], 1)).copy_(out)


def _prefill_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=max(16, next_pow2(shape["D"])))


def _prefill_sass(arch: int, cfg: TileConfig, types: Mapping[str, str], sem: object) -> tuple[str, ...]:
    if arch >= 90 and cfg["BLOCK_M"] >= 64 and cfg.num_warps >= 4:
        return ("HGMMA",)
    return ("HMMA",)


PREFILL = KernelDef(
    name="paged_prefill",
    fn=paged_prefill_kernel,
    params=(
        Param("q_ptr", "*{act}"),
        *CACHE_PARAMS,
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
    semantics=SEMANTICS,
    tiles=("BLOCK_M", "BLOCK_N", "BLOCK_D"),
    reference=_prefill_reference_call,
    default_config=_prefill_default,
    expect_sass=_prefill_sass,
    shape_ints=attn_ints,
    static_shape=("Hq", "D"),
)
