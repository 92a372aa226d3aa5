"""The CPU prefill kernel (`runtime/cpu/native/paged_prefill.c`) against the paged attention reference
(`paged_attention_common.reference`, one chunk at a time).

Error bound (`attention_bound(..., p_split=True)`, as for the decode kernel): scores in fp32 from
AVX-512 BF16 dot products of bf16 q and K, or float32 FMAs of them widened (products exact in fp32
either way), exp through a degree-6
polynomial, P kept in fp32, the online rescaling once per tile of 16 keys, PV and the normaliser
summed in fp32; each side rounds the output once. Outputs start as NaN: every chunk row must be
overwritten and every other row left alone.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, attention_bound, poisoned
from lmfoundry.kernels.kv_layout import PagedKVCache
from lmfoundry.kernels.paged_attention_common import reference
from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.paged_prefill import PagedPrefill, load_paged_prefill

kernel = load_paged_prefill()
pytestmark = pytest.mark.skipif(kernel is None,
                                reason=f"no prefill kernel (AVX-512 BF16 or AVX2): {unavailable_reason('paged_prefill')}")


def check(gen: torch.Generator, hq: int, hkv: int, d: int, chunks: list[tuple[int, int]], block_size: int = 16,
          threads: int | None = None) -> None:
    """Chunks of (context, new tokens) among padding rows, over a cache of shuffled blocks."""
    width = max(-(-(c + n) // block_size) for c, n in chunks)
    num_blocks = len(chunks) * width + 3
    cache = PagedKVCache.allocate(num_blocks, block_size, hkv, d, torch.bfloat16, "cpu")
    cache.key_cache.copy_(torch.randn(cache.key_cache.shape, generator=gen))
    cache.value_cache.copy_(torch.randn(cache.value_cache.shape, generator=gen))
    tables = torch.randperm(num_blocks, generator=gen)[: len(chunks) * width].view(len(chunks), width)
    tables = tables.to(torch.int32).contiguous()
    starts, row = [], 1
    for _, n in chunks:
        starts.append(row)
        row += n + 2  # rows between chunks belong to nobody (decodes, in the engine)
    q = (torch.randn(row, hq, d, generator=gen) * 2).to(torch.bfloat16)
    s = torch.tensor(starts, dtype=torch.int32)
    lens = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    contexts = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
    out = poisoned(tuple(q.shape), torch.bfloat16)
    kernel(q, cache.key_cache, cache.value_cache, tables, s, lens, contexts, out, threads=threads)
    mine = torch.zeros(row, dtype=torch.bool)
    for i, ((c, n), start) in enumerate(zip(chunks, starts, strict=True)):
        rows = slice(start, start + n)
        mine[rows] = True
        seqlens, keys = torch.tensor([0, n]), torch.tensor([c + n])
        ref = reference(q[rows], cache, tables[i : i + 1], seqlens, keys, d**-0.5)
        bound = attention_bound(q[rows], cache, tables[i : i + 1], seqlens, keys, ref, d**-0.5, torch.float32,
                                p_split=True)
        assert_within(out[rows], ref, bound, f"paged_prefill chunk (context {c}, {n} tokens)")
    assert torch.isnan(out[~mine].float()).all(), "rows outside the chunks were written"


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (16, 2, 64), (4, 1, 256)])
def test_matches_the_reference(gen, hq, hkv, d) -> None:
    check(gen, hq, hkv, d, [(0, 37), (45, 20), (3, 1), (16, 16)])


def test_long_prompt_and_prefix_hit_with_other_block_sizes(gen) -> None:
    check(gen, 9, 3, 64, [(0, 300), (288, 21)], block_size=16)
    check(gen, 6, 2, 64, [(5, 50), (0, 9)], block_size=8)
    check(gen, 6, 2, 64, [(31, 33)], block_size=32, threads=1)


def test_unsupported_arguments_are_refused(gen) -> None:
    cache = PagedKVCache.allocate(4, 16, 2, 64, torch.bfloat16, "cpu")
    q = torch.randn(5, 4, 64, generator=gen).to(torch.bfloat16)
    one = torch.zeros(1, dtype=torch.int32)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(q.float(), cache.key_cache, cache.value_cache, tables, one, one + 5, one, q.float())
    with pytest.raises(ValueError, match="int32"):
        kernel(q, cache.key_cache, cache.value_cache, tables, one.long(), one + 5, one, torch.empty_like(q))
    assert not PagedPrefill.supports(torch.bfloat16, 80) and not PagedPrefill.supports(torch.float32, 64)
    assert PagedPrefill.supports(torch.bfloat16, 128) and not PagedPrefill.supports(torch.bfloat16, 64, group=65)
