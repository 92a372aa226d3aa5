"""Paged attention over a block table: the ops (prefill, decode) and the decode split count.

Both read K/V from the cache layout of `kv_cache.py` (fp16/bf16, int8 or fp8 with per-KV-head
scales). The family is spread over four files along its seams, each small enough to read whole:
  - this one: what callers use — `paged_prefill`, `paged_decode` (FlashDecoding) and
    `paged_decode_unsplit` (the GPU benchmark's baseline), which check their inputs and build the
    kernel calls; `decode_splits`, the split count for a decode batch; `SUPPORT`; and, re-exported,
    every name the kernel files define for the registry, the harness and the tests;
  - `paged_prefill.py`: the causal prefill kernel (packed variable-length queries, chunked and
    prefix-cached prompts);
  - `paged_decode.py`: the decode kernels — one online-softmax body behind the split kernel, its
    log-sum-exp merge and the unsplit baseline — with the partial-state conventions and references;
  - `paged_attention_common.py`: what both kernel files share (scale folding, the fp32 reference).
The split heuristic stays here, next to the op that applies it, so that its constants are read
from this module (a test or a caller setting `paged_attention.MIN_SPLIT_TOKENS` changes the op).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from lmfoundry.kernels import paged_kv
from lmfoundry.kernels.dispatch import Launcher, resolve
from lmfoundry.kernels.kv_layout import PagedKVCache, kv_quant_code
from lmfoundry.kernels.paged_attention_common import LOG2E, reference
from lmfoundry.kernels.paged_decode import (
    DECODE,
    DECODE_REDUCE,
    DECODE_SPLIT,
    EMPTY_MAX,
    P_SCALE,
    decode_partials_reference,
    merge_partials_reference,
    paged_decode_kernel,
    paged_decode_reduce_kernel,
    paged_decode_split_kernel,
    split_pages,
)
from lmfoundry.kernels.paged_prefill import PREFILL, paged_prefill_kernel
from lmfoundry.kernels.spec import KernelCall, Support, triton_type

__all__ = [
    "CTAS_PER_SM", "DECODE", "DECODE_REDUCE", "DECODE_SPLIT", "EMPTY_MAX", "LOG2E", "MAX_SPLITS", "MIN_SPLIT_TOKENS",
    "PREFILL", "P_SCALE", "SUPPORT", "WAVE_EFFICIENCY", "decode_partials_reference", "decode_splits",
    "device_sm_count", "merge_partials_reference", "paged_decode", "paged_decode_kernel", "paged_decode_reduce_kernel",
    "paged_decode_split_kernel", "paged_decode_unsplit", "paged_prefill", "paged_prefill_kernel", "reference",
    "split_pages",
]

# attention reads what the KV store writes: the same dtypes, block sizes, head dims and archs
SUPPORT = Support(dict(paged_kv.SUPPORT.values), note="GQA with Hq a multiple of Hkv; fp8 KV needs sm_89+")


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


def _cache_args(q: torch.Tensor, cache: PagedKVCache, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                out: torch.Tensor, sm_scale: float | None) -> dict[str, Any]:
    """The arguments every attention kernel takes, by parameter name (`block_table` int32)."""
    return {
        "q_ptr": q, "key_cache_ptr": cache.key_cache, "value_cache_ptr": cache.value_cache,
        "k_scale_ptr": cache.k_scale, "v_scale_ptr": cache.v_scale, "block_table_ptr": block_table,
        "ctx_len_ptr": ctx_lens.to(torch.int32).contiguous(), "out_ptr": out,
        "sm_scale": float(sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])),
        "stride_bt": block_table.stride(0),
    }


def _decode_strides(q: torch.Tensor, out: torch.Tensor) -> dict[str, int]:
    return {"stride_qb": q.stride(0), "stride_qh": q.stride(1), "stride_ob": out.stride(0), "stride_oh": out.stride(1)}


def paged_prefill(
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    launcher: Launcher | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries q [T, Hq, D]; returns [T, Hq, D] in q's dtype.

    `max_q_len` (the longest q_len) sizes the grid; passing it avoids a device-to-host sync.
    """
    _check(q, cache, block_table)
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    block_table = block_table.to(torch.int32)
    call = KernelCall(
        kernel=PREFILL,
        args={
            **_cache_args(q, cache, block_table, ctx_lens, out, sm_scale),
            "cu_q_ptr": cu_seqlens_q.to(torch.int32).contiguous(),
            "stride_qt": q.stride(0), "stride_qh": q.stride(1), "stride_ot": out.stride(0), "stride_oh": out.stride(1),
        },
        types={"act": triton_type(q.dtype), "kv": triton_type(cache.key_cache.dtype)},
        semantics=_semantics(q, cache),
        shape={"T": t, "B": ctx_lens.numel(), "max_q_len": int(max_q_len), "Hq": hq, "D": d},
    )
    resolve(launcher, q).run(call)
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
    launcher: Launcher | None = None,
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
    split = KernelCall(
        kernel=DECODE_SPLIT,
        args={
            **_cache_args(q, cache, block_table, ctx_lens, out, sm_scale),
            "part_m_ptr": part_m, "part_l_ptr": part_l, "part_acc_ptr": part_acc,
            "num_splits": int(num_splits), "min_split_pages": int(min_split_pages),
            **_decode_strides(q, out),
        },
        types=types,
        semantics=_semantics(q, cache),
        shape={"B": nseq, "Hq": hq, "Hkv": hkv, "D": d},
    )
    run = resolve(launcher, q)
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
    launcher: Launcher | None = None,
) -> torch.Tensor:
    """The earlier decode kernel: one program per (query head, sequence), the whole context each,
    fp32 FMA products (the split kernel's body with one query row). Kept as the GPU benchmark's
    baseline for `paged_decode`."""
    _check(q, cache, block_table)
    nseq, hq, d = q.shape
    out = torch.empty((nseq, hq, d), dtype=q.dtype, device=q.device) if out is None else out
    block_table = block_table.to(torch.int32)
    call = KernelCall(
        kernel=DECODE,
        args={**_cache_args(q, cache, block_table, ctx_lens, out, sm_scale), **_decode_strides(q, out)},
        types={"act": triton_type(q.dtype), "kv": triton_type(cache.key_cache.dtype)},
        semantics=_semantics(q, cache),
        shape={"B": nseq, "Hq": hq, "D": d},
    )
    resolve(launcher, q).run(call)
    return out
