"""Example calls of the KV-cache and attention kernels for the harness (harness.py): store_kv,
paged prefill, paged decode (unsplit, split and merged) and the merge alone, on random paged
caches, each checked against the attention reference within `error_bounds.attention_bound`.
"""

from __future__ import annotations

import math

import torch

from lmfoundry.kernels import error_bounds, kv_layout, paged_attention, paged_kv
from lmfoundry.kernels.dispatch import ReferenceLauncher
from lmfoundry.kernels.harness_example import TORCH_DTYPE, Example, nbytes
from lmfoundry.kernels.spec import KernelCall


def _cache(t_lens: list[int], hkv: int, d: int, page: int, act: torch.dtype, cache_dt: torch.dtype, gen, device):
    per_seq = [-(-n // page) for n in t_lens]
    nblocks = sum(per_seq) + 2
    perm = torch.randperm(nblocks, generator=gen)
    table = torch.zeros(len(t_lens), max(per_seq), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb]
        used += nb
    quantized = cache_dt in (torch.int8, torch.float8_e4m3fn)
    slots = torch.cat([table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page for b, n in enumerate(t_lens)])
    k = torch.randn(sum(t_lens), hkv, d, generator=gen).to(act)
    v = torch.randn(sum(t_lens), hkv, d, generator=gen).to(act)

    def scale(x: torch.Tensor) -> torch.Tensor | None:
        # Calibrated per-head scales (absmax / code max, 0-10 % headroom): nothing saturates.
        if not quantized:
            return None
        amax = x.float().abs().amax(dim=(0, 2))
        return amax / kv_layout.kv_code_max(cache_dt) * (1 + 0.1 * torch.rand(hkv, generator=gen))

    cache = kv_layout.PagedKVCache.allocate(nblocks, page, hkv, d, cache_dt, "cpu", scale(k), scale(v))
    kv_layout.store_reference(k, v, cache, slots.to(torch.int32))
    return cache, table, slots.to(torch.int32), k, v


def _to(cache: kv_layout.PagedKVCache, device) -> kv_layout.PagedKVCache:
    return kv_layout.PagedKVCache(*(t.to(device) for t in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale)))


def store_kv_example(kernel, types, sem, shape, device, gen) -> Example:
    t, hkv, d, page = shape["T"], sem["NUM_KV_HEADS"], sem["HEAD_DIM"], sem["PAGE"]
    act, cdt = TORCH_DTYPE[types["act"]], TORCH_DTYPE[types["kv"]]
    cache, _, slots, k, v = _cache([t], hkv, d, page, act, cdt, gen, "cpu")
    empty = kv_layout.PagedKVCache(error_bounds.poisoned(tuple(cache.key_cache.shape), cdt, device),
                                  error_bounds.poisoned(tuple(cache.key_cache.shape), cdt, device),
                                  cache.k_scale.to(device), cache.v_scale.to(device))
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    paged_kv.store_kv(k.to(device), v.to(device), empty, slots.to(device), launcher=Capture())
    written = slots.long()

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        for name, src, scale in (("key_cache_ptr", k, cache.k_scale), ("value_cache_ptr", v, cache.v_scale)):
            got = ran.args[name].cpu().view(-1, hkv, d)[written]
            error_bounds.assert_written(got, kernel)
            deq = kv_layout.dequantize_kv(got, scale)
            bound = (error_bounds.quantization_error(src.double().abs(), scale.double()[:, None], cdt)
                     if cdt in (torch.int8, torch.float8_e4m3fn) else torch.zeros_like(deq, dtype=torch.float64))
            error_bounds.assert_within(deq, src, bound, kernel)

    return Example(calls[0], ("key_cache_ptr", "value_cache_ptr"), 2 * nbytes(k) + 2 * t * hkv * d * cdt.itemsize, 0, check)


def causal_attention_flops(q_lens: list[int], ctx_lens: list[int], heads: int, head_dim: int) -> int:
    """FLOPs of causal attention when each sequence's q_len queries are its last positions: query
    j of a context n (j < q_len) sees n - q_len + j + 1 keys, and each (query, key) pair costs
    2·D for QK^T and 2·D for PV. Counting q_len · n pairs (the full rectangle) would double a
    prefill's work and halve nothing it measures."""
    pairs = sum(ql * (n - ql) + ql * (ql + 1) // 2 for ql, n in zip(q_lens, ctx_lens, strict=True))
    return 4 * head_dim * heads * pairs


def attention_example(kernel, types, sem, shape, device, gen) -> Example:
    hq, hkv, d, page = sem["NUM_Q_HEADS"], sem["NUM_KV_HEADS"], sem["HEAD_DIM"], sem["PAGE"]
    act, cdt = TORCH_DTYPE[types["act"]], TORCH_DTYPE[types["kv"]]
    nseq, ctx_len = shape.get("B", 2), shape.get("ctx", 80)
    # ragged by default (the masking paths); shape["uniform"] gives every sequence ctx tokens, the
    # batch a dense peer (SDPA on [B, H, ctx, D]) computes, for like-for-like timing
    lens = [ctx_len if shape.get("uniform") else ctx_len - 3 * i for i in range(nseq)]
    cache, table, _, _, _ = _cache(lens, hkv, d, page, act, cdt, gen, "cpu")
    ctx = torch.tensor(lens, dtype=torch.int32)
    sm = 1 / math.sqrt(d)
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    dcache = _to(cache, device)
    if kernel == "paged_prefill":
        q_lens = [min(n, shape.get("q_len", n)) for n in lens]
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to(act)
        out = error_bounds.poisoned(tuple(q.shape), act, device)
        paged_attention.paged_prefill(q.to(device), dcache, table.to(device), cu.to(device), ctx.to(device),
                                      max(q_lens), sm, out, launcher=Capture())
        flops = causal_attention_flops(q_lens, lens, hq, d)
        p_dtype = act
    elif kernel == "paged_decode":  # the unsplit baseline: fp32 FMA reductions
        cu = torch.arange(nseq + 1, dtype=torch.int32)
        q = torch.randn(nseq, hq, d, generator=gen).to(act)
        out = error_bounds.poisoned(tuple(q.shape), act, device)
        paged_attention.paged_decode_unsplit(q.to(device), dcache, table.to(device), ctx.to(device), sm, out,
                                             launcher=Capture())
        flops = 4 * d * hq * sum(lens)
        p_dtype = torch.float32
    else:  # paged_decode_split, with shape["splits"] (default 1: it writes the output itself)
        return _decode_split(kernel, {**shape, "Hq": hq}, act, cache, table, ctx, lens, gen, device)
    kv_bytes = 2 * sum(lens) * hkv * d * cdt.itemsize

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        error_bounds.assert_written(ran.args["out_ptr"], kernel)
        out_ref = ref.args["out_ptr"].cpu()
        bound = error_bounds.attention_bound(q, cache, table, cu, ctx, out_ref, sm, p_dtype)
        error_bounds.assert_within(ran.args["out_ptr"].cpu(), out_ref, bound, kernel)

    return Example(calls[0], ("out_ptr",), kv_bytes + 2 * nbytes(q), flops, check)


_PARTIALS = ("part_m_ptr", "part_l_ptr", "part_acc_ptr")


def _decode_calls(shape, act, cache, table, ctx, gen, device) -> tuple[list[KernelCall], torch.Tensor]:
    """The FlashDecoding calls (split, then merge when shape["splits"] > 1) on random queries. Each
    split takes at least shape["min_split_pages"] blocks (default 1: short contexts split too)."""
    q = torch.randn(len(ctx), shape["Hq"], cache.head_dim, generator=gen).to(act)
    out = error_bounds.poisoned(tuple(q.shape), act, device)
    calls: list[KernelCall] = []

    class Capture:
        def run(self, call: KernelCall) -> None:
            calls.append(call)

    paged_attention.paged_decode(q.to(device), _to(cache, device), table.to(device), ctx.to(device),
                                 1 / math.sqrt(cache.head_dim), out, launcher=Capture(),
                                 num_splits=shape.get("splits", 1), min_split_pages=shape.get("min_split_pages", 1))
    return calls, q


def _decode_check(kernel: str, q, cache, table, ctx, splits: int, outputs: tuple[str, ...]):
    """FlashDecoding's bound (`error_bounds.attention_bound` with p_split) against the attention reference;
    partial states are merged by the reference merge first."""
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32)
    sm = 1 / math.sqrt(cache.head_dim)
    exact = paged_attention.reference(q, cache, table, cu, ctx, sm)
    bound = error_bounds.attention_bound(q, cache, table, cu, ctx, exact, sm, q.dtype, p_split=True, splits=splits)

    def check(ran: KernelCall, ref: KernelCall, acc_u: error_bounds.Accumulation = error_bounds.U32) -> None:
        for name in outputs:
            error_bounds.assert_written(ran.args[name], f"{kernel}.{name}")
        if outputs == _PARTIALS:
            got = paged_attention.merge_partials_reference(*(ran.args[n].cpu() for n in _PARTIALS)).to(q.dtype)
        else:
            got = ran.args["out_ptr"].cpu()
        error_bounds.assert_within(got, exact, bound, kernel)

    return check


def _decode_split(kernel, shape, act, cache, table, ctx, lens, gen, device) -> Example:
    calls, q = _decode_calls(shape, act, cache, table, ctx, gen, device)
    split = calls[0]
    splits = int(split.args["num_splits"])
    outputs = ("out_ptr",) if splits == 1 else _PARTIALS
    d, hkv = cache.head_dim, cache.num_kv_heads
    state = nbytes(*(split.args[n] for n in _PARTIALS)) if splits > 1 else nbytes(split.args["out_ptr"])
    kv_bytes = 2 * sum(lens) * hkv * d * cache.key_cache.element_size()
    flops = 4 * d * q.shape[1] * sum(lens)
    return Example(split, outputs, kv_bytes + nbytes(q) + state, flops,
                   _decode_check(kernel, q, cache, table, ctx, splits, outputs), {"splits": splits})


def decode_reduce_example(kernel, types, sem, shape, device, gen) -> Example:
    """The merge alone, over partial states written by the reference split (bf16/fp16 KV of one
    KV head per shape["Hkv"], default 1, blocks of 16, shape["splits"] default 3)."""
    hq, d = sem["NUM_Q_HEADS"], sem["HEAD_DIM"]
    act = TORCH_DTYPE[types["act"]]
    nseq, ctx_len = shape.get("B", 2), shape.get("ctx", 80)
    lens = [ctx_len - 3 * i for i in range(nseq)]
    cache, table, _, _, _ = _cache(lens, shape.get("Hkv", 1), d, 16, act, act, gen, "cpu")
    ctx = torch.tensor(lens, dtype=torch.int32)
    splits = max(2, shape.get("splits", 3))
    calls, q = _decode_calls({**shape, "Hq": hq, "splits": splits}, act, cache, table, ctx, gen, device)
    split, merge = calls
    ReferenceLauncher().run(split)
    return Example(merge, ("out_ptr",), nbytes(*(split.args[n] for n in _PARTIALS), merge.args["out_ptr"]), 0,
                   _decode_check(kernel, q, cache, table, ctx, splits, ("out_ptr",)), {"splits": splits})
