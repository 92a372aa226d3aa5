"""The CPU decode kernel (`runtime/cpu/native/paged_decode.c`) against its PyTorch reference.

Error bound (`attention_bound(..., p_split=True)`, as for the Triton FlashDecoding kernel): the
kernel scores in fp32 (AVX-512 BF16 dot products of bf16 q and K, whose products are exact in
fp32, or fp32 FMAs), takes exp through a degree-6 polynomial (relative error a few u32, inside the
bound's exp terms), sums PV and the normaliser in fp32 and merges partitions through one more exp
each; each side rounds the output once. P enters the PV product in the dtype the kernel reports
(`PagedDecode.p_dtype`): float32, or bfloat16 for bf16 attention on CPUs with AVX512-BF16, which
adds bf16's unit roundoff to every weight's relative error (p_dtype bfloat16, rounded once:
p_hi_lo=False). Outputs start as NaN: every decode row must be overwritten and every other row
left alone.
"""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.error_bounds import assert_within, attention_bound, poisoned
from lmfoundry.kernels.kv_layout import PagedKVCache
from lmfoundry.runtime.cpu.isa import features
from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.paged_decode import (
    MAX_PARTITION,
    load_paged_decode,
    paged_decode_reference,
    plan_partitions,
)

kernel = load_paged_decode()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"no native kernel: {unavailable_reason('paged_decode')}")


def case(gen: torch.Generator, dtype: torch.dtype, hq: int, hkv: int, d: int, lengths: list[int],
         block_size: int = 16, extra_rows: int = 3):
    """A random cache with shuffled blocks, one decode row per length among `extra_rows` others."""
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = len(lengths) * width + 4
    cache = PagedKVCache.allocate(num_blocks, block_size, hkv, d, dtype, "cpu")
    cache.key_cache.copy_(torch.randn(cache.key_cache.shape, generator=gen))
    cache.value_cache.copy_(torch.randn(cache.value_cache.shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: len(lengths) * width].view(len(lengths), width).to(torch.int32).contiguous()
    total = len(lengths) + extra_rows
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    rows = torch.randperm(total, generator=gen)[: len(lengths)].to(torch.int32)
    return cache, tables, torch.tensor(lengths, dtype=torch.int32), rows, q


def check(cache, tables, lengths, rows, q, threads: int | None = None) -> None:
    out = poisoned(tuple(q.shape), q.dtype)
    kernel(q, cache.key_cache, cache.value_cache, tables, lengths, rows, out, int(lengths.max()), threads=threads)
    ref = paged_decode_reference(q, cache.key_cache, cache.value_cache, tables, lengths, rows)
    d = q.shape[2]
    bound = attention_bound(q[rows.long()], cache, tables, torch.arange(len(lengths) + 1), lengths, ref, d**-0.5,
                            kernel.p_dtype(q.dtype, d), p_split=True, p_hi_lo=False)
    assert_within(out[rows.long()], ref, bound, "paged_decode")
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows.long()] = False
    assert torch.isnan(out[others].float()).all(), "rows that are not decodes were written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (16, 2, 80), (4, 1, 48)])
def test_matches_reference(gen, dtype, hq, hkv, d) -> None:
    """Head groups of 1-8, head sizes on and off the vector paths (80, 48: not multiples of 32),
    lengths of one token, one block, a block and one, and several partitions."""
    lengths = [1, 16, 17, 100, 2 * MAX_PARTITION + 37, 33]
    check(*case(gen, dtype, hq, hkv, d, lengths))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_sequence_is_split_across_threads(gen, threads) -> None:
    """A single decode (batch 1) is cut into partitions so every thread has work, and merged."""
    part_len, parts = plan_partitions(700, 1, threads, 16)
    assert parts > 1 and part_len % 16 == 0 and (parts - 1) * part_len < 700 <= parts * part_len
    check(*case(gen, torch.bfloat16, 9, 3, 64, [700]), threads=threads)


def test_bf16_weights_where_the_cpu_has_bf16_dot_products() -> None:
    """The kernel says which P it uses; bf16 only for bf16 attention on a whole number of 32-wide chunks."""
    assert kernel.p_dtype(torch.float32, 64) == torch.float32
    assert kernel.p_dtype(torch.bfloat16, 48) == torch.float32
    expected = torch.bfloat16 if features().get("avx512_bf16") else torch.float32  # of the path taken
    assert kernel.p_dtype(torch.bfloat16, 64) == expected


def test_block_size_other_than_16(gen) -> None:
    check(*case(gen, torch.float32, 6, 2, 64, [5, 40, 33], block_size=8))


