"""Store-KV (quantize on write) and paged attention (prefill, and the unsplit decode kernel kept as
the benchmark baseline) over a block table. FlashDecoding: test_paged_attention_decode.py."""

from __future__ import annotations

import math

import pytest
import torch

from lmfoundry.kernels import kv_layout, paged_attention, paged_kv
from lmfoundry.kernels.error_bounds import U32, assert_within, assert_written, attention_bound, poisoned
from lmfoundry.kernels.kv_layout import PagedKVCache

E4M3 = torch.float8_e4m3fn
PAGE = 16


def build(lens, hkv, d, dtype, cache_dtype, gen, num_blocks=None):
    """A cache holding len tokens per sequence on shuffled pages, filled by the reference store."""
    per_seq = [-(-n // PAGE) for n in lens]
    num_blocks = num_blocks or sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        table[b, :nb] = perm[used : used + nb]
        used += nb
    slots = torch.cat([table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE for b, n in enumerate(lens)])
    k = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens), hkv, d, generator=gen).to(dtype)

    def scale(x):  # calibrated per head with 0-10 % headroom: no code saturates (or equals the poison)
        amax = x.float().abs().amax(dim=(0, 2))
        return amax / kv_layout.kv_code_max(cache_dtype) * (1 + 0.1 * torch.rand(hkv, generator=gen))

    quantized = cache_dtype in (torch.int8, E4M3)
    cache = PagedKVCache.allocate(num_blocks, PAGE, hkv, d, cache_dtype, "cpu",
                                  scale(k) if quantized else None, scale(v) if quantized else None)
    kv_layout.store_reference(k, v, cache, slots.to(torch.int32))
    return cache, table, slots.to(torch.int32), k, v


def to(cache: PagedKVCache, device: str) -> PagedKVCache:
    return PagedKVCache(cache.key_cache.to(device), cache.value_cache.to(device), cache.k_scale.to(device),
                        cache.v_scale.to(device))


@pytest.mark.parametrize("cache_dtype", ["model", torch.int8, E4M3])
def test_store_kv_quantizes_on_write(cache_dtype, gen, device):
    dtype, hkv, d = torch.bfloat16, 3, 64
    cdt = dtype if cache_dtype == "model" else cache_dtype
    lens = [20, 5]
    ref_cache, table, slots, k, v = build(lens, hkv, d, dtype, cdt, gen)
    slots = slots.clone()
    slots[3] = -1  # a padding token: must not be written anywhere
    cache = PagedKVCache(poisoned(tuple(ref_cache.key_cache.shape), cdt), poisoned(tuple(ref_cache.key_cache.shape), cdt),
                         ref_cache.k_scale, ref_cache.v_scale)
    cache_d = to(cache, device)
    paged_kv.store_kv(k.to(device), v.to(device), cache_d, slots.to(device))
    got_k = cache_d.key_cache.cpu().view(-1, hkv, d)
    got_v = cache_d.value_cache.cpu().view(-1, hkv, d)
    written = slots[slots >= 0].long()
    assert_written(got_k[written], "stored keys")
    assert_written(got_v[written], "stored values")
    untouched = torch.ones(got_k.shape[0], dtype=torch.bool)
    untouched[written] = False
    for got in (got_k, got_v):
        left = got[untouched].float() if cdt.is_floating_point else got[untouched]
        assert (left.isnan().all() if cdt.is_floating_point else (left == -128).all()), "only given slots are written"
    keep = slots >= 0
    for got, src, scale in ((got_k, k, cache.k_scale), (got_v, v, cache.v_scale)):
        deq = kv_layout.dequantize_kv(got[written], scale).double()
        x = src[keep].double()
        s = scale.double()[:, None]
        if cdt == torch.int8:
            bound = s / 2 * (1 + 8 * U32) + 4 * U32 * x.abs()
        elif cdt == E4M3:
            bound = 2.0**-4 * x.abs() * (1 + 8 * U32) + 2.0**-10 * s
        else:
            bound = torch.zeros_like(x)
        assert_within(deq, x, bound, f"stored {cdt}")


