"""The CPU KV store (`runtime/cpu/native/store_kv.c`) against `kv_layout.store_reference`: the same cache
bits, padding slots skipped, rows from strided views (a fused q/k/v output) copied as they are."""

from __future__ import annotations

import pytest
import torch

from lmfoundry.kernels.kv_layout import PagedKVCache, store_reference
from lmfoundry.runtime.cpu.native.build import unavailable_reason
from lmfoundry.runtime.cpu.native.store_kv import load_store_kv

kernel = load_store_kv()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"no native kernel: {unavailable_reason('store_kv')}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_same_bits_as_the_reference(gen, dtype) -> None:
    hkv, d, t = 3, 64, 7
    fused = torch.randn(t, (4 + 2 * hkv) * d, generator=gen).to(dtype)  # q | k | v side by side, as qkv_proj
    k = fused[:, 4 * d : (4 + hkv) * d].view(t, hkv, d)
    v = fused[:, (4 + hkv) * d :].view(t, hkv, d)
    slots = torch.tensor([5, 0, -1, 17, 63, 30, -1])
    caches = []
    for _ in range(2):
        cache = PagedKVCache.allocate(4, 16, hkv, d, dtype, "cpu")
        cache.key_cache.copy_(torch.randn(cache.key_cache.shape, generator=gen))  # old contents, kept where not written
        cache.value_cache.copy_(cache.key_cache + 1)
        caches.append(cache)
    caches[1].key_cache.copy_(caches[0].key_cache)
    caches[1].value_cache.copy_(caches[0].value_cache)
    kernel(k, v, caches[0].key_cache, caches[0].value_cache, slots)
    store_reference(k, v, caches[1], slots)
    assert torch.equal(caches[0].key_cache.view(torch.uint8), caches[1].key_cache.view(torch.uint8))
    assert torch.equal(caches[0].value_cache.view(torch.uint8), caches[1].value_cache.view(torch.uint8))


def test_mismatched_arguments_are_refused(gen) -> None:
    cache = PagedKVCache.allocate(2, 16, 2, 64, torch.bfloat16, "cpu")
    k = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="store_kv"):
        kernel(k.float(), k.float(), cache.key_cache, cache.value_cache, torch.arange(3))
    with pytest.raises(ValueError, match="int64"):
        kernel(k, k, cache.key_cache, cache.value_cache, torch.arange(3, dtype=torch.int32))
