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

Decode (`paged_decode`, FlashDecoding): one query per sequence [B, Hq, D]. Decode reads every
cached key and value once and does two flops per byte, so it is bound by memory bandwidth; what
matters is that enough programs stream the cache at once and that nothing is read twice:
  - split-K over the context: program (kv head, split, sequence) of `paged_decode_split_kernel`
    streams a contiguous run of whole KV blocks of its sequence and writes a partial softmax state
    (running max m, sum l, unnormalised accumulator); `paged_decode_reduce_kernel` merges the
    splits of each (sequence, head) with the log-sum-exp rule. The number of splits comes from
    batch x KV heads against the SM count (`decode_splits`): a batch that already fills the GPU
    runs one split, whose program writes the final output itself (no partials, no second launch);
  - GQA: the Hq / Hkv query heads that share a KV head are the M rows of one program's tensor-core
    dots (padded to 16), so each KV block is read once per KV head, not once per query head;
  - the block table is read one entry per KV block a tile touches; int8/fp8 codes are converted
    in registers after the load (scales folded as above).
P is fed to the PV product as two model-dtype terms (hi + lo, twice the tensor-core work on data
already in registers), so decode keeps the near-fp32 accuracy of the unsplit kernel it replaces.
`paged_decode_unsplit` (one program per query head, fp32 FMA reductions) is that earlier kernel,
kept as the baseline of the GPU benchmark.
"""

from __future__ import annotations

import functools
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


# FlashDecoding state conventions, shared by the kernels and their references:
#   m: running max of the scores in log2 units (score * sm_scale * k_scale * log2 e);
#   l: sum of 2^(score - m) * P_SCALE; acc: sum of 2^(score - m) * P_SCALE * v (v dequantized).
# P_SCALE = 2^8 scales P up before it is split into fp16 hi + lo (below): where those fall into
# fp16's subnormal range, their absolute error (2^-24) is then 2^-32 of the normaliser l, which is
# at least P_SCALE. A power of two, it is exact and cancels in acc / l. An empty split keeps
# m = EMPTY_MAX (finite, so merging never computes inf - inf), l = 0, acc = 0.
LOG2E = 1.4426950408889634
P_SCALE = 256.0
EMPTY_MAX = -1.0e30


@triton.jit
def paged_decode_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, ctx_len_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sm_scale, num_splits, min_split_pages, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    GROUP: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # elements between consecutive slots of a block
    dtype = q_ptr.dtype.element_ty
    ctx = tl.load(ctx_len_ptr + b)
    # Whole KV blocks per split: each block is read by exactly one program.
    n_pages = tl.cdiv(ctx, PAGE)
    chunk = tl.maximum(tl.cdiv(n_pages, num_splits), min_split_pages)
    start = split * chunk * PAGE
    end = tl.minimum(ctx, start + chunk * PAGE)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    mask_g = g < GROUP
    mask_d = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if KV_QUANT == 0:
        qk_scale = sm_scale * 1.4426950408889634
        v_scale = 1.0
    else:
        qk_scale = sm_scale * tl.load(k_scale_ptr + kvh) * 1.4426950408889634
        v_scale = tl.load(v_scale_ptr + kvh)
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * HEAD_DIM
    for j0 in range(start, end, BLOCK_N):
        rj = j0 + tl.arange(0, BLOCK_N)
        mask_j = rj < end
        if BLOCK_N <= PAGE:  # the tile lies inside one block: one table entry
            page = tl.load(table + j0 // PAGE).to(tl.int64)
            rows = page * (PAGE * ROW) + (rj % PAGE) * ROW
        else:  # the tile spans BLOCK_N // PAGE whole blocks: one entry each
            pidx = j0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
            pages = tl.load(table + pidx, mask=pidx * PAGE < end, other=0).to(tl.int64)
            rows = tl.reshape(pages[:, None] * (PAGE * ROW) + (tl.arange(0, PAGE) * ROW)[None, :], [BLOCK_N])
        off = rows + head_off
        if HEAD_DIM % 16 == 0:
            # Every row then starts 16-element aligned (so does the slot stride): said explicitly,
            # since the reshape above hides it from Triton's alignment analysis and the K/V loads
            # would otherwise be issued one element at a time instead of 16 bytes per thread.
            off = tl.multiple_of(off, 16)
        kv_mask = mask_j[:, None] & mask_d[None, :]
        k = tl.load(key_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(mask_j[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None]) * 256.0  # P_SCALE
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(dtype)
        # P in two model-dtype terms: |p - (hi + lo)| <= u^2 |p| (u: the dtype's unit roundoff).
        p_hi = p.to(dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(dtype)
        acc = tl.dot(p_hi, v, acc * alpha[:, None])
        acc = tl.dot(p_lo, v, acc)
        m_i = m_new
    acc = acc * v_scale
    if num_splits == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])
    else:
        part = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [B, Hq, S] row of each head
        tl.store(part_m_ptr + part, m_i, mask=mask_g)
        tl.store(part_l_ptr + part, l_i, mask=mask_g)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def paged_decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    base = (b.to(tl.int64) * NUM_Q_HEADS + h) * num_splits
    d = tl.arange(0, BLOCK_D)
    mask_d = d < HEAD_DIM
    m_i = tl.full([1], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        mask_s = rs < num_splits
        ms = tl.load(part_m_ptr + base + rs, mask=mask_s, other=-1.0e30)
        ls = tl.load(part_l_ptr + base + rs, mask=mask_s, other=0.0)
        accs = tl.load(part_acc_ptr + (base + rs)[:, None] * HEAD_DIM + d[None, :],
                       mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(ms, axis=0))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(ms - m_new)
        l_i = l_i * alpha + tl.sum(w * ls, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * accs, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
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
    out = torch.empty_like(q)
    for b in range(len(ctx_lens)):
        start, stop, ctx = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(ctx_lens[b])
        if stop == start:
            continue
        k, v = _sequence_kv(cache, block_table, b, ctx, hq)
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


def split_pages(ctx: int, page: int, num_splits: int, min_split_pages: int) -> int:
    """KV blocks per split for a sequence of `ctx` tokens: the kernel's rule, so that the
    reference writes the same partial states. A split never holds fewer than `min_split_pages`
    blocks, so a short sequence in a batch sized for a long one stays in one split."""
    pages = -(-ctx // page)
    return max(-(-pages // num_splits), min_split_pages)


def _sequence_kv(cache: PagedKVCache, block_table: torch.Tensor, b: int, ctx: int,
                 hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's first ctx keys and values, dequantized to fp32, repeated per query head."""
    hkv, page, d = cache.num_kv_heads, cache.block_size, cache.head_dim
    blocks = block_table[b, : -(-ctx // page)].long()
    k = dequantize_kv(cache.key_cache[blocks].reshape(-1, hkv, d)[:ctx], cache.k_scale)
    v = dequantize_kv(cache.value_cache[blocks].reshape(-1, hkv, d)[:ctx], cache.v_scale)
    return k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)


def decode_partials_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float,
    num_splits: int,
    min_split_pages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial softmax states the split kernel writes, in fp32: m, l [B, Hq, S] and acc
    [B, Hq, S, D] (conventions at `P_SCALE`); split s of sequence b covers its keys
    [s·c, (s+1)·c) with c = `split_pages(...)` · block_size."""
    nseq, hq, d = q.shape
    page = cache.block_size
    m = torch.full((nseq, hq, num_splits), EMPTY_MAX, dtype=torch.float32, device=q.device)
    total = torch.zeros((nseq, hq, num_splits), dtype=torch.float32, device=q.device)
    acc = torch.zeros((nseq, hq, num_splits, d), dtype=torch.float32, device=q.device)
    for b in range(nseq):
        ctx = int(ctx_lens[b])
        if ctx == 0:
            continue
        k, v = _sequence_kv(cache, block_table, b, ctx, hq)
        scores = torch.einsum("hd,khd->hk", q[b].float(), k) * (sm_scale * LOG2E)
        chunk = split_pages(ctx, page, num_splits, min_split_pages) * page
        for s in range(num_splits):
            lo, hi = s * chunk, min(ctx, (s + 1) * chunk)
            if lo >= hi:
                continue
            t = scores[:, lo:hi]
            m[b, :, s] = t.amax(-1)
            p = torch.exp2(t - m[b, :, s, None]) * P_SCALE
            total[b, :, s] = p.sum(-1)
            acc[b, :, s] = torch.einsum("hk,khd->hd", p, v[lo:hi])
    return m, total, acc


def merge_partials_reference(m: torch.Tensor, total: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp merge of split states [..., S] (acc [..., S, D]) into outputs [..., D], fp32:
    Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) l_s with M = max_s m_s (0 where every split is empty)."""
    w = torch.exp2(m - m.amax(-1, keepdim=True))
    num = (w[..., None] * acc).sum(-2)
    den = (w * total).sum(-1)
    return num / torch.where(den > 0, den, torch.ones_like(den))[..., None]


def _split_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    nseq, hq, d = call.shape["B"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    q = torch.as_strided(a["q_ptr"], (nseq, hq, d), (a["stride_qb"], a["stride_qh"], 1))
    bt = torch.as_strided(a["block_table_ptr"], (nseq, a["block_table_ptr"].numel() // max(nseq, 1)), (a["stride_bt"], 1))
    splits = int(a["num_splits"])
    if splits == 1:  # the kernel normalises and writes the output itself
        cu = torch.arange(nseq + 1, dtype=torch.int32, device=q.device)
        out = reference(q, _cache_of(a, s), bt, cu, a["ctx_len_ptr"], a["sm_scale"])
        torch.as_strided(a["out_ptr"], (nseq, hq, d), (a["stride_ob"], a["stride_oh"], 1)).copy_(out)
        return
    m, total, acc = decode_partials_reference(q, _cache_of(a, s), bt, a["ctx_len_ptr"], a["sm_scale"], splits,
                                          int(a["min_split_pages"]))
    a["part_m_ptr"].view(-1)[: m.numel()].copy_(m.reshape(-1))
    a["part_l_ptr"].view(-1)[: total.numel()].copy_(total.reshape(-1))
    a["part_acc_ptr"].view(-1)[: acc.numel()].copy_(acc.reshape(-1))


def _reduce_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    nseq, hq, d, splits = call.shape["B"], s["NUM_Q_HEADS"], s["HEAD_DIM"], int(a["num_splits"])
    n = nseq * hq * splits
    flat = {name: a[name].reshape(-1) for name in ("part_m_ptr", "part_l_ptr", "part_acc_ptr")}
    out = merge_partials_reference(flat["part_m_ptr"][:n].view(nseq, hq, splits),
                                   flat["part_l_ptr"][:n].view(nseq, hq, splits),
                                   flat["part_acc_ptr"][: n * d].view(nseq, hq, splits, d))
    torch.as_strided(a["out_ptr"], (nseq, hq, d), (a["stride_ob"], a["stride_oh"], 1)).copy_(out)


def _prefill_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=max(16, next_pow2(shape["D"])))


def _decode_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_N=64, BLOCK_D=max(16, next_pow2(shape["D"])))


def _split_default(shape: Mapping[str, int]) -> TileConfig:
    # BLOCK_G: the query heads of one KV head, padded to the 16 rows of an MMA tile. Wide heads
    # take shorter tiles so two pipeline stages of K and V fit Ada's 100 KiB of shared memory.
    group = shape["Hq"] // shape["Hkv"]
    return TileConfig.make(num_warps=4, num_stages=2, BLOCK_G=max(16, next_pow2(group)),
                           BLOCK_N=64 if shape["D"] <= 128 else 32, BLOCK_D=max(16, next_pow2(shape["D"])))


def _reduce_default(shape: Mapping[str, int]) -> TileConfig:
    return TileConfig.make(num_warps=4, num_stages=1, BLOCK_S=16, BLOCK_D=max(16, next_pow2(shape["D"])))


def _split_sass(arch: int, cfg: TileConfig, types: Mapping[str, str], sem: object) -> tuple[str, ...]:
    # The group of query heads is the M of both dots: below 64 rows Hopper has no wgmma shape for
    # it and uses mma.sync (HMMA), as Ampere and Ada do; FMA loops instead would be a regression.
    if arch >= 90 and cfg["BLOCK_G"] >= 64 and cfg.num_warps >= 4:
        return ("HGMMA", "HMMA")
    return ("HMMA",)


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

DECODE_SPLIT = KernelDef(
    name="paged_decode_split",
    fn=paged_decode_split_kernel,
    params=(
        Param("q_ptr", "*{act}"),
        *_CACHE_PARAMS,
        Param("ctx_len_ptr", "*i32"),
        Param("out_ptr", "*{act}"),
        Param("part_m_ptr", "*fp32"),
        Param("part_l_ptr", "*fp32"),
        Param("part_acc_ptr", "*fp32"),
        Param("sm_scale", "fp32"),
        Param("num_splits", "i32"),
        Param("min_split_pages", "i32"),
        Param("stride_qb", "i32", aligned=True),
        Param("stride_qh", "i32", aligned=True),
        Param("stride_ob", "i32", aligned=True),
        Param("stride_oh", "i32", aligned=True),
        Param("stride_bt", "i32"),
    ),
    grid=("NUM_KV_HEADS", "num_splits", "B"),
    type_vars=("act", "kv"),
    semantics=_SEMANTICS,
    tiles=("BLOCK_G", "BLOCK_N", "BLOCK_D"),
    reference=_split_reference_call,
    default_config=_split_default,
    expect_sass=_split_sass,
    shape_ints=_attn_ints,
    static_shape=("Hq", "D"),
)

DECODE_REDUCE = KernelDef(
    name="paged_decode_reduce",
    fn=paged_decode_reduce_kernel,
    params=(
        Param("part_m_ptr", "*fp32"),
        Param("part_l_ptr", "*fp32"),
        Param("part_acc_ptr", "*fp32"),
        Param("out_ptr", "*{act}"),
        Param("num_splits", "i32"),
        Param("stride_ob", "i32", aligned=True),
        Param("stride_oh", "i32", aligned=True),
    ),
    grid=("NUM_Q_HEADS", "B", "1"),
    type_vars=("act",),
    semantics=("NUM_Q_HEADS", "HEAD_DIM"),
    tiles=("BLOCK_S", "BLOCK_D"),
    reference=_reduce_reference_call,
    default_config=_reduce_default,
    shape_ints=lambda shape: {"stride_ob": shape["Hq"] * shape["D"], "stride_oh": shape["D"]},
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


# Split heuristic (see `decode_splits`).
CTAS_PER_SM = 2  # decode programs each SM should hold to keep enough loads in flight
MIN_SPLIT_TOKENS = 128  # a split below this spends more on its partial state than it saves
MAX_SPLITS = 128
WAVE_EFFICIENCY = 0.85  # the fewest splits whose last wave is at least this full (vs the best)


def decode_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int, page: int) -> int:
    """How many splits of the context FlashDecoding uses for a decode batch.

    Programs are (KV head, split, sequence); `batch` x `num_kv_heads` of them exist unsplit. A
    batch that already gives every SM `CTAS_PER_SM` programs is not split: one launch, no partial
    states. Otherwise the context is cut into more splits until the grid fills the SMs, each split
    holding at least `MIN_SPLIT_TOKENS` of the longest context (`max_context`, an upper bound known
    on the host: the block table's width times the block size, no device sync). Among the split
    counts that allows, the fewest whose waves are nearly as full as the best one's is taken:
    `programs · s / (CTAS_PER_SM · sm_count)` waves, the last one partly idle.
    """
    programs = batch * num_kv_heads
    slots = CTAS_PER_SM * sm_count
    if programs <= 0 or programs >= slots:
        return 1
    pages = -(-max(max_context, 1) // page)
    min_pages = -(-MIN_SPLIT_TOKENS // page)
    cap = max(1, min(MAX_SPLITS, pages // min_pages))
    efficiency: dict[int, float] = {}
    for s in range(1, cap + 1):
        if -(-pages // -(-pages // s)) != s:  # some of s splits would be empty: same work as fewer
            continue
        waves = programs * s / slots
        efficiency[s] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= WAVE_EFFICIENCY * best)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (a CPU gains nothing from splits)."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def paged_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
    num_splits: int | None = None,
    min_split_pages: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over each sequence's first ctx_lens[b] slots
    (FlashDecoding: split kernel, then the merge kernel when `num_splits` > 1).

    `num_splits` defaults to `decode_splits` for q's device with the block table's width as the
    context bound; a caller that replays CUDA graphs passes its own so the grid is fixed. Each
    split takes whole KV blocks, at least `min_split_pages` of them (default: `MIN_SPLIT_TOKENS`
    worth), so a short sequence in a batch split for a long one is not cut into slivers. Splits
    never change what is computed beyond fp32 rounding order.
    """
    _check(q, cache, block_table)
    nseq, hq, d = q.shape
    hkv, page = cache.num_kv_heads, cache.block_size
    if num_splits is None:
        num_splits = decode_splits(nseq, hkv, block_table.shape[1] * page, device_sm_count(q.device), page)
    if min_split_pages is None:
        min_split_pages = -(-MIN_SPLIT_TOKENS // page)
    if num_splits < 1 or min_split_pages < 1:
        raise ValueError(f"num_splits and min_split_pages must be at least 1, got {num_splits}, {min_split_pages}")
    out = torch.empty((nseq, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    block_table = block_table.to(torch.int32)
    if num_splits > 1:
        part_m = torch.empty((nseq, hq, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty((nseq, hq, num_splits), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((nseq, hq, num_splits, d), dtype=torch.float32, device=q.device)
    else:  # the kernel writes `out` directly and never touches the partial buffers
        part_m = part_l = part_acc = torch.empty(1, dtype=torch.float32, device=q.device)
    types = {"act": triton_type(q.dtype), "kv": triton_type(cache.key_cache.dtype)}
    sem = _semantics(q, cache)
    split = KernelCall(
        kernel=DECODE_SPLIT,
        args={
            "q_ptr": q, "key_cache_ptr": cache.key_cache, "value_cache_ptr": cache.value_cache,
            "k_scale_ptr": cache.k_scale, "v_scale_ptr": cache.v_scale, "block_table_ptr": block_table,
            "ctx_len_ptr": ctx_lens.to(torch.int32).contiguous(), "out_ptr": out,
            "part_m_ptr": part_m, "part_l_ptr": part_l, "part_acc_ptr": part_acc,
            "sm_scale": float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)),
            "num_splits": int(num_splits), "min_split_pages": int(min_split_pages),
            "stride_qb": q.stride(0), "stride_qh": q.stride(1), "stride_ob": out.stride(0), "stride_oh": out.stride(1),
            "stride_bt": block_table.stride(0),
        },
        types=types,
        semantics=sem,
        shape={"B": nseq, "Hq": hq, "Hkv": hkv, "D": d},
    )
    run = resolve(executor, q)
    run.run(split)
    if num_splits > 1:
        run.run(KernelCall(
            kernel=DECODE_REDUCE,
            args={"part_m_ptr": part_m, "part_l_ptr": part_l, "part_acc_ptr": part_acc, "out_ptr": out,
                  "num_splits": int(num_splits), "stride_ob": out.stride(0), "stride_oh": out.stride(1)},
            types={"act": types["act"]},
            semantics={"NUM_Q_HEADS": hq, "HEAD_DIM": d},
            shape={"B": nseq, "Hq": hq, "D": d},
        ))
    return out


def paged_decode_unsplit(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    executor: Executor | None = None,
) -> torch.Tensor:
    """The earlier decode kernel: one program per (query head, sequence), the whole context each,
    fp32 FMA reductions. Kept as the GPU benchmark's baseline for `paged_decode`."""
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
