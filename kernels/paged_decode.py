"""Paged-attention decode kernels (FlashDecoding), their definitions and PyTorch references.

The ops that launch them (`paged_attention.paged_decode`, `paged_decode_unsplit`) and the choice of
the split count live in `paged_attention.py`; prefill is in `paged_prefill.py`. Decode has a file
of its own because its kernels, the partial-state conventions they write and the references that
reproduce those states change together and with nothing in prefill.

One query per sequence, q [B, Hq, D]. Decode reads every cached key and value once and does two
flops per byte, so it is bound by memory bandwidth; what matters is that enough programs stream
the cache at once and that nothing is read twice:
  - split-K over the context: program (kv head, split, sequence) of `paged_decode_split_kernel`
    streams a contiguous run of whole KV blocks of its sequence and writes a partial softmax state
    (running max m, sum l, unnormalised accumulator); `paged_decode_reduce_kernel` merges the
    splits of each (sequence, head) with the log-sum-exp rule. A batch that already fills the GPU
    runs one split, whose program writes the final output itself (no partials, no second launch);
  - GQA: the Hq / Hkv query heads that share a KV head are the M rows of one program's tensor-core
    dots (padded to 16), so each KV block is read once per KV head, not once per query head;
  - the block table is read one entry per KV block a tile touches; int8/fp8 codes are converted
    in registers after the load (scales folded as in `paged_attention_common`).
P is fed to the PV product as two model-dtype terms (hi + lo, twice the tensor-core work on data
already in registers), so decode keeps the near-fp32 accuracy of the unsplit kernel it replaced.

That unsplit kernel (`paged_decode_kernel`, registry name `paged_decode`: one program per query
head over the whole context, fp32 FMA products) is kept as the GPU benchmark's baseline. It is not
a second copy of the loop: both kernels run `_decode_state`, the one online-softmax walk over a
run of KV blocks, with `FMA` choosing CUDA-core fp32 products for the baseline's single query row
and tensor-core products with P as hi + lo for a GQA group.
"""

from __future__ import annotations

from typing import Mapping

import torch
import triton
import triton.language as tl

from lmfoundry.kernels.kv_layout import PagedKVCache
from lmfoundry.kernels.paged_attention_common import (
    CACHE_PARAMS,
    LOG2E,
    SEMANTICS,
    attn_ints,
    cache_of,
    kv_scales,
    reference,
    sequence_kv,
    table_of,
)
from lmfoundry.kernels.spec import KernelCall, KernelDef, Param, TileConfig, next_pow2

# FlashDecoding state conventions, shared by the kernels and their references:
#   m: running max of the scores in log2 units (score * sm_scale * k_scale * log2 e);
#   l: sum of 2^(score - m) * P_SCALE; acc: sum of 2^(score - m) * P_SCALE * v (v dequantized).
# P_SCALE = 2^8 scales P up before it is split into fp16 hi + lo (below): where those fall into
# fp16's subnormal range, their absolute error (2^-24) is then 2^-32 of the normaliser l, which is
# at least P_SCALE. A power of two, it is exact and cancels in acc / l. An empty split keeps
# m = EMPTY_MAX (finite, so merging never computes inf - inf), l = 0, acc = 0.
P_SCALE = 256.0
EMPTY_MAX = -1.0e30