CASES = [
    # dtype, cache dtype, Hq, Hkv, D, ctx lens, q lens
    (torch.float16, "model", 4, 2, 64, [70, 1, 33], [70, 1, 5]),
    (torch.bfloat16, torch.int8, 6, 2, 64, [40, 17], [3, 17]),
    (torch.float16, E4M3, 4, 4, 64, [65, 9], [65, 2]),
    (torch.bfloat16, "model", 2, 1, 80, [30], [30]),
]


@pytest.mark.parametrize("dtype,cache_dtype,hq,hkv,d,lens,q_lens", CASES)
def test_prefill(dtype, cache_dtype, hq, hkv, d, lens, q_lens, gen, device):
    cdt = dtype if cache_dtype == "model" else cache_dtype
    cache, table, _, _, _ = build(lens, hkv, d, dtype, cdt, gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    out = poisoned(tuple(q.shape), dtype, device)
    paged_attention.paged_prefill(q.to(device), to(cache, device), table.to(device), cu.to(device), ctx.to(device),
                                  max(q_lens), out=out)
    assert_written(out, "prefill")
    sm = 1 / math.sqrt(d)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    assert_within(out.cpu(), ref, attention_bound(q, cache, table, cu, ctx, ref, sm, dtype), "prefill")


@pytest.mark.parametrize("dtype,cache_dtype,hq,hkv,d,lens", [(torch.bfloat16, "model", 4, 2, 64, [70, 1, 33]),
                                                             (torch.float16, torch.int8, 6, 3, 64, [16, 100, 0]),
                                                             (torch.bfloat16, E4M3, 2, 2, 128, [5])])
def test_decode_unsplit(dtype, cache_dtype, hq, hkv, d, lens, gen, device):
    """The FlashDecoding body with one query row and fp32 FMA products (`paged_decode_kernel`): P
    exact in fp32, so the bound is the unsplit one; an empty context gives 0, as the split kernel's."""
    cdt = dtype if cache_dtype == "model" else cache_dtype
    cache, table, _, _, _ = build(lens, hkv, d, dtype, cdt, gen)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    out = poisoned(tuple(q.shape), dtype, device)
    paged_attention.paged_decode_unsplit(q.to(device), to(cache, device), table.to(device), ctx.to(device), out=out)
    assert_written(out, "decode")
    sm = 1 / math.sqrt(d)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    assert_within(out.cpu(), ref, attention_bound(q, cache, table, cu, ctx, ref, sm, torch.float32), "decode")


def test_causal_mask_matters(gen, device):
    """The bound is tight enough to catch a kernel that ignores causality (sanity of the test)."""
    dtype, hq, hkv, d = torch.float16, 2, 2, 64
    cache, table, _, _, _ = build([40], hkv, d, dtype, dtype, gen)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    ctx = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(40, hq, d, generator=gen).to(dtype)
    sm = 1 / math.sqrt(d)
    ref = paged_attention.reference(q, cache, table, cu, ctx, sm)
    # What a kernel ignoring causality would compute: every query attends to all 40 keys.
    full = torch.cat([paged_attention.reference(q[i : i + 1], cache, table, torch.tensor([0, 1], dtype=torch.int32), ctx, sm)
                      for i in range(40)])
    bound = attention_bound(q, cache, table, cu, ctx, ref, sm, dtype)
    with pytest.raises(AssertionError):
        assert_within(full, ref, bound, "non-causal")


@pytest.mark.parametrize("cache_dtype,lo,hi", [(torch.int8, -128, 127), (E4M3, -448, 448)])
def test_store_kv_saturates_like_the_runtime(cache_dtype, lo, hi, device):
    """Out-of-range values clamp to the storage range (as lmfoundry.model.kv_quant does)."""
    cache = PagedKVCache.allocate(1, PAGE, 1, 64, cache_dtype, device, torch.tensor([0.5]), torch.tensor([0.5]))
    k = torch.zeros(1, 1, 64, dtype=torch.float16)
    k[0, 0, :3] = torch.tensor([-500.0, 500.0, 1.25])  # 1.25 / 0.5 = 2.5: an exact tie
    paged_kv.store_kv(k.to(device), k.to(device), cache, torch.tensor([5], dtype=torch.int32, device=device))
    codes = cache.key_cache.cpu()[0, 5, 0, :3].float()
    assert codes.tolist()[:2] == [lo, hi]
    assert codes[2].item() == (2.0 if cache_dtype == torch.int8 else 2.5)  # half to even / exact in e4m3