def test_partition_plan() -> None:
    # enough items for every thread, short contexts: one partition, not split
    assert plan_partitions(480, 32, 2, 16) == (480, 1)
    # long contexts are split at MAX_PARTITION whatever the batch
    part_len, parts = plan_partitions(3 * MAX_PARTITION, 32, 2, 16)
    assert parts == 3 and part_len == MAX_PARTITION
    # never below 64 tokens a partition
    assert plan_partitions(40, 1, 16, 16) == (48, 1)


def test_bad_arguments_are_refused(gen) -> None:
    cache, tables, lengths, rows, q = case(gen, torch.bfloat16, 9, 3, 64, [20])
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="dtypes"):
        kernel(q.float(), cache.key_cache, cache.value_cache, tables, lengths, rows, out.float(), 20)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, cache.key_cache, cache.value_cache, tables.long(), lengths, rows, out, 20)
    with pytest.raises(ValueError, match="refused"):  # 9 query heads over 2 KV heads: no whole group
        kernel(q[:, :9], cache.key_cache[:, :, :2].contiguous(), cache.value_cache[:, :, :2].contiguous(),
               tables, lengths, rows, out, 20)


def test_turned_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LMFOUNDRY_NATIVE_KERNELS", "0")
    assert load_paged_decode() is None
    assert unavailable_reason("paged_decode") == "LMFOUNDRY_NATIVE_KERNELS=0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_plan_gives_a_query_the_same_output_in_any_batch(gen, dtype) -> None:
    """With `batch_invariant` a query's partitions follow its own context (fixed length), so its
    output is bit for bit the same alone, beside longer contexts, at any thread count; the result
    still matches the reference."""
    lengths = [700, 5, 2 * MAX_PARTITION + 37, 64, 300]
    cache, tables, lens, rows, q = case(gen, dtype, 9, 3, 64, lengths, extra_rows=0)
    whole = poisoned(tuple(q.shape), dtype)
    kernel(q, cache.key_cache, cache.value_cache, tables, lens, rows, whole, int(lens.max()), batch_invariant=True)
    ref = paged_decode_reference(q, cache.key_cache, cache.value_cache, tables, lens, rows)
    bound = attention_bound(q[rows.long()], cache, tables, torch.arange(len(lengths) + 1), lens, ref, 64**-0.5,
                            kernel.p_dtype(dtype, 64), p_split=True, p_hi_lo=False)
    assert_within(whole[rows.long()], ref, bound, "paged_decode (batch-invariant)")
    for i in range(len(lengths)):
        for threads in (1, 2, 3):
            alone = poisoned(tuple(q.shape), dtype)
            kernel(q, cache.key_cache, cache.value_cache, tables[i : i + 1], lens[i : i + 1], rows[i : i + 1], alone,
                   int(lens[i]), threads=threads, batch_invariant=True)
            r = int(rows[i])
            assert torch.equal(alone[r], whole[r]), (i, threads)
    default = poisoned(tuple(q.shape), dtype)  # the default plan splits a lone query to feed the threads
    kernel(q, cache.key_cache, cache.value_cache, tables[:1], lens[:1], rows[:1], default, 700, threads=3)
    from lmfoundry.runtime.cpu.isa import isa

    # the control: the split plan sums in another order. The AVX2 path accumulates bf16 in float32
    # and rounds the output to bf16, where those last bits can vanish; float32 checks it everywhere.
    if dtype == torch.float32 or isa() != "avx2":
        assert not torch.equal(default[int(rows[0])], whole[int(rows[0])])


def test_batch_invariant_plan_bounds_its_partial_results(gen, monkeypatch) -> None:
    """Rows whose partial results would exceed WORK_FLOATS go in several calls: same outputs."""
    import lmfoundry.runtime.cpu.native.paged_decode as module

    cache, tables, lens, rows, q = case(gen, torch.bfloat16, 9, 3, 64, [600, 40, 1100, 7], extra_rows=0)
    one = poisoned(tuple(q.shape), torch.bfloat16)
    kernel(q, cache.key_cache, cache.value_cache, tables, lens, rows, one, 1100, batch_invariant=True)
    monkeypatch.setattr(module, "WORK_FLOATS", 3 * 9 * 66)  # one row's partitions a call
    split = poisoned(tuple(q.shape), torch.bfloat16)
    kernel(q, cache.key_cache, cache.value_cache, tables, lens, rows, split, 1100, batch_invariant=True)
    assert torch.equal(one, split)