@triton.jit
def _decode_state(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, sm_scale,
    b, kvh, heads, mask_g, start, end, stride_qb, stride_qh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV_QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FMA: tl.constexpr,
):
    """Online softmax of query rows `heads` ([BLOCK_G], valid where `mask_g`) of sequence b over its
    keys [start, end) of KV head `kvh`, `start` a multiple of PAGE. Returns (m, l [BLOCK_G],
    acc [BLOCK_G, BLOCK_D]) in the conventions at `P_SCALE`, the value scale applied to acc.

    FMA (one query row, BLOCK_G = 1): q and the K/V codes in fp32, both products as fp32
    multiply-adds, P exact in fp32; otherwise q and the codes in the model dtype, both products on
    tensor cores, P as hi + lo. Scores are [BLOCK_G, BLOCK_N] (rows x keys) for the dots and
    [BLOCK_N, 1] (keys x row) for FMA, the layout its k * q product reduces into, so that no tile
    changes layout inside the loop; KEYS is the keys' axis."""
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM  # elements between consecutive slots of a block
    KEYS: tl.constexpr = 0 if FMA else 1
    d = tl.arange(0, BLOCK_D)
    mask_d = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if FMA:
        tl.static_assert(BLOCK_G == 1, "the FMA products take one query row")
        q = q.to(tl.float32)
    qk_scale, v_scale = kv_scales(k_scale_ptr, v_scale_ptr, kvh, sm_scale, KV_QUANT)
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
        k = tl.load(key_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if FMA:
            s = tl.expand_dims(tl.sum(k * q, axis=1), 1) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(tl.expand_dims(mask_j, 1 - KEYS), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=KEYS))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - tl.expand_dims(m_new, KEYS)) * 256.0  # P_SCALE
        l_i = l_i * alpha + tl.sum(p, axis=KEYS)
        v = tl.load(value_cache_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if FMA:
            acc = acc * alpha[:, None] + tl.sum(p * v, axis=0)[None, :]
        else:
            # P in two model-dtype terms: |p - (hi + lo)| <= u^2 |p| (u: the dtype's unit roundoff).
            p_hi = p.to(q.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(q.dtype)
            acc = tl.dot(p_hi, v, acc * alpha[:, None])
            acc = tl.dot(p_lo, v, acc)
        m_i = m_new
    return m_i, l_i, acc * v_scale


@triton.jit
def _store_output(out_ptr, b, heads, mask_g, l_i, acc, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """acc / l into the output rows `heads` of sequence b (0 where l = 0: no keys)."""
    d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_g[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit
def paged_decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, ctx_len_ptr, out_ptr,
    sm_scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The unsplit baseline: program (query head, sequence), the whole context, fp32 FMA products."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    heads = h + tl.arange(0, 1)
    mask_g = heads < NUM_Q_HEADS  # one row, always valid
    ctx = tl.load(ctx_len_ptr + b)
    m_i, l_i, acc = _decode_state(
        q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, sm_scale,
        b, h // (NUM_Q_HEADS // NUM_KV_HEADS), heads, mask_g, 0, ctx, stride_qb, stride_qh, stride_bt,
        NUM_KV_HEADS, HEAD_DIM, PAGE, KV_QUANT, 1, BLOCK_N, BLOCK_D, True)
    _store_output(out_ptr, b, heads, mask_g, l_i, acc, stride_ob, stride_oh, HEAD_DIM, BLOCK_D)


@triton.jit
def paged_decode_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, ctx_len_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    sm_scale, num_splits, min_split_pages, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """FlashDecoding: program (KV head, split, sequence) over the split's whole KV blocks, the KV
    head's query heads as the rows of tensor-core dots; one split writes the output itself."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    GROUP: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    ctx = tl.load(ctx_len_ptr + b)
    # Whole KV blocks per split: each block is read by exactly one program.
    n_pages = tl.cdiv(ctx, PAGE)
    chunk = tl.maximum(tl.cdiv(n_pages, num_splits), min_split_pages)
    start = split * chunk * PAGE
    end = tl.minimum(ctx, start + chunk * PAGE)
    g = tl.arange(0, BLOCK_G)
    mask_g = g < GROUP
    heads = kvh * GROUP + g
    m_i, l_i, acc = _decode_state(
        q_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, sm_scale,
        b, kvh, heads, mask_g, start, end, stride_qb, stride_qh, stride_bt,
        NUM_KV_HEADS, HEAD_DIM, PAGE, KV_QUANT, BLOCK_G, BLOCK_N, BLOCK_D, False)
    if num_splits == 1:
        _store_output(out_ptr, b, heads, mask_g, l_i, acc, stride_ob, stride_oh, HEAD_DIM, BLOCK_D)
    else:
        d = tl.arange(0, BLOCK_D)
        part = (b.to(tl.int64) * NUM_Q_HEADS + heads) * num_splits + split  # [B, Hq, S] row of each head
        tl.store(part_m_ptr + part, m_i, mask=mask_g)
        tl.store(part_l_ptr + part, l_i, mask=mask_g)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=mask_g[:, None] & (d < HEAD_DIM)[None, :])


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


# ---- references ---------------------------------------------------------------------------------


def split_pages(ctx: int, page: int, num_splits: int, min_split_pages: int) -> int:
    """KV blocks per split for a sequence of `ctx` tokens: the kernel's rule, so that the
    reference writes the same partial states. A split never holds fewer than `min_split_pages`
    blocks, so a short sequence in a batch sized for a long one stays in one split."""
    pages = -(-ctx // page)
    return max(-(-pages // num_splits), min_split_pages)


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
        k, v = sequence_kv(cache, block_table, b, ctx, hq)
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


def _decode_reference_call(call: KernelCall) -> None:
    """Both decode kernels when they write the output: the attention reference, one query each."""
    a, s = call.args, call.semantics
    nseq, hq, d = call.shape["B"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    q = torch.as_strided(a["q_ptr"], (nseq, hq, d), (a["stride_qb"], a["stride_qh"], 1))
    cu = torch.arange(nseq + 1, dtype=torch.int32, device=q.device)
    out = reference(q, cache_of(a), table_of(a, nseq), cu, a["ctx_len_ptr"], a["sm_scale"])
    torch.as_strided(a["out_ptr"], (nseq, hq, d), (a["stride_ob"], a["stride_oh"], 1)).copy_(out)


def _split_reference_call(call: KernelCall) -> None:
    a, s = call.args, call.semantics
    splits = int(a["num_splits"])
    if splits == 1:  # the kernel normalises and writes the output itself
        _decode_reference_call(call)
        return
    nseq, hq, d = call.shape["B"], s["NUM_Q_HEADS"], s["HEAD_DIM"]
    q = torch.as_strided(a["q_ptr"], (nseq, hq, d), (a["stride_qb"], a["stride_qh"], 1))
    m, total, acc = decode_partials_reference(q, cache_of(a), table_of(a, nseq), a["ctx_len_ptr"], a["sm_scale"],
                                              splits, int(a["min_split_pages"]))
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


# ---- definitions --------------------------------------------------------------------------------


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


_DECODE_HEAD = (Param("q_ptr", "*{act}"), *CACHE_PARAMS, Param("ctx_len_ptr", "*i32"), Param("out_ptr", "*{act}"))
_PARTIALS = (Param("part_m_ptr", "*fp32"), Param("part_l_ptr", "*fp32"), Param("part_acc_ptr", "*fp32"))
_OUT_STRIDES = (Param("stride_ob", "i32", aligned=True), Param("stride_oh", "i32", aligned=True))
_DECODE_STRIDES = (
    Param("stride_qb", "i32", aligned=True),
    Param("stride_qh", "i32", aligned=True),
    *_OUT_STRIDES,
    Param("stride_bt", "i32"),
)

DECODE = KernelDef(
    name="paged_decode",
    fn=paged_decode_kernel,
    params=(*_DECODE_HEAD, Param("sm_scale", "fp32"), *_DECODE_STRIDES),
    grid=("NUM_Q_HEADS", "B", "1"),
    type_vars=("act", "kv"),
    semantics=SEMANTICS,
    tiles=("BLOCK_N", "BLOCK_D"),
    reference=_decode_reference_call,
    default_config=_decode_default,
    shape_ints=attn_ints,
    static_shape=("Hq", "D"),
)

DECODE_SPLIT = KernelDef(
    name="paged_decode_split",
    fn=paged_decode_split_kernel,
    params=(*_DECODE_HEAD, *_PARTIALS, Param("sm_scale", "fp32"), Param("num_splits", "i32"),
            Param("min_split_pages", "i32"), *_DECODE_STRIDES),
    grid=("NUM_KV_HEADS", "num_splits", "B"),
    type_vars=("act", "kv"),
    semantics=SEMANTICS,
    tiles=("BLOCK_G", "BLOCK_N", "BLOCK_D"),
    reference=_split_reference_call,
    default_config=_split_default,
    expect_sass=_split_sass,
    shape_ints=attn_ints,
    static_shape=("Hq", "D"),
)

DECODE_REDUCE = KernelDef(
    name="paged_decode_reduce",
    fn=paged_decode_reduce_kernel,
    params=(*_PARTIALS, Param("out_ptr", "*{act}"), Param("num_splits", "i32"), *_OUT_STRIDES),
    grid=("NUM_Q_HEADS", "B", "1"),
    type_vars=("act",),
    semantics=("NUM_Q_HEADS", "HEAD_DIM"),
    tiles=("BLOCK_S", "BLOCK_D"),
    reference=_reduce_reference_call,
    default_config=_reduce_default,
    shape_ints=lambda shape: {"stride_ob": shape["Hq"] * shape["D"], "stride_oh": shape["D"]},
    static_shape=("Hq", "D"),
)
