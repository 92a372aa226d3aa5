"""Writing a step's K/V rows into the paged cache on CPU (`store_kv.c`); the reference is
`lmfoundry.kernels.kv_layout.store_reference`."""

from __future__ import annotations

import ctypes

import torch

from lmfoundry.runtime.cpu.native.build import bound

_c_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class StoreKV:
    """The built copy with its C signature; `__call__` checks what the C side cannot."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.lmf_store_kv
        fn.restype = None
        fn.argtypes = [_ptr, _c_i64, _c_i64, _ptr, _c_i64, _c_i64, _ptr, _ptr, _ptr, _c_i64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int]
        self._fn = fn

    def __call__(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k, v: [T, Hkv, D] (each head's D contiguous) into the caches' slots ([T] int64; < 0
        skipped); caches contiguous [num_blocks, block_size, Hkv, D] of k's dtype."""
        hkv, d = key_cache.shape[2], key_cache.shape[3]
        if not (k.dtype == v.dtype == key_cache.dtype == value_cache.dtype) or k.shape != v.shape \
                or k.shape[1:] != (hkv, d) or k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError(f"store_kv: k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)} {v.dtype} into a "
                             f"{tuple(key_cache.shape)} {key_cache.dtype} cache")
        if not (key_cache.is_contiguous() and value_cache.is_contiguous() and slots.dtype == torch.int64
                and slots.is_contiguous() and slots.shape[0] == k.shape[0]):
            raise ValueError("store_kv: caches must be contiguous and slots contiguous int64, one per row")
        self._fn(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                 key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), k.shape[0], hkv, d,
                 k.element_size())


def load_store_kv() -> StoreKV | None:
    """The copy, built on first use; None where it cannot be built or is turned off."""
    return bound("store_kv", StoreKV)
